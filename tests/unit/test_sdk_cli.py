"""The client CLI commands (in process) against the fake server, and `agentbox shell`'s
WebSocket terminal against a fake terminal endpoint."""

from __future__ import annotations

import asyncio
import io
import json
import os

import pytest
from aiohttp import web

from agentbox import _cli_copy
from agentbox.cli import main
from agentbox.terminal import run_terminal
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    ndjson,
    raw,
    reply,
    sandbox_json,
)
from tests.unit.test_sdk_streams import EXECUTION

SB = "/v1/sandboxes/sb1"


@pytest.fixture
def srv(monkeypatch):
    with FakeServer() as server:
        monkeypatch.setenv("AGENTBOX_API_KEY", KEY)
        monkeypatch.setenv("AGENTBOX_URL", server.url)
        server.on("POST", "/v1/sandboxes", reply(sandbox_json(), 201))
        server.on("GET", "/v1/sandboxes", reply({"sandboxes": [sandbox_json()]}))
        server.on("GET", SB, reply(sandbox_json()))
        server.on("DELETE", SB, empty())
        yield server


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_create_ls_info_rm(srv, capsys):
    assert run(capsys, "create", "--metadata", "a=b", "--idle-timeout", "60")[:2] == (0, "sb1\n")
    assert srv.seen("POST")[-1].json == {"template": "python", "idle_timeout": 60.0,
                                         "metadata": {"a": "b"}}
    code, out, _ = run(capsys, "create", "--json")
    assert json.loads(out)["id"] == "sb1"
    code, out, _ = run(capsys, "ls")
    assert out.splitlines()[0].split() == ["ID", "STATE", "TEMPLATE", "IDLE", "CREATED", "ACTIVE"]
    assert out.splitlines()[1].split()[:4] == ["sb1", "running", "python", "never"]
    assert json.loads(run(capsys, "ls", "--json")[1])[0]["state"] == "running"
    assert "template         python" in run(capsys, "info", "sb1")[1]
    assert run(capsys, "rm", "sb1")[:2] == (0, "removed sb1\n")
    srv.on("DELETE", SB, error(404, "sandbox_not_found"))
    code, out, err = run(capsys, "rm", "--json", "sb1")
    assert code == 1 and json.loads(out) == {"removed": []} and "no sandbox sb1" in err


def test_api_errors_are_reported_not_raised(srv, capsys, monkeypatch):
    srv.on("POST", "/v1/sandboxes", error(503, "sandbox_limit", "host is full"))
    code, _, err = run(capsys, "create")
    assert code == 1 and err == "agentbox: host is full [sandbox_limit]\n"
    code, _, err = run(capsys, "create", "--json")
    assert json.loads(err)["error"]["code"] == "sandbox_limit"
    monkeypatch.delenv("AGENTBOX_API_KEY")
    code, _, err = run(capsys, "ls")
    assert code == 1 and "AGENTBOX_API_KEY" in err
    assert run(capsys, "ls", "--api-key", KEY)[0] == 0


def test_exec_streams_and_returns_the_exit_code(srv, capsys):
    srv.on("POST", SB + "/commands", ndjson([
        {"type": "start", "pid": 3}, {"type": "stdout", "data": "out\n"},
        {"type": "stderr", "data": "err\n"}, {"type": "exit", "exit_code": 4}]))
    code, out, err = run(capsys, "exec", "--env", "A=1", "sb1", "--", "ls", "-la", "a b")
    assert (code, out, err) == (4, "out\n", "err\n")
    assert srv.seen("POST", SB + "/commands")[-1].json == {
        "command": "ls -la 'a b'", "background": False, "stdin": False, "env": {"A": "1"}}
    srv.on("POST", SB + "/execute", reply({"stdout": "x", "stderr": "", "exit_code": 0,
                                           "duration_ms": 1}))
    code, out, _ = run(capsys, "exec", "--json", "sb1", "echo x")
    assert code == 0 and json.loads(out)["stdout"] == "x"
    assert srv.seen("POST", SB + "/execute")[-1].json == {"command": "echo x"}


def test_exec_falls_back_to_execute_on_an_older_server(srv, capsys):
    srv.on("POST", SB + "/execute", reply({"stdout": "old\n", "stderr": "", "exit_code": -9,
                                           "duration_ms": 1, "timed_out": True}))
    code, out, err = run(capsys, "exec", "sb1", "sleep 9")
    assert (code, out) == (137, "old\n") and "timed out" in err


