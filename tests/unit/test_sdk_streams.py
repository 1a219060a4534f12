"""run_code, contexts and commands (streamed NDJSON, reattach) against the fake server."""

from __future__ import annotations

import pytest

from agentbox import AgentBox, CommandHandle, exceptions
from agentbox._streams import CommandOutput, ExecutionBuilder
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    ndjson,
    reply,
    sandbox_json,
    sequence,
)

SB = "/v1/sandboxes/sb1"
PNG = "iVBORw0KGgo="
EXECUTION = {"stdout": "hi\n", "stderr": "", "execution_count": 3, "duration_ms": 2.0,
             "error": None, "truncated": False,
             "results": [{"text/plain": "<Figure>", "image/png": PNG, "is_main_result": False},
                         {"text/plain": "42", "application/json": 42, "is_main_result": True}]}
RUN_EVENTS = [{"type": "stdout", "data": "a\n"}, {"type": "stderr", "data": "w\n"},
              {"type": "result", "result": {"text/plain": "7", "is_main_result": True}},
              {"type": "error", "error": {"name": "ValueError", "value": "v",
                                          "traceback": "Traceback...\nValueError: v"}},
              {"type": "end", "execution_count": 1, "duration_ms": 5.0}]


@pytest.fixture
def sandbox():
    with FakeServer() as srv, AgentBox(api_key=KEY, base_url=srv.url) as box:
        srv.on("GET", SB, reply(sandbox_json()))
        sb = box.connect("sb1")
        sb.srv = srv
        yield sb


def test_run_code_json(sandbox):
    sandbox.srv.on("POST", SB + "/run_code", reply(EXECUTION))
    ex = sandbox.run_code("x", context="ctx1", timeout=9, env={"A": "b"})
    assert sandbox.srv.seen("POST")[-1].json == {"code": "x", "language": "python",
                                                 "stream": False, "context": "ctx1",
                                                 "timeout": 9, "env": {"A": "b"}}
    assert ex.text == "42" and ex.stdout == "hi\n" and ex.execution_count == 3
    fig, main = ex.results
    assert fig.png == PNG and fig.image_bytes().startswith(b"\x89PNG") and not fig.is_main_result
    assert main.json == 42 and main.formats() == ["text/plain", "application/json"]
    assert ex.error is None and ex.logs == {"stdout": "hi\n", "stderr": ""}


def test_run_code_streams_to_callbacks(sandbox):
    sandbox.srv.on("POST", SB + "/run_code", ndjson(RUN_EVENTS))
    got = []
    ex = sandbox.run_code("x", on_stdout=lambda s: got.append(("out", s)),
                          on_stderr=lambda s: got.append(("err", s)),
                          on_result=lambda r: got.append(("res", r.text)),
                          on_error=lambda e: got.append(("error", e.name)))
    assert sandbox.srv.seen("POST")[-1].json["stream"] is True
    assert got == [("out", "a\n"), ("err", "w\n"), ("res", "7"), ("error", "ValueError")]
    assert ex.text == "7" and ex.error.value == "v" and ex.duration_ms == 5.0
    assert str(ex.error) == "ValueError: v"


def test_run_code_stream_cut_short_raises(sandbox):
    sandbox.srv.on("POST", SB + "/run_code", ndjson(RUN_EVENTS[:2]))
    with pytest.raises(exceptions.StreamInterruptedError):
        sandbox.run_code("x", on_stdout=print)


def test_run_code_errors_before_the_stream_are_typed(sandbox):
    sandbox.srv.on("POST", SB + "/run_code", error(404, "context_not_found"))
    with pytest.raises(exceptions.ContextNotFoundError):
        sandbox.run_code("x", context="nope", on_stdout=print)


def test_contexts(sandbox):
    ctx = {"name": "c1", "language": "python", "cwd": "/root", "pid": None, "running": False,
           "execution_count": 0, "created_at": 1.0}
    sandbox.srv.on("POST", SB + "/contexts", reply(ctx, 201))
    sandbox.srv.on("GET", SB + "/contexts", reply({"contexts": [ctx]}))
    sandbox.srv.on("DELETE", SB + "/contexts/c1", empty())
    sandbox.srv.on("POST", SB + "/run_code", reply(EXECUTION))
    c = sandbox.create_code_context("c1", cwd="/tmp")
    assert sandbox.srv.seen("POST")[-1].json == {"name": "c1", "cwd": "/tmp"}
    assert sandbox.list_code_contexts() == [c] and c.id == "c1"
    sandbox.run_code("1", context=c)
    assert sandbox.srv.seen("POST")[-1].json["context"] == "c1"
    sandbox.remove_code_context(c)
    assert sandbox.srv.seen("DELETE")[-1].path == SB + "/contexts/c1"


def test_foreground_command(sandbox):
    sandbox.srv.on("POST", SB + "/commands", ndjson([
        {"type": "start", "pid": 7},
        {"type": "stdout", "data": "o1\n", "offset": 0, "next_offset": 3},
        {"type": "stderr", "data": "e\n", "offset": 3, "next_offset": 5},
        {"type": "exit", "exit_code": 3, "offset": 5, "timed_out": False}]))
    out = []
    res = sandbox.commands.run("make", env={"X": "1"}, cwd="src", timeout=5,
                               on_stdout=out.append)
    assert sandbox.srv.seen("POST")[-1].json == {
        "command": "make", "background": False, "stdin": False, "env": {"X": "1"},
        "cwd": "/root/src", "timeout": 5}
    assert (res.pid, res.stdout, res.stderr, res.exit_code) == (7, "o1\n", "e\n", 3)
    assert out == ["o1\n"] and not res.ok and res.error == "e\n"


