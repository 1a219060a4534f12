"""Agent-framework tools: definitions, the dispatcher, LangChain, and the MCP server
(a real ``agentbox mcp`` subprocess over stdio, talking to the fake server)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import pytest

from agentbox import AgentBox, AsyncAgentBox
from agentbox.tools import (
    TOOL_NAMES,
    AsyncToolDispatcher,
    ToolDispatcher,
    anthropic_tools,
    openai_responses_tools,
    openai_tools,
)
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    raw,
    reply,
    sandbox_json,
)
from tests.unit.test_sdk_streams import EXECUTION, PNG

SB = "/v1/sandboxes/sb1"
EXEC_OK = {"stdout": "a\n", "stderr": "", "exit_code": 0, "duration_ms": 1}
LISTING = {"path": "/root", "entries": [
    {"path": "/root/d", "name": "d", "type": "dir", "size": 0, "mode": 493, "mtime": 1.0},
    {"path": "/root/f", "name": "f", "type": "file", "size": 12, "mode": 420, "mtime": 1.0}]}


def scripted(srv: FakeServer) -> FakeServer:
    async def upload(request):
        from aiohttp import web
        body = await request.read()
        return web.json_response({"path": request.query["path"], "name": "x", "type": "file",
                                  "size": len(body), "mode": 420, "mtime": 1.0}, status=201)
    srv.on("POST", "/v1/sandboxes", reply(sandbox_json(), 201))
    srv.on("GET", SB, reply(sandbox_json()))
    srv.on("DELETE", SB, empty())
    srv.on("POST", SB + "/run_code", reply(EXECUTION))
    srv.on("POST", SB + "/execute", reply(EXEC_OK))
    srv.on("POST", SB + "/files", upload)
    srv.on("GET", SB + "/files/root/f", raw(b"hello file"))
    srv.on("GET", SB + "/files/root", raw(json.dumps(LISTING).encode(), "application/json"))
    return srv


@pytest.fixture
def srv():
    with FakeServer() as server:
        yield scripted(server)


@pytest.fixture
def dispatch(srv):
    with AgentBox(api_key=KEY, base_url=srv.url) as box:
        yield ToolDispatcher(box.connect("sb1"))


def test_definitions_share_one_schema():
    oa, oar, an = openai_tools(), openai_responses_tools(), anthropic_tools()
    assert [t["function"]["name"] for t in oa] == list(TOOL_NAMES) == [t["name"] for t in an]
    assert TOOL_NAMES == ("run_code", "run_command", "read_file", "write_file", "list_files")
    for o, r, a in zip(oa, oar, an, strict=True):
        assert o["type"] == "function" and r["type"] == "function"
        assert o["function"]["parameters"] == a["input_schema"] == r["parameters"]
        assert a["input_schema"]["type"] == "object" and a["description"]
    assert [t["name"] for t in anthropic_tools(["read_file"])] == ["read_file"]
    with pytest.raises(ValueError):
        openai_tools(["rm_rf"])
    json.dumps(oa), json.dumps(an)  # plain JSON


def test_run_code_output_with_image(dispatch, srv):
    out = dispatch.call("run_code", {"code": "plot()"})
    assert not out.is_error and out.images == [("image/png", PNG)]
    assert "stdout:\nhi\n" in out.text and "[image/png image attached]" in out.text
    assert "42" in out.text
    assert srv.seen("POST", SB + "/run_code")[-1].json["code"] == "plot()"


def test_openai_and_anthropic_message_shapes(dispatch):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "run_command", "arguments": '{"command": "ls", "cwd": "/"}'}}
    msg = dispatch.openai(call)
    assert msg == {"role": "tool", "tool_call_id": "call_1",
                   "content": "exit_code: 0\nstdout:\na\n"}
    obj = SimpleNamespace(id="call_2", function=SimpleNamespace(name="read_file",
                                                                arguments='{"path": "f"}'))
    assert dispatch.openai(obj)["content"] == "hello file"
    block = dispatch.anthropic({"type": "tool_use", "id": "tu_1", "name": "run_code",
                                "input": {"code": "x"}})
    assert block["type"] == "tool_result" and block["tool_use_id"] == "tu_1"
    assert block["is_error"] is False
    assert block["content"][1] == {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PNG}}


def test_files_tools(dispatch, srv):
    out = dispatch.call("write_file", {"path": "notes/a.txt", "content": "abc"})
    assert out.text == "wrote 3 bytes to /root/notes/a.txt"
    assert srv.seen("POST", SB + "/files")[-1].body == b"abc"
    listing = dispatch.call("list_files", {}).text
    assert listing.splitlines()[0] == "/root:" and "d/" in listing and "12  f" in listing


def test_errors_come_back_as_error_results(dispatch, srv):
    assert dispatch.call("nope", {}).is_error
    assert "not valid JSON" in dispatch.call("run_code", "{bad").text
    assert "'code' (a string) is required" in dispatch.call("run_code", {}).text
    srv.on("GET", SB + "/files/missing", error(404, "not_found", "no such file: /missing"))
    out = dispatch.call("read_file", {"path": "/missing"})
    assert out.is_error and "no such file" in out.text
    srv.on("POST", SB + "/execute", reply({**EXEC_OK, "exit_code": 2, "stderr": "bad\n"}))
    out = dispatch.call("run_command", {"command": "false"})
    assert out.is_error and out.text.startswith("exit_code: 2")


def test_long_output_is_cut(srv):
    srv.on("POST", SB + "/execute", reply({**EXEC_OK, "stdout": "x" * 500}))
    with AgentBox(api_key=KEY, base_url=srv.url) as box:
        out = ToolDispatcher(box.connect("sb1"), max_chars=100).call("run_command",
                                                                     {"command": "yes"})
    assert "[400 more characters cut]" in out.text


def test_run_code_falls_back_to_execute_without_the_interpreter(dispatch, srv):
    srv.on("POST", SB + "/run_code", error(404, "not_found", "Not Found"))
    out = dispatch.call("run_code", {"code": "print('a')"})
    assert out.text == "exit_code: 0\nstdout:\na\n"
    assert srv.seen("POST", SB + "/execute")[-1].json == {"code": "print('a')",
                                                          "language": "python"}


async def test_async_dispatcher(srv):
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        dispatch = AsyncToolDispatcher(await box.connect("sb1"))
        assert (await dispatch.call("read_file", {"path": "/root/f"})).text == "hello file"
        msg = await dispatch.openai({"id": "c", "function": {"name": "list_files",
                                                             "arguments": ""}})
        assert msg["content"].startswith("/root:")
        block = await dispatch.anthropic({"id": "t", "name": "run_code", "input": {"code": "1"}})
        assert len(block["content"]) == 2


def test_langchain_tools(srv):
    pytest.importorskip("langchain_core", reason="langchain-core is not installed (extra "
                                                  "'langchain')")
    from agentbox.tools.langchain import langchain_tools

    with AgentBox(api_key=KEY, base_url=srv.url) as box:
        tools = langchain_tools(box.connect("sb1"))
        assert [t.name for t in tools] == list(TOOL_NAMES)
        by_name = {t.name: t for t in tools}
        assert by_name["read_file"].invoke({"path": "/root/f"}) == "hello file"
        assert by_name["run_command"].invoke({"command": "ls"}).startswith("exit_code: 0")


# crewai's own import and Agent warn (ImportWarning, DeprecationWarning): not ours to fix.
@pytest.mark.filterwarnings("ignore::ImportWarning", "ignore::DeprecationWarning",
                            "ignore::PendingDeprecationWarning")
async def test_crewai_tools(srv, monkeypatch):
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")  # no phoning home from a test
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    pytest.importorskip("crewai", reason="crewai is not installed (extra 'crewai')")
    from crewai import Agent

    from agentbox.tools.crewai import crewai_tools

    with AgentBox(api_key=KEY, base_url=srv.url) as box:
        tools = crewai_tools(box.connect("sb1"))
        assert [t.name for t in tools] == list(TOOL_NAMES)
        by_name = {t.name: t for t in tools}
        assert by_name["read_file"].run(path="/root/f") == "hello file"
        assert by_name["run_command"].run(command="ls").startswith("exit_code: 0")
        assert srv.seen("POST", SB + "/execute")[-1].json == {"command": "ls"}  # no None args
        schema = by_name["run_command"].args_schema.model_json_schema()
        assert schema["required"] == ["command"] and set(schema["properties"]) == {
            "command", "cwd", "timeout"}
        agent = Agent(role="analyst", goal="answer with data", backstory="careful",
                      tools=tools, llm="gpt-4o-mini")  # no model call: only built
        assert [t.name for t in agent.tools] == list(TOOL_NAMES)
        async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as abox:
            atools = crewai_tools(box.connect("sb1"), ["read_file"],
                                  async_sandbox=await abox.connect("sb1"))
            assert await atools[0].arun(path="/root/f") == "hello file"


async def test_claude_agent_sdk_connects_to_the_mcp_server(srv, tmp_path):
    """The real Claude Agent SDK (its bundled Claude Code CLI) starts `agentbox mcp` from
    the options our helper builds and sees the five tools. No model is called (no API key
    here): the CLI reports its MCP servers before any prompt."""
    sdk = pytest.importorskip("claude_agent_sdk", reason="claude-agent-sdk is not installed")
    from agentbox.tools.claude_agent import allowed_tools, mcp_servers

    servers = mcp_servers(api_key=KEY, base_url=srv.url,
                          env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert servers["agentbox"]["env"]["AGENTBOX_URL"] == srv.url
    options = sdk.ClaudeAgentOptions(
        mcp_servers=servers, allowed_tools=allowed_tools(), setting_sources=[], cwd=tmp_path,
        env={"ANTHROPIC_API_KEY": "sk-unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
             "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "HOME": str(tmp_path)})
    async with sdk.ClaudeSDKClient(options=options) as client:
        for _ in range(240):
            status = (await client.get_mcp_status())["mcpServers"][0]
            if status["status"] != "pending":
                break
            await asyncio.sleep(0.25)
    assert status["status"] == "connected", status
    names = [t["name"] for t in status["tools"]]
    assert names == list(TOOL_NAMES)
    assert allowed_tools() == [f"mcp__agentbox__{n}" for n in names]


async def test_mcp_server_over_stdio(srv, tmp_path):
    mcp = pytest.importorskip("mcp", reason="the mcp package is not installed (extra 'mcp')")
    from mcp.client.stdio import stdio_client

    env = {**os.environ, "AGENTBOX_API_KEY": KEY, "AGENTBOX_URL": srv.url}
    params = mcp.StdioServerParameters(command=sys.executable,
                                       args=["-m", "agentbox", "mcp"], env=env)
    with open(tmp_path / "mcp.log", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                mcp.ClientSession(read, write) as session:
            await session.initialize()
            tools = (await session.list_tools()).tools
            assert [t.name for t in tools] == list(TOOL_NAMES)
            assert not srv.seen("POST", "/v1/sandboxes")  # created lazily
            res = await session.call_tool("run_code", {"code": "plot()"})
            kinds = [c.type for c in res.content]
            assert kinds == ["text", "image"] and "42" in res.content[0].text
            await session.call_tool("run_command", {"command": "ls"})
            assert len(srv.seen("POST", "/v1/sandboxes")) == 1  # one sandbox per session
            srv.on("GET", SB + "/files/nope", error(404, "not_found", "no such file"))
            bad = await session.call_tool("read_file", {"path": "/nope"})
            assert _is_error(bad) and "no such file" in bad.content[0].text
    assert srv.seen("DELETE", SB), "the session's sandbox is deleted when the session ends"


def _is_error(result) -> bool:
    return bool(getattr(result, "is_error", None) or getattr(result, "isError", None))
