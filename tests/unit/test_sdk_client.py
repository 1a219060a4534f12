"""The sync SDK against a scripted fake server: request shapes, parsing, lifecycle."""

from __future__ import annotations

import pytest

import agentbox
from agentbox import AgentBox, Sandbox, exceptions
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    reply,
    sandbox_json,
)

SB = r"/v1/sandboxes/sb1"


@pytest.fixture
def srv():
    with FakeServer() as server:
        server.on("POST", "/v1/sandboxes", reply(sandbox_json(), 201))
        server.on("GET", SB, reply(sandbox_json()))
        server.on("DELETE", SB, empty())
        yield server


@pytest.fixture
def box(srv):
    with AgentBox(api_key=KEY, base_url=srv.url) as client:
        yield client


def test_seed_example_request_shapes(srv):
    srv.on("POST", SB + "/execute", reply({"stdout": "1\n", "stderr": "", "exit_code": 0,
                                           "duration_ms": 3.5, "timed_out": False,
                                           "truncated": False}))
    box = AgentBox(api_key=KEY, base_url=srv.url)
    sandbox = box.create(environment="python")
    result = sandbox.execute("print(1)")
    assert result.stdout == "1\n" and result.exit_code == 0 and result.duration_ms == 3.5
    assert result.results == [] and result.error is None and result.files == []
    create, execute = srv.seen("POST")
    assert create.json == {"template": "python"}
    assert create.headers["Authorization"] == f"Bearer {KEY}"
    assert create.headers["User-Agent"].startswith("agentbox-python/")
    assert execute.path == SB + "/execute"
    assert execute.json == {"code": "print(1)", "language": "python"}
    box.close()


def test_execute_command_and_options(box, srv):
    srv.on("POST", SB + "/execute", reply({"stdout": "", "stderr": "no\n", "exit_code": 2,
                                           "duration_ms": 1, "timed_out": False,
                                           "truncated": False}))
    sandbox = box.create()
    res = sandbox.execute(command="ls", timeout=5, env={"A": "1"}, cwd="work")
    assert srv.seen("POST", SB + "/execute")[-1].json == {
        "command": "ls", "timeout": 5, "env": {"A": "1"}, "cwd": "/root/work"}
    assert not res.ok and res.error.name == "NonZeroExit" and res.error.value == "exit code 2"
    sandbox.execute("echo hi", language="bash")
    assert srv.seen("POST", SB + "/execute")[-1].json == {"code": "echo hi", "language": "bash"}
    with pytest.raises(exceptions.InvalidArgumentError):
        sandbox.execute("x", command="y")


def test_python_error_is_parsed_from_the_traceback(box, srv):
    tb = ('Traceback (most recent call last):\n  File "x", line 1\n'
          'ZeroDivisionError: division by zero\n')
    srv.on("POST", SB + "/execute", reply({"stdout": "", "stderr": tb, "exit_code": 1,
                                           "duration_ms": 1}))
    err = box.create().execute("1/0").error
    assert (err.name, err.value, err.traceback) == ("ZeroDivisionError", "division by zero", tb)


def test_timed_out_execution_reports_a_timeout_error(box, srv):
    srv.on("POST", SB + "/execute", reply({"stdout": "", "stderr": "", "exit_code": -9,
                                           "duration_ms": 1000, "timed_out": True}))
    res = box.create().execute(command="sleep 9", timeout=1)
    assert res.timed_out and res.error.name == "TimeoutError"
    # the HTTP exchange waits longer than the sandbox-side timeout
    assert srv.seen("POST", SB + "/execute")[-1].json["timeout"] == 1


@pytest.mark.parametrize(("status", "code", "cls"), [
    (400, "bad_request", exceptions.InvalidArgumentError),
    (401, "invalid_api_key", exceptions.AuthenticationError),
    (403, "forbidden", exceptions.PermissionDeniedError),
    (404, "sandbox_not_found", exceptions.SandboxNotFoundError),
    (404, "template_not_found", exceptions.TemplateNotFoundError),
    (409, "not_running", exceptions.ConflictError),
    (413, "payload_too_large", exceptions.PayloadTooLargeError),
    (429, "too_many_processes", exceptions.RateLimitError),
    (500, "internal", exceptions.ServerError),
    (502, "vm_gone", exceptions.SandboxError),
    (503, "sandbox_limit", exceptions.UnavailableError),
    (504, "vm_timeout", exceptions.TimeoutError),
    (507, "no_space", exceptions.StorageFullError),
])
def test_errors_map_to_typed_exceptions(box, srv, status, code, cls):
    srv.on("POST", "/v1/sandboxes", error(status, code, "nope", {"Retry-After": "7"}))
    with pytest.raises(cls) as info:
        box.create()
    exc = info.value
    assert (exc.status, exc.code, exc.message, exc.retry_after) == (status, code, "nope", 7.0)
    assert isinstance(exc, agentbox.AgentBoxError)


def test_timeout_error_is_also_the_builtin_one(box, srv):
    srv.on("POST", "/v1/sandboxes", error(504, "vm_timeout"))
    with pytest.raises(TimeoutError):
        box.create()


def test_missing_route_is_an_endpoint_not_found_error(box, srv):
    sandbox = box.create()
    with pytest.raises(exceptions.EndpointNotFoundError):
        sandbox.suspend()  # the fake has no such route: 404 "Not Found"


def test_non_json_error_body(box, srv):
    async def html(request):
        from aiohttp import web
        return web.Response(status=502, text="<html>bad gateway</html>")
    srv.on("GET", "/v1/sandboxes", html)
    with pytest.raises(exceptions.SandboxError, match="bad gateway"):
        box.list()