def test_run_code_from_option_file_and_stdin(srv, capsys, tmp_path, monkeypatch):
    srv.on("POST", SB + "/run_code", reply(EXECUTION))
    code, out, err = run(capsys, "run", "--json", "sb1", "-c", "6*7")
    assert code == 0 and json.loads(out)["text"] == "42"
    assert srv.seen("POST")[-1].json["code"] == "6*7"
    script = tmp_path / "s.py"
    script.write_text("print(1)")
    srv.on("POST", SB + "/run_code", ndjson([
        {"type": "stdout", "data": "1\n"},
        {"type": "result", "result": {"text/plain": "'v'", "is_main_result": True}},
        {"type": "result", "result": {"image/png": "iVBORw0KGgo=", "is_main_result": False}},
        {"type": "error", "error": {"name": "E", "value": "v", "traceback": "TB"}},
        {"type": "end", "execution_count": 5}]))
    code, out, err = run(capsys, "run", "--save-images", str(tmp_path / "img"), "sb1",
                         str(script))
    assert code == 1 and out == "1\n'v'\n" and "TB" in err
    assert (tmp_path / "img" / "result-5-1.png").read_bytes().startswith(b"\x89PNG")
    monkeypatch.setattr("sys.stdin", io.StringIO("from_stdin()"))
    run(capsys, "run", "sb1", "-")
    assert srv.seen("POST")[-1].json["code"] == "from_stdin()"


def test_cp_both_ways(srv, capsys, tmp_path):
    async def upload(request):
        body = await request.read()
        return web.json_response({"path": request.query["path"], "name": "f", "type": "file",
                                  "size": len(body), "mode": 420, "mtime": 1.0}, status=201)
    srv.on("POST", SB + "/files", upload)
    srv.on("GET", SB + "/files/tmp/remote.bin", raw(b"remote bytes"))
    local = tmp_path / "local.txt"
    local.write_bytes(b"local bytes")
    code, out, _ = run(capsys, "cp", "--json", str(local), "sb1:/tmp/")
    assert code == 0 and json.loads(out)["path"] == "/tmp/local.txt"
    assert srv.seen("POST", SB + "/files")[-1].body == b"local bytes"
    run(capsys, "cp", str(local), "sb1:/tmp/renamed")
    assert srv.seen("POST", SB + "/files")[-1].query == {"path": "/tmp/renamed"}
    assert run(capsys, "cp", "sb1:/tmp/remote.bin", str(tmp_path))[0] == 0
    assert (tmp_path / "remote.bin").read_bytes() == b"remote bytes"
    code, _, err = run(capsys, "cp", str(local), str(tmp_path / "x"))
    assert code == 1 and "exactly one" in err


def test_cp_endpoint_parsing():
    assert _cli_copy.parse("abc:/x") == _cli_copy.Endpoint("abc", "/x")
    assert _cli_copy.parse("abc:") == _cli_copy.Endpoint("abc", "/root/")
    assert _cli_copy.parse("./a:b").sandbox is None
    assert _cli_copy.parse("/tmp/a:b").sandbox is None
    assert _cli_copy.parse("-").sandbox is None


def test_lifecycle_templates_url(srv, capsys):
    srv.on("POST", SB + "/suspend", reply(sandbox_json(state="suspended")))
    srv.on("POST", SB + "/resume", reply(sandbox_json()))
    srv.on("GET", "/v1/templates", reply({"templates": [{"name": "python", "mem_mib": 512,
                                                         "default": True}]}))
    assert run(capsys, "suspend", "sb1")[1].startswith("sb1 suspended (")
    assert json.loads(run(capsys, "resume", "--json", "sb1")[1])["state"] == "running"
    assert run(capsys, "templates")[1].splitlines()[1].split() == [
        "python", "builtin", "builtin", "ready", "512", "yes"]
    assert run(capsys, "url", "sb1", "8000")[1] == f"http://8000-sb1.localhost:{srv.port}\n"


def test_snapshot_fork_and_templates_rm(srv, capsys):
    srv.on("POST", SB + "/snapshot", reply({"name": "mine", "owner": "tenant",
                                            "source": "snapshot", "paused_ms": 812.4}, 201))
    srv.on("POST", SB + "/fork", reply({"sandboxes": [sandbox_json("f1"),
                                                      sandbox_json("f2")]}, 201))
    srv.on("DELETE", "/v1/templates/mine", empty())
    assert run(capsys, "snapshot", "sb1", "mine")[1] == "mine (sandbox paused 812 ms)\n"
    assert srv.seen("POST")[-1].json == {"template": "mine"}
    assert run(capsys, "fork", "sb1", "-n", "2")[1].split() == ["f1", "f2"]
    assert srv.seen("POST")[-1].json == {"count": 2}
    assert run(capsys, "templates", "rm", "mine")[1] == "removed mine\n"


# -- the terminal ------------------------------------------------------------------------------