def test_foreground_command_cut_short(sandbox):
    sandbox.srv.on("POST", SB + "/commands", ndjson([{"type": "start", "pid": 7}]))
    with pytest.raises(exceptions.StreamInterruptedError):
        sandbox.commands.run("sleep 100")


def _bg(sandbox, pid=9):
    info = {"pid": pid, "command": "c", "cwd": "/root", "background": True, "stdin": True,
            "running": True, "exit_code": None, "started_at": 1.0, "finished_at": None,
            "timed_out": False, "output_bytes": 0}
    sandbox.srv.on("POST", SB + "/commands", reply(info, 201))
    sandbox.srv.on("GET", SB + f"/commands/{pid}", reply(info))
    return info


def test_background_command_reattaches_after_a_cut(sandbox):
    _bg(sandbox)
    sandbox.srv.on("GET", SB + "/commands/9/output", sequence(
        ndjson([{"type": "stdout", "data": "l1\n", "offset": 0, "next_offset": 3}]),  # cut
        ndjson([{"type": "dropped", "offset": 3, "next_offset": 10},
                {"type": "stdout", "data": "l3\n", "offset": 10, "next_offset": 13},
                {"type": "exit", "exit_code": 0, "offset": 13}])))
    handle = sandbox.commands.run("c", background=True, stdin=True)
    assert isinstance(handle, CommandHandle) and handle.pid == 9
    assert sandbox.srv.seen("POST")[-1].json["background"] is True
    seen = []
    res = handle.wait(on_stdout=seen.append)
    assert res.stdout == "l1\nl3\n" and res.exit_code == 0 and seen == ["l1\n", "l3\n"]
    offsets = [r.query for r in sandbox.srv.seen("GET", SB + "/commands/9/output")]
    assert offsets == [{"offset": "0", "follow": "1"}, {"offset": "3", "follow": "1"}]
    assert handle.offset == 13 and handle.exit_code == 0


def test_background_command_gives_up_after_repeated_cuts(sandbox, monkeypatch):
    monkeypatch.setattr("agentbox.commands.time.sleep", lambda s: None)
    _bg(sandbox)
    sandbox.srv.on("GET", SB + "/commands/9/output", ndjson([]))
    handle = sandbox.commands.connect(9, offset=42)
    with pytest.raises(exceptions.StreamInterruptedError, match="offset=42"):
        handle.wait()
    assert len(sandbox.srv.seen("GET", SB + "/commands/9/output")) == 6


def test_iterating_a_handle_yields_chunks(sandbox):
    _bg(sandbox)
    sandbox.srv.on("GET", SB + "/commands/9/output", ndjson([
        {"type": "stdout", "data": "a", "offset": 0, "next_offset": 1},
        {"type": "stderr", "data": "b", "offset": 1, "next_offset": 2},
        {"type": "exit", "exit_code": -9, "offset": 2}]))
    handle = sandbox.commands.connect(9)
    chunks = [(c.stream, c.data, c.next_offset) for c in handle]
    assert chunks == [("stdout", "a", 1), ("stderr", "b", 2)] and handle.exit_code == -9


def test_wait_timeout(sandbox):
    _bg(sandbox)
    sandbox.srv.on("GET", SB + "/commands/9/output", ndjson(
        [{"type": "stdout", "data": "a", "offset": 0, "next_offset": 1}] * 50, delay=0.05))
    with pytest.raises(exceptions.TimeoutError):
        sandbox.commands.connect(9).wait(timeout=0.5)


def test_stdin_signals_list(sandbox):
    info = _bg(sandbox)
    sandbox.srv.on("POST", SB + "/commands/9/stdin", empty())
    sandbox.srv.on("POST", SB + "/commands/9/signal", sequence(empty(), error(409, "not_running")))
    sandbox.srv.on("GET", SB + "/commands", reply({"commands": [info]}))
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    handle.send_stdin("abc")
    handle.close_stdin()
    stdin = sandbox.srv.seen("POST", SB + "/commands/9/stdin")
    assert [(r.body, r.query) for r in stdin] == [(b"abc", {}), (b"", {"eof": "1"})]
    assert handle.kill() is True and sandbox.commands.kill(9) is False
    assert sandbox.srv.seen("POST", SB + "/commands/9/signal")[0].json == {"signal": "SIGKILL"}
    assert [p.pid for p in sandbox.commands.list()] == [9]
    assert handle.info().running and sandbox.commands.get(9).command == "c"
    sandbox.srv.on("GET", SB + "/commands/10", error(404, "process_not_found"))
    with pytest.raises(exceptions.ProcessNotFoundError):
        sandbox.commands.connect(10)


def test_builders_ignore_unknown_events():
    b = ExecutionBuilder()
    assert b.feed({"type": "novel"}) is None
    b.feed({"type": "end"})
    assert b.finish().results == []
    out = CommandOutput()
    out.feed({"type": "novel"})
    with pytest.raises(exceptions.ProtocolError):
        out.feed({"type": "exit"})