def test_unreachable_server_is_a_connection_error():
    with AgentBox(api_key=KEY, base_url="http://127.0.0.1:9") as box, \
            pytest.raises(exceptions.APIConnectionError):
        box.list()


def test_config_from_environment(monkeypatch, srv):
    monkeypatch.setenv("AGENTBOX_API_KEY", "env-key")
    monkeypatch.setenv("AGENTBOX_URL", srv.url + "/")
    with AgentBox() as box:
        assert box.config.base_url == srv.url
        box.create()
    assert srv.seen("POST")[-1].headers["Authorization"] == "Bearer env-key"
    with AgentBox(api_key=...) as box:  # the seed example's placeholder means "from env"
        assert box.config.api_key == "env-key"
    monkeypatch.delenv("AGENTBOX_API_KEY")
    with pytest.raises(exceptions.ConfigurationError):
        AgentBox()
    monkeypatch.delenv("AGENTBOX_URL")
    assert AgentBox(api_key="k").config.base_url == "http://127.0.0.1:8080"


def test_create_options_and_template_alias(box, srv):
    box.create("node", idle_timeout=30, metadata={"user": "u1"})
    assert srv.seen("POST")[-1].json == {"template": "node", "idle_timeout": 30,
                                         "metadata": {"user": "u1"}}
    box.create(template=None)
    assert srv.seen("POST")[-1].json == {}
    with pytest.raises(exceptions.InvalidArgumentError):
        box.create("node", environment="python")


def test_list_get_templates(box, srv):
    srv.on("GET", "/v1/sandboxes", reply({"sandboxes": [sandbox_json("a"), sandbox_json("b")]}))
    srv.on("GET", "/v1/templates", reply({"templates": [
        {"name": "python", "mem_mib": 512, "default": True}]}))
    assert [s.id for s in box.list()] == ["a", "b"]
    assert box.templates()[0] == agentbox.Template("python", 512, True)
    info = box.get("sb1")
    assert info.state == "running" and info.sandbox_id == "sb1"


def test_lifecycle_calls(box, srv):
    srv.on("POST", SB + "/suspend", reply(sandbox_json(state="suspended")))
    srv.on("POST", SB + "/resume", reply(sandbox_json()))
    srv.on("PATCH", SB, reply(sandbox_json(idle_timeout=30)))
    sandbox = box.create()
    assert sandbox.suspend().state == "suspended" and sandbox.state == "suspended"
    assert sandbox.resume().state == "running"
    assert sandbox.set_idle_timeout(30).idle_timeout == 30
    sandbox.update(metadata={"a": 1})
    assert [r.json for r in srv.seen("PATCH")] == [{"idle_timeout": 30}, {"metadata": {"a": 1}}]
    with pytest.raises(exceptions.InvalidArgumentError):
        sandbox.update()
    assert sandbox.is_running()
    assert sandbox.kill() is True
    srv.on("DELETE", SB, error(404, "sandbox_not_found"))
    assert sandbox.kill() is False


def test_context_manager_kills_unless_kept_or_connected(box, srv):
    with box.create():
        pass
    assert len(srv.seen("DELETE")) == 1
    with box.create(keep=True):
        pass
    with box.connect("sb1"):
        pass
    assert len(srv.seen("DELETE")) == 1


def test_classmethods_own_their_client(srv, monkeypatch):
    monkeypatch.setenv("AGENTBOX_API_KEY", KEY)
    monkeypatch.setenv("AGENTBOX_URL", srv.url)
    with Sandbox.create("python", metadata={"k": "v"}) as sandbox:
        assert sandbox.id == "sb1"
    assert srv.seen("DELETE", SB)
    with Sandbox.connect("sb1") as sandbox:
        assert sandbox.info.template == "python"
    assert len(srv.seen("DELETE", SB)) == 1
    srv.on("GET", "/v1/sandboxes", reply({"sandboxes": []}))
    assert Sandbox.list() == []


def test_kill_error_does_not_mask_the_body_exception(box, srv):
    srv.on("DELETE", SB, error(502, "vm_gone"))
    with pytest.raises(KeyError), box.create():
        raise KeyError("mine")
    with pytest.raises(exceptions.SandboxError), box.create():
        pass


def test_urls_from_server_info_or_fallback(box, srv):
    sandbox = box.create()
    assert sandbox.get_url(3000) == f"http://3000-sb1.localhost:{srv.port}"
    assert sandbox.get_host(3000) == f"3000-sb1.localhost:{srv.port}"
    assert sandbox.terminal_url() == f"ws://127.0.0.1:{srv.port}/v1/sandboxes/sb1/terminal"
    with AgentBox(api_key=KEY, base_url=srv.url) as other:
        srv.on("GET", "/v1/info", reply({"version": "1", "preview_url_template":
                                         "https://{port}-{id}.sb.example.com"}))
        sandbox = other.connect("sb1")
        assert sandbox.get_url(8080) == "https://8080-sb1.sb.example.com"
        assert sandbox.get_host(8080) == "8080-sb1.sb.example.com"
        sandbox.get_url(1)
    assert len(srv.seen("GET", "/v1/info")) == 2  # cached per client
    with pytest.raises(exceptions.InvalidArgumentError):
        sandbox.get_url(0)


def test_sandbox_ids_are_escaped(box, srv):
    srv.on("GET", r"/v1/sandboxes/.*", error(404, "sandbox_not_found"))
    with pytest.raises(exceptions.SandboxNotFoundError):
        box.get("../keys")
    assert srv.requests[-1].raw_path == "/v1/sandboxes/..%2Fkeys"
