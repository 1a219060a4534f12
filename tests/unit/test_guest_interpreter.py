"""The code interpreter (/contexts, /run_code) against the real agent app and real workers."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
from pathlib import Path

import pytest

from guest import interpreter
from guest.agent import create_app
from guest.interpreter import ExecutionCollector
from guest.protocol import ContextInfo, Execution, Health

pytestmark = pytest.mark.timeout(60)
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_PANDAS = importlib.util.find_spec("pandas") is not None


@pytest.fixture
async def client(aiohttp_client, tmp_path):
    return await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))


async def run(client, code: str, **body) -> Execution:
    resp = await client.post("/run_code", json={"code": code, **body})
    assert resp.status == 200, await resp.text()
    return Execution.from_dict(await resp.json())


async def stream(client, code: str, **body) -> list[dict]:
    resp = await client.post("/run_code", json={"code": code, "stream": True, **body})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in (await resp.text()).splitlines()]


def merged(events: list[dict]) -> list[dict]:
    """Adjacent output of one stream as one event (how writes are split is not a contract)."""
    out: list[dict] = []
    for e in events:
        if out and e["type"] in ("stdout", "stderr") and out[-1]["type"] == e["type"]:
            out[-1] = {**out[-1], "data": out[-1]["data"] + e["data"]}
        else:
            out.append(e)
    return out


def main_result(ex: Execution) -> dict:
    mains = [r for r in ex.results if r["is_main_result"]]
    assert len(mains) == 1, ex.results
    return mains[0]


async def error_of(resp) -> tuple[int, str]:
    return resp.status, (await resp.json())["error"]["code"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def test_state_and_imports_persist_between_runs(client):
    first = await run(client, "import math\nx = 20\nprint('set')")
    assert (first.stdout, first.error, first.results, first.execution_count) == (
        "set\n", None, [], 1)
    second = await run(client, "y = x + 1\nmath.floor(y * 2.5)")
    assert main_result(second)["text/plain"] == "52"
    assert main_result(second)["application/json"] == 52
    assert second.execution_count == 2 and second.duration_ms >= 0


async def test_last_expression_results(client):
    res = main_result(await run(client, "d = {'a': [1, 2.5, None]}\nd"))
    assert res == {"text/plain": "{'a': [1, 2.5, None]}", "application/json": d_value(),
                   "is_main_result": True}
    res = main_result(await run(client, "class P:\n  def __repr__(self): return 'P!'\nP()"))
    assert res == {"text/plain": "P!", "is_main_result": True}  # not JSON: repr only
    assert (await run(client, "x = 1")).results == []  # an assignment has no value
    assert (await run(client, "None")).results == []
    assert (await run(client, "1 + 1;  # hidden, as in Jupyter")).results == []
    assert main_result(await run(client, "41 + 1"))["text/plain"] == "42"
    assert main_result(await run(client, "_"))["text/plain"] == "42"  # _ is the last value


def d_value() -> dict:
    return {"a": [1, 2.5, None]}


async def test_rich_reprs_and_display(client):
    code = ("class H:\n  def _repr_html_(self): return '<b>hi</b>'\n"
            "  def _repr_png_(self): return b'\\x89PNG'\n"
            "display('first')\nH()")
    ex = await run(client, code)
    assert [r["is_main_result"] for r in ex.results] == [False, True]
    assert ex.results[0]["text/plain"] == "'first'"
    assert ex.results[1]["text/html"] == "<b>hi</b>"
    assert base64.b64decode(ex.results[1]["image/png"]) == b"\x89PNG"


async def test_exception_has_name_value_and_traceback(client):
    ex = await run(client, "print('before')\ndef f():\n    return 1 / 0\nf()")
    assert ex.stdout == "before\n" and ex.results == []
    assert ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    tb = ex.error.traceback
    assert tb.startswith("Traceback (most recent call last):")
    assert 'File "<cell-1>", line 4, in <module>' in tb and "return 1 / 0" in tb
    assert "kernel_worker" not in tb  # the worker's own frames are hidden
    assert tb.rstrip().endswith("ZeroDivisionError: division by zero")
    # The context survives its exceptions.
    assert main_result(await run(client, "f.__name__"))["text/plain"] == "'f'"


async def test_syntax_error_and_system_exit(client):
    ex = await run(client, "x = (\n")
    assert ex.error and ex.error.name == "SyntaxError"
    assert "<cell-1>" in ex.error.traceback and "ast.py" not in ex.error.traceback
    ex = await run(client, "import sys\nsys.exit(3)")
    assert ex.error and (ex.error.name, ex.error.value) == ("SystemExit", "3")
    assert main_result(await run(client, "'still here'"))["text/plain"] == "'still here'"


async def test_top_level_await(client):
    ex = await run(client, "import asyncio\nawait asyncio.sleep(0.01)\nawait asyncio.sleep(0, 'v')")
    assert main_result(ex)["text/plain"] == "'v'"


async def test_contexts_are_independent(client):
    resp = await client.post("/contexts", json={"name": "other"})
    assert resp.status == 201
    info = ContextInfo.from_dict(await resp.json())
    assert info.name == "other" and info.pid and info.execution_count == 0
    await run(client, "x = 'default'")
    await run(client, "x = 'other'", context="other")
    assert main_result(await run(client, "x"))["text/plain"] == "'default'"
    assert main_result(await run(client, "x", context="other"))["text/plain"] == "'other'"
    listing = (await (await client.get("/contexts")).json())["contexts"]
    assert sorted(c["name"] for c in listing) == ["default", "other"]


async def test_context_crud_errors(client, tmp_path):
    resp = await client.post("/contexts", data=b"")  # an empty body: a generated name
    assert resp.status == 201 and (await resp.json())["name"].startswith("ctx-")
    resp = await client.post("/contexts", json={"name": "a", "cwd": str(tmp_path)})
    assert resp.status == 201 and (await resp.json())["cwd"] == str(tmp_path)
    assert await error_of(await client.post("/contexts", json={"name": "a"})) == (
        409, "context_exists")
    assert await error_of(await client.post("/contexts", json={"name": "a b"})) == (
        400, "bad_request")
    assert await error_of(await client.post("/contexts", json={"cwd": "/nonexistent"})) == (
        400, "invalid_cwd")
    ex = await run(client, "import os\nos.getcwd()", context="a")
    assert main_result(ex)["text/plain"] == repr(str(tmp_path))
    assert (await client.delete("/contexts/a")).status == 204
    assert await error_of(await client.delete("/contexts/a")) == (404, "context_not_found")
    resp = await client.post("/run_code", json={"code": "1", "context": "a"})
    assert await error_of(resp) == (404, "context_not_found")
    resp = await client.post("/run_code", json={"code": "1", "language": "r"})
    assert await error_of(resp) == (400, "bad_request")


async def test_run_env_applies_to_that_run_only(client):
    ex = await run(client, "import os\nos.environ.get('RUN_ONLY')", env={"RUN_ONLY": "yes"})
    assert main_result(ex)["text/plain"] == "'yes'"
    ex = await run(client, "os.environ.get('RUN_ONLY')")
    assert ex.results == []  # None
    ex = await run(client, "import subprocess\nsubprocess.run(['sh', '-c', 'echo $CTX_VAR'])",
                   env={"CTX_VAR": "child sees it"})
    assert ex.stdout == "child sees it\n"  # fd-level capture: a child's output is ours too


async def test_streamed_events_keep_their_order(client):
    code = ("import sys, time\n"
            "print('one', flush=True)\n"
            "time.sleep(0.05)\n"
            "print('two', file=sys.stderr, flush=True)\n"
            "display(2)\n"
            "time.sleep(0.05)\n"
            "print('three')\n"
            "raise ValueError('bad')\n")
    events = merged(await stream(client, code))
    kinds = [(e["type"], e.get("data")) for e in events if e["type"] in ("stdout", "stderr")]
    assert kinds == [("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "three\n")]
    order = [e["type"] for e in events]
    assert order == ["stdout", "stderr", "result", "stdout", "error", "end"]
    assert events[-2]["error"]["name"] == "ValueError"
    assert events[-1]["execution_count"] == 1 and events[-1]["duration_ms"] > 0


async def test_streamed_output_arrives_while_running(client):
    resp = await client.post("/run_code", json={
        "code": "import time\nprint('early', flush=True)\ntime.sleep(3)\n'late'", "stream": True})
    seen = ""
    while not seen.endswith("\n"):  # print() may reach the pipe as two writes
        event = json.loads(await asyncio.wait_for(resp.content.readline(), 2.0))
        assert event["type"] == "stdout"
        seen += event["data"]
    assert seen == "early\n"
    rest = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert rest[0]["result"]["text/plain"] == "'late'" and rest[-1]["type"] == "end"


async def test_timeout_interrupts_and_keeps_state(client):
    await run(client, "kept = 'yes'")
    ex = await run(client, "import time\nprint('started', flush=True)\ntime.sleep(30)", timeout=0.5)
    assert ex.stdout == "started\n"
    assert ex.error and ex.error.name == "TimeoutError" and "keeps its state" in ex.error.value
    assert "time.sleep(30)" in ex.error.traceback and ex.duration_ms < 5000
    assert main_result(await run(client, "kept"))["text/plain"] == "'yes'"


async def test_timeout_kills_a_run_that_ignores_the_interrupt(client, monkeypatch):
    monkeypatch.setattr(interpreter, "INTERRUPT_GRACE", 0.3)
    await run(client, "kept = 'yes'")
    old_pid = (await (await client.get("/contexts")).json())["contexts"][0]["pid"]
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(30)"
    ex = await run(client, code, timeout=0.5)
    assert ex.error and ex.error.name == "TimeoutError" and "state" in ex.error.value
    assert "lost" in ex.error.value
    assert not alive(old_pid)
    ex = await run(client, "kept")  # a fresh worker: the state is gone, the context works
    assert ex.error and ex.error.name == "NameError"
    new_pid = (await (await client.get("/contexts")).json())["contexts"][0]["pid"]
    assert new_pid != old_pid


async def test_a_dead_worker_restarts_with_an_error(client):
    await run(client, "x = 1")
    ex = await run(client, "import os\nprint('bye', flush=True)\nos._exit(7)")
    assert ex.stdout == "bye\n"
    assert ex.error and ex.error.name == "ContextRestarted" and "code 7" in ex.error.value
    assert (await run(client, "x")).error.name == "NameError"
    assert main_result(await run(client, "1"))["text/plain"] == "1"


async def test_a_worker_that_dies_between_runs_is_restarted(client):
    await run(client, "import os, threading, time\n"
                      "threading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()")
    await asyncio.sleep(0.6)
    assert main_result(await run(client, "'new'"))["text/plain"] == "'new'"


async def test_deleting_a_context_ends_its_run(client):
    await client.post("/contexts", json={"name": "gone"})
    task = asyncio.ensure_future(run(client, "import time\ntime.sleep(30)", context="gone"))
    await asyncio.sleep(0.5)
    assert (await client.delete("/contexts/gone")).status == 204
    ex = await asyncio.wait_for(task, 10)
    assert ex.error and ex.error.name == "ContextDeleted"


async def test_runs_in_one_context_queue_and_count_as_running(client):
    slow = asyncio.ensure_future(run(client, "import time\ntime.sleep(1)\n'slow'"))
    await asyncio.sleep(0.5)
    health = Health.from_dict(await (await client.get("/health")).json())
    assert health.running == 1
    fast = await run(client, "'fast'")  # queued behind the slow one
    # The slow run's reply may still be in flight to the client on a loaded host; its
    # execution count is what proves the order.
    slow_result = await asyncio.wait_for(slow, 10)
    assert main_result(slow_result)["text/plain"] == "'slow'"
    assert (slow_result.execution_count, fast.execution_count) == (1, 2)


async def test_client_disconnect_interrupts_the_run(client):
    await run(client, "state = 'kept'")
    resp = await client.post("/run_code", json={
        "code": "import time\nprint('go', flush=True)\ntime.sleep(30)", "stream": True})
    await resp.content.readline()
    resp.close()
    for _ in range(50):
        health = Health.from_dict(await (await client.get("/health")).json())
        if health.running == 0:
            break
        await asyncio.sleep(0.1)
    assert health.running == 0
    assert main_result(await run(client, "state"))["text/plain"] == "'kept'"


async def test_workers_are_killed_when_the_agent_stops(aiohttp_client, tmp_path):
    client = await aiohttp_client(create_app(keepawake_dir=str(tmp_path)))
    await run(client, "1")
    pid = (await (await client.get("/contexts")).json())["contexts"][0]["pid"]
    assert alive(pid)
    await client.close()
    for _ in range(50):
        if not alive(pid):
            break
        await asyncio.sleep(0.1)
    assert not alive(pid)


async def test_large_output_is_streamed_whole(client):
    events = await stream(client, "import sys\nsys.stdout.write('x' * 3_000_000)\nNone")
    data = "".join(e["data"] for e in events if e["type"] == "stdout")
    assert len(data) == 3_000_000


async def test_collector_truncates_output(monkeypatch):
    monkeypatch.setattr(interpreter, "MAX_OUTPUT_BYTES", 5)
    c = ExecutionCollector()
    for data in ("abc", "def", "g"):
        await c.emit({"type": "stdout", "data": data})
    await c.emit({"type": "end", "execution_count": 3, "duration_ms": 1.5})
    ex = c.result()
    assert (ex.stdout, ex.truncated, ex.execution_count) == ("abcde", True, 3)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
async def test_matplotlib_figures_come_back_as_png(client):
    ex = await run(client, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\n1")
    assert ex.error is None, ex.error
    figures = [r for r in ex.results if "image/png" in r]
    assert len(figures) == 1 and not figures[0]["is_main_result"]
    assert base64.b64decode(figures[0]["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    assert main_result(ex)["text/plain"] == "1"
    # plt.show() sends the figure at that point; figures do not come back twice.
    ex = await run(client, "plt.plot([3, 1])\nplt.show()\nprint('after')")
    assert [("image/png" in r) for r in ex.results] == [True]
    assert ex.stdout == "after\n" and "non-interactive" not in ex.stderr
    assert (await run(client, "1;")).results == []


@pytest.mark.skipif(not HAS_PANDAS, reason="pandas is not installed")
async def test_dataframe_is_html_and_text(client):
    ex = await run(client, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    res = main_result(ex)
    assert "<table" in res["text/html"] and "a  b" in res["text/plain"]


def test_worker_is_stdlib_only():
    src = Path(interpreter.WORKER).read_text()
    assert "from guest" not in src and "import guest" not in src
    assert os.path.basename(interpreter.WORKER) == "kernel_worker.py"
