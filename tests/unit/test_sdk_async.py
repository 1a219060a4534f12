"""The async SDK (AsyncAgentBox / AsyncSandbox) against the fake server."""

from __future__ import annotations

import pytest

from agentbox import AsyncAgentBox, AsyncCommandHandle, AsyncSandbox, exceptions
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    ndjson,
    raw,
    reply,
    sandbox_json,
    sequence,
)
from tests.unit.test_sdk_streams import EXECUTION, RUN_EVENTS

SB = "/v1/sandboxes/sb1"


@pytest.fixture
def srv():
    with FakeServer() as server:
        server.on("POST", "/v1/sandboxes", reply(sandbox_json(), 201))
        server.on("GET", SB, reply(sandbox_json()))
        server.on("DELETE", SB, empty())
        yield server


async def test_create_execute_and_context_manager(srv):
    srv.on("POST", SB + "/execute", reply({"stdout": "1\n", "stderr": "", "exit_code": 0,
                                           "duration_ms": 1}))
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        async with await box.create(environment="python", idle_timeout=5) as sandbox:
            assert isinstance(sandbox, AsyncSandbox)
            res = await sandbox.execute("print(1)")
            assert res.stdout == "1\n"
        assert srv.seen("POST")[0].json == {"template": "python", "idle_timeout": 5}
        assert srv.seen("POST")[1].json == {"code": "print(1)", "language": "python"}
        assert len(srv.seen("DELETE")) == 1
        async with await box.connect("sb1"):
            pass
        assert len(srv.seen("DELETE")) == 1
        assert [s.id for s in [await box.get("sb1")]] == ["sb1"]


async def test_classmethods_and_errors(srv, monkeypatch):
    monkeypatch.setenv("AGENTBOX_API_KEY", KEY)
    monkeypatch.setenv("AGENTBOX_URL", srv.url)
    sandbox = await AsyncSandbox.create()
    assert await sandbox.kill() is True
    await sandbox.aclose()
    srv.on("POST", "/v1/sandboxes", error(404, "template_not_found"))
    with pytest.raises(exceptions.TemplateNotFoundError):
        await AsyncSandbox.create("nope")
    srv.on("GET", SB, error(404, "sandbox_not_found"))
    with pytest.raises(exceptions.SandboxNotFoundError):
        await AsyncSandbox.connect("sb1")
    srv.on("GET", "/v1/sandboxes", reply({"sandboxes": [sandbox_json()]}))
    assert [s.id for s in await AsyncSandbox.list()] == ["sb1"]


async def test_files_round_trip(srv):
    async def upload(request):
        from aiohttp import web
        body = await request.read()
        return web.json_response({"path": request.query["path"], "name": "f", "type": "file",
                                  "size": len(body), "mode": 420, "mtime": 1.0}, status=201)
    srv.on("POST", SB + "/files", upload)
    srv.on("GET", SB + "/files/tmp/f", raw(b"data"))
    srv.on("GET", SB + "/files/tmp", raw(b'{"path": "/tmp", "entries": []}', "application/json"))
    srv.on("GET", SB + "/files/none", error(404, "not_found", "no such file"))
    srv.on("GET", SB + "/stat/tmp/f", raw(b'{"path": "/tmp/f", "name": "f", "type": "file", '
                                          b'"size": 4, "mode": 420, "mtime": 1}',
                                          "application/json"))
    srv.on("GET", SB + "/stat/none", error(404, "not_found", "no such file"))
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        sandbox = await box.connect("sb1")
        progress = []
        info = await sandbox.files.write("/tmp/f", b"data" * 1000,
                                         on_progress=lambda d, t: progress.append(d))
        assert info.size == 4000 and progress[-1] == 4000
        assert (await sandbox.upload("/tmp/g", "text")).size == 4
        assert srv.seen("POST", SB + "/files")[-1].headers["Content-Length"] == "4"
        assert await sandbox.files.read("/tmp/f") == "data"
        assert await sandbox.download("/tmp/f") == b"data"
        stream = await sandbox.files.read("/tmp/f", format="stream")
        assert [c async for c in stream] == [b"data"]
        assert await sandbox.files.list("/tmp") == []
        assert await sandbox.files.exists("/tmp/f") and not await sandbox.files.exists("/none")
        with pytest.raises(exceptions.InvalidArgumentError):
            await sandbox.files.read("/tmp")


async def test_run_code_stream_with_async_callbacks(srv):
    srv.on("POST", SB + "/run_code", sequence(reply(EXECUTION), ndjson(RUN_EVENTS)))
    got = []

    async def on_stdout(data):
        got.append(data)

    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        sandbox = await box.connect("sb1")
        assert (await sandbox.run_code("x")).text == "42"
        ex = await sandbox.run_code("x", on_stdout=on_stdout, on_result=got.append)
    assert got[0] == "a\n" and got[1].text == "7" and ex.error.name == "ValueError"


async def test_commands_background_reattach_and_foreground(srv):
    info = {"pid": 9, "command": "c", "running": True}
    srv.on("POST", SB + "/commands", sequence(reply(info, 201), ndjson([
        {"type": "start", "pid": 10}, {"type": "stdout", "data": "fg"},
        {"type": "exit", "exit_code": 0}])))
    srv.on("GET", SB + "/commands/9", reply(info))
    srv.on("POST", SB + "/commands/9/signal", error(409, "not_running"))
    srv.on("GET", SB + "/commands/9/output", sequence(
        ndjson([{"type": "stdout", "data": "x", "offset": 0, "next_offset": 1}]),
        ndjson([{"type": "stdout", "data": "y", "offset": 1, "next_offset": 2},
                {"type": "exit", "exit_code": 1, "offset": 2}])))
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        sandbox = await box.connect("sb1")
        handle = await sandbox.commands.run("c", background=True)
        assert isinstance(handle, AsyncCommandHandle)
        chunks = [c.data async for c in handle]
        assert chunks == ["x", "y"] and handle.exit_code == 1
        assert (await handle.wait()).stdout == "xy"  # already finished: no new request
        assert len(srv.seen("GET", SB + "/commands/9/output")) == 2
        assert await handle.kill() is False
        res = await sandbox.commands.run("echo fg", on_stdout=lambda s: None)
        assert res.stdout == "fg" and res.pid == 10
        again = await sandbox.commands.connect(9, offset=1)
        assert again.offset == 1


async def test_lifecycle_and_urls(srv):
    srv.on("POST", SB + "/suspend", reply(sandbox_json(state="suspended")))
    srv.on("POST", SB + "/resume", reply(sandbox_json()))
    srv.on("PATCH", SB, reply(sandbox_json(idle_timeout=9)))
    srv.on("GET", "/v1/info", reply({"preview_url_template": "http://{port}-{id}.x:1"}))
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        sandbox = await box.connect("sb1")
        assert (await sandbox.pause()).state == "suspended"
        assert (await sandbox.resume()).state == "running" and await sandbox.is_running()
        assert (await sandbox.set_idle_timeout(9)).idle_timeout == 9
        assert await sandbox.get_url(80) == "http://80-sb1.x:1"
        assert await sandbox.get_host(80) == "80-sb1.x:1"
        assert sandbox.terminal_url().startswith("ws://127.0.0.1:")
        srv.on("DELETE", SB, error(404, "sandbox_not_found"))
        assert await box.kill("sb1") is False
