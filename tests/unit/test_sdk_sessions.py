"""Sessions and preview access in the SDK (sync and async) and the CLI, against the fake
server: request shapes, the models they parse into, URLs and errors."""

from __future__ import annotations

import json

import pytest

from agentbox import AgentBox, AsyncAgentBox, AsyncSandbox, Sandbox, Session, exceptions
from agentbox.cli import main
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    reply,
    sandbox_json,
)

SB = "/v1/sandboxes/sb1"
S = "/v1/sessions/web"
INFO = {"version": "1", "preview_url_template": "https://{port}-{id}.pv.example.com",
        "session_url_template": "https://{name}.s.example.com"}


def session_json(name: str = "web", sid: str | None = "sb1", **extra):
    return {"name": name, "sandbox_id": sid, "state": "running", "port": 8000,
            "start": "python3 -m http.server 8000", "start_state": "started", "start_pid": 7,
            "start_error": None, "metadata": {"a": "b"}, "created_at": 1.0,
            "url": f"http://{name}.sessions.localhost:8080",
            "proxy_path": f"/v1/sessions/{name}/proxy/", "preview_token": "pv_x", **extra}


def preview_json(token: str = "pv_x", ports: list[int] | None = None):
    return {"preview_token": token, "public_ports": ports or [],
            "preview_url_template": "http://{port}-sb1.localhost:8080"}


@pytest.fixture
def srv():
    with FakeServer() as server:
        server.on("GET", "/v1/info", reply(INFO))
        server.on("GET", SB, reply(sandbox_json(**preview_json())))
        server.on("PUT", S, reply(session_json(), 201))
        server.on("GET", S, reply(session_json()))
        server.on("GET", "/v1/sessions", reply({"sessions": [session_json(),
                                                             session_json("api", None)]}))
        server.on("DELETE", S, empty())
        server.on("GET", SB + "/preview", reply(preview_json()))
        yield server


@pytest.fixture
def box(srv):
    with AgentBox(api_key=KEY, base_url=srv.url) as client:
        yield client


# -- sessions ---------------------------------------------------------------------------------

def test_put_sends_only_what_is_given_and_parses_the_session(box, srv):
    session = box.sessions.put("web", "python", port=8000, idle_timeout=0,
                               start="python3 -m http.server 8000", metadata={"a": "b"})
    assert srv.seen("PUT")[-1].json == {"template": "python", "port": 8000, "idle_timeout": 0,
                                        "start": "python3 -m http.server 8000",
                                        "metadata": {"a": "b"}}
    assert isinstance(session, Session)
    assert (session.name, session.sandbox_id, session.state, session.port) == (
        "web", "sb1", "running", 8000)
    assert (session.start_state, session.start_pid, session.preview_token) == (
        "started", 7, "pv_x")
    assert session.url == "https://web.s.example.com"  # from session_url_template
    assert session.proxy_path == "/v1/sessions/web/proxy/"
    box.sessions.put("web")
    assert srv.seen("PUT")[-1].json == {}  # the server's defaults (port 8000)


def test_get_list_delete(box, srv):
    assert box.sessions.get("web").metadata == {"a": "b"}
    found = box.sessions.list()
    assert [s.name for s in found] == ["web", "api"] and found[1].sandbox_id is None
    assert box.sessions.delete("web") is True
    assert srv.seen("DELETE")[-1].path == S
    srv.on("DELETE", S, error(404, "session_not_found"))
    assert box.sessions.delete("web") is False
    srv.on("GET", S, error(404, "session_not_found"))
    with pytest.raises(exceptions.SessionNotFoundError):
        box.sessions.get("web")
    assert len(srv.seen("GET", "/v1/info")) == 1  # cached per client


def test_url_falls_back_to_the_servers_then_to_localhost(srv):
    srv.on("GET", "/v1/info", reply({"version": "1"}))
    with AgentBox(api_key=KEY, base_url=srv.url) as box:
        assert box.sessions.get("web").url == "http://web.sessions.localhost:8080"
    srv.on("GET", "/v1/info", error(404, "not_found", "Not Found"))
    srv.on("GET", S, reply(session_json(url=None)))
    with AgentBox(api_key=KEY, base_url=srv.url) as box:
        assert box.sessions.get("web").url == f"http://web.sessions.localhost:{srv.port}"


def test_session_errors_are_typed(box, srv):
    srv.on("PUT", S, error(409, "session_name_taken", "taken"))
    with pytest.raises(exceptions.ConflictError) as info:
        box.sessions.put("web")
    assert info.value.code == "session_name_taken"
    srv.on("PUT", "/v1/sessions/Bad", error(400, "bad_session_name"))
    with pytest.raises(exceptions.InvalidArgumentError):
        box.sessions.put("Bad")
    with pytest.raises(exceptions.InvalidArgumentError):
        box.sessions.get("")
    srv.on("GET", S, reply({"name": "web"}))
    with pytest.raises(exceptions.ProtocolError, match="sandbox_id"):
        box.sessions.get("web")


def test_session_sandbox_connects(box, srv):
    sandbox = box.sessions.get("web").sandbox()
    assert isinstance(sandbox, Sandbox) and sandbox.id == "sb1"
    assert sandbox.info.preview_token == "pv_x" and sandbox.info.public_ports == []
    with sandbox:
        pass
    assert srv.seen("DELETE") == []  # connected: leaving the block does not kill it
    with pytest.raises(exceptions.NotFoundError) as info:
        box.sessions.list()[1].sandbox()
    assert info.value.code == "session_not_ready"
    with pytest.raises(exceptions.ConfigurationError):
        Session.from_dict(session_json()).sandbox()