def terminal_app(seen: list) -> web.Application:
    async def terminal(request: web.Request) -> web.WebSocketResponse:
        seen.append(request.headers.get("Authorization"))
        seen.append(dict(request.query))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(b"$ ")
        async for msg in ws:
            if msg.type == web.WSMsgType.TEXT:
                seen.append(json.loads(msg.data))
            elif msg.type == web.WSMsgType.BINARY:
                seen.append(msg.data)
                await ws.send_bytes(b"echo:" + msg.data)
                if msg.data == b"\x04":
                    await ws.send_str(json.dumps({"type": "exit", "exit_code": 3}))
                    await ws.close()
        return ws

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "sandbox_not_found",
                                            "message": "sandbox 'gone' not found"}}, status=404)

    app = web.Application()
    app.router.add_get("/v1/sandboxes/sb1/terminal", terminal)
    app.router.add_get("/v1/sandboxes/gone/terminal", missing)
    return app


async def test_terminal_relays_bytes_resize_and_exit(aiohttp_server):
    seen: list = []
    server = await aiohttp_server(terminal_app(seen))
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"ls\n")
    os.close(write_fd)  # EOF after the input: the client sends ^D
    out = io.BytesIO()
    try:
        code = await asyncio.wait_for(run_terminal(
            f"ws://127.0.0.1:{server.port}/v1/sandboxes/sb1/terminal", KEY, read_fd, out), 10)
    finally:
        os.close(read_fd)
    assert code == 3
    assert seen[:2] == [f"Bearer {KEY}", {"cols": "80", "rows": "24"}]
    assert seen[2] == {"type": "resize", "cols": 80, "rows": 24}
    assert seen[3:] == [b"ls\n", b"\x04"]
    assert out.getvalue() == b"$ echo:ls\necho:\x04"


async def test_terminal_handshake_errors_are_typed(aiohttp_server):
    from agentbox import exceptions

    server = await aiohttp_server(terminal_app([]))
    read_fd, write_fd = os.pipe()
    try:
        with pytest.raises(exceptions.SandboxNotFoundError, match="'gone' not found"):
            await run_terminal(f"ws://127.0.0.1:{server.port}/v1/sandboxes/gone/terminal",
                               KEY, read_fd, io.BytesIO())
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_ls_filters_usage_metrics_logs(srv, capsys):
    srv.on("GET", "/v1/usage", reply({"from": 0, "to": 10, "keys": [{
        "key": "k1", "awake_seconds": 5.0, "vcpu_seconds": 5.0, "gib_seconds": 2.5,
        "suspended_seconds": 0.0, "snapshot_gib_hours": 0.0, "restores": 0, "created": 1,
        "destroyed": 0, "sandboxes": [{"sandbox_id": "sb1", "key": "k1", "vcpu_seconds": 5.0}]}]}))
    srv.on("GET", SB + "/metrics", reply({"sandbox_id": "sb1", "state": "running",
                                          "disk_bytes": 4096, "at": 1.0, "cpu_seconds": 2.5}))
    srv.on("GET", SB + "/logs", reply({"sandbox_id": "sb1", "console": ["boot", "hello"],
                                       "events": [{"at": 0, "from": None, "to": "creating",
                                                   "event": "insert", "cause": "api"}]}))
    code, _, _ = run(capsys, "ls", "--state", "running", "--state", "suspended", "--metadata",
                     "user=alice", "--template", "python", "--limit", "5")
    assert code == 0
    assert srv.seen("GET", "/v1/sandboxes")[-1].query == {
        "state": "running,suspended", "template": "python", "metadata.user": "alice",
        "limit": "5"}
    code, out, _ = run(capsys, "usage", "--from", "2026-01-01", "--key", "*", "--sandboxes")
    assert code == 0 and out.splitlines()[1].split()[:3] == ["k1", "5.0", "2.5"]
    query = srv.seen("GET", "/v1/usage")[-1].query
    assert query["key"] == "*" and float(query["from"]) == 1767225600.0
    assert "cpu_seconds      2.5" in run(capsys, "metrics", "sb1")[1]
    code, out, _ = run(capsys, "logs", "sb1", "--tail", "2", "--events")
    assert out.splitlines()[-2:] == ["boot", "hello"] and "insert" in out
    assert srv.seen("GET", SB + "/logs")[-1].query == {"tail": "2"}


def test_list_walks_every_page(srv):
    from agentbox import AgentBox

    pages = {None: {"sandboxes": [sandbox_json()], "next_cursor": "c1"},
             "c1": {"sandboxes": [sandbox_json() | {"id": "sb2"}], "next_cursor": None}}

    async def page(request):
        return web.json_response(pages[request.query.get("cursor")])
    srv.on("GET", "/v1/sandboxes", page)
    with AgentBox() as box:
        assert [s.id for s in box.list(metadata={"n": 1})] == ["sb1", "sb2"]
        assert [s.id for s in box.list(limit=1)] == ["sb1"]
    assert srv.seen("GET", "/v1/sandboxes")[0].query == {"metadata.n": "1", "limit": "100"}