async def test_async_sessions(srv):
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        session = await box.sessions.put("web", start="true", port=3000)
        assert srv.seen("PUT")[-1].json == {"start": "true", "port": 3000}
        assert session.url == "https://web.s.example.com"
        sandbox = await session.sandbox()
        assert isinstance(sandbox, AsyncSandbox) and sandbox.id == "sb1"
        assert [s.name for s in await box.sessions.list()] == ["web", "api"]
        assert (await box.sessions.get("web")).start_pid == 7
        assert await box.sessions.delete("web") is True
        srv.on("DELETE", S, error(404, "session_not_found"))
        assert await box.sessions.delete("web") is False


# -- preview access ---------------------------------------------------------------------------

def test_preview_token_rotate_and_public_ports(box, srv):
    sandbox = box.connect("sb1")
    assert sandbox.preview_token == "pv_x"
    assert srv.seen("GET", SB + "/preview")
    srv.on("POST", SB + "/preview-token", reply(preview_json("pv_new")))
    assert sandbox.rotate_preview_token() == "pv_new"
    srv.on("PATCH", SB + "/preview", reply(preview_json(ports=[3000, 8000])))
    access = sandbox.set_public_ports([8000, 3000])
    assert srv.seen("PATCH")[-1].json == {"public_ports": [8000, 3000]}
    assert access.public_ports == [3000, 8000] and access.preview_token == "pv_x"
    with pytest.raises(exceptions.InvalidArgumentError):
        sandbox.set_public_ports("8000")  # type: ignore[arg-type]
    srv.on("PATCH", SB, reply(sandbox_json(public_ports=[8000])))
    assert sandbox.update(public_ports=[8000]).public_ports == [8000]
    assert srv.seen("PATCH", SB)[-1].json == {"public_ports": [8000]}


def test_get_url_with_token(box, srv):
    sandbox = box.connect("sb1")
    assert sandbox.get_url(8000) == "https://8000-sb1.pv.example.com"
    assert not srv.seen("GET", SB + "/preview")
    srv.on("GET", SB + "/preview", reply(preview_json("pv_a/b+c")))
    assert sandbox.get_url(8000, with_token=True) == (
        "https://8000-sb1.pv.example.com/?token=pv_a%2Fb%2Bc")


async def test_async_preview(srv):
    async with AsyncAgentBox(api_key=KEY, base_url=srv.url) as box:
        sandbox = await box.connect("sb1")
        assert await sandbox.preview_token == "pv_x"
        assert await sandbox.get_url(8000, with_token=True) == (
            "https://8000-sb1.pv.example.com/?token=pv_x")
        srv.on("POST", SB + "/preview-token", reply(preview_json("pv_new")))
        assert await sandbox.rotate_preview_token() == "pv_new"
        srv.on("PATCH", SB + "/preview", reply(preview_json(ports=[8000])))
        assert (await sandbox.set_public_ports([8000])).public_ports == [8000]
        assert (await sandbox.get_preview()).preview_token == "pv_x"


# -- CLI ---------------------------------------------------------------------------------------

@pytest.fixture
def cli_env(srv, monkeypatch):
    monkeypatch.setenv("AGENTBOX_API_KEY", KEY)
    monkeypatch.setenv("AGENTBOX_URL", srv.url)
    return srv


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_session_put_get_ls_rm(cli_env, capsys):
    srv = cli_env
    code, out, _ = run(capsys, "session", "put", "web", "python", "--port", "8000", "--start",
                       "python3 -m http.server 8000", "--idle-timeout", "0", "--metadata", "a=b")
    assert code == 0 and "url            https://web.s.example.com" in out
    assert srv.seen("PUT")[-1].json == {"template": "python", "port": 8000, "idle_timeout": 0.0,
                                        "start": "python3 -m http.server 8000",
                                        "metadata": {"a": "b"}}
    code, out, _ = run(capsys, "session", "get", "--json", "web")
    assert code == 0 and json.loads(out)["sandbox_id"] == "sb1"
    assert "_client" not in json.loads(out)
    code, out, _ = run(capsys, "session", "ls")
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "PORT", "START", "SANDBOX", "URL"]
    assert lines[1].split() == ["web", "running", "8000", "started", "sb1",
                                "https://web.s.example.com"]
    assert [s["name"] for s in json.loads(run(capsys, "session", "ls", "--json")[1])] == [
        "web", "api"]
    assert run(capsys, "session", "rm", "web")[:2] == (0, "removed web\n")
    srv.on("DELETE", S, error(404, "session_not_found"))
    code, out, err = run(capsys, "session", "rm", "--json", "web")
    assert code == 1 and json.loads(out) == {"removed": []} and "no session web" in err
    srv.on("PUT", S, error(409, "session_name_taken", "taken"))
    code, _, err = run(capsys, "session", "put", "--json", "web")
    assert code == 1 and json.loads(err)["error"]["code"] == "session_name_taken"


def test_cli_url_with_token(cli_env, capsys):
    assert run(capsys, "url", "sb1", "8000")[:2] == (0, "https://8000-sb1.pv.example.com\n")
    code, out, _ = run(capsys, "url", "sb1", "8000", "--token", "--json")
    assert json.loads(out) == {"url": "https://8000-sb1.pv.example.com/?token=pv_x"}
