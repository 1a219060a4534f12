"""The SDK, the client CLI and the MCP server against the real daemon (real microVMs).

Features whose endpoint a server may not have yet are probed, and skipped with the
missing endpoint named -- never passed silently.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from urllib.parse import urlsplit

import httpx
import pytest

from agentbox import AgentBox, AsyncAgentBox, AsyncSandbox, exceptions

pytestmark = pytest.mark.e2e

PNG_1PX = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJ"
           "RU5ErkJggg==")
SEED = textwrap.dedent("""\
    from agentbox import AgentBox
    box = AgentBox(api_key=...)
    sandbox = box.create(environment="python")
    result = sandbox.execute("print(1)")
    print(result.stdout)
""")


@pytest.fixture(scope="module")
def env(daemon):
    return {**os.environ, "AGENTBOX_URL": daemon.url, "AGENTBOX_API_KEY": daemon.admin_key}


@pytest.fixture(scope="module")
def box(daemon):
    with AgentBox(api_key=daemon.admin_key, base_url=daemon.url) as client:
        yield client


@pytest.fixture(scope="module")
def shared(box):
    """One sandbox for the tests that do not change its lifecycle state."""
    with box.create("python") as sandbox:
        yield sandbox


def skip_without(exc: exceptions.EndpointNotFoundError, endpoint: str) -> None:
    pytest.skip(f"the server has no {endpoint} ({exc})")


def new_ids(box: AgentBox, before: set[str]) -> set[str]:
    return {s.id for s in box.list()} - before


# -- the seed example and the sync SDK ---------------------------------------------------------

def test_seed_example_runs_unchanged(box, env, tmp_path):
    before = {s.id for s in box.list()}
    script = tmp_path / "seed.py"
    script.write_text(SEED)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=180)
    try:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "1\n\n"
    finally:
        for sid in new_ids(box, before):
            box.kill(sid)


def test_seed_example_runs_from_a_fresh_sdk_only_venv(box, env, tmp_path):
    """`pip install sdk/python` alone (no server packages: tests/unit/test_sdk_package.py)
    into a new venv, then the seed example, unchanged, against the real daemon."""
    import shutil
    import venv

    from tests.unit.test_sdk_package import SDK

    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    src = shutil.copytree(SDK, tmp_path / "src", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    clean = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([py, "-m", "pip", "install", "-q", str(src)], check=True, env=clean,
                   cwd=tmp_path, timeout=300, capture_output=True)
    (tmp_path / "seed.py").write_text(SEED)
    before = {s.id for s in box.list()}
    proc = subprocess.run([py, "seed.py"], env=clean, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    try:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "1\n\n"
        probe = subprocess.run([py, "-c", "import gateway"], env=clean, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0  # the server is not importable there
    finally:
        for sid in new_ids(box, before):
            box.kill(sid)


def test_sync_execute_files_and_errors(box, shared):
    res = shared.execute("import sys; print('out'); print('err', file=sys.stderr)")
    assert (res.stdout, res.stderr, res.exit_code, res.error) == ("out\n", "err\n", 0, None)
    res = shared.execute(command="echo $GREETING from $(pwd)", env={"GREETING": "hi"},
                         cwd="/tmp")
    assert res.stdout == "hi from /tmp\n"
    err = shared.execute("1/0").error
    assert (err.name, err.value) == ("ZeroDivisionError", "division by zero")

    payload = os.urandom(1024 * 1024)
    assert shared.upload("/tmp/sdk/blob.bin", payload).size == len(payload)
    assert shared.download("/tmp/sdk/blob.bin") == payload
    shared.files.write("notes.txt", "héllo")  # relative: under /root
    assert shared.files.read("/root/notes.txt") == "héllo"
    assert [e.name for e in shared.files.list("/tmp/sdk")] == ["blob.bin"]
    assert shared.files.exists("/tmp/sdk/blob.bin") and not shared.files.exists("/tmp/nope")
    shared.files.remove("/tmp/sdk")
    assert not shared.files.exists("/tmp/sdk/blob.bin")
    with pytest.raises(exceptions.NotFoundError):
        shared.files.read("/tmp/sdk/blob.bin")
    with pytest.raises(exceptions.InvalidArgumentError):
        shared.files.list("/root/notes.txt")


def test_errors_are_typed(box, daemon, shared):
    with pytest.raises(exceptions.SandboxNotFoundError):
        box.connect("0000000000000000")
    with pytest.raises(exceptions.TemplateNotFoundError):
        box.create("no-such-template")
    with pytest.raises(exceptions.PayloadTooLargeError):  # the e2e daemon's limit is 16 MiB
        shared.files.write("/tmp/too-big", b"\0" * (17 * 1024 * 1024))
    with pytest.raises(exceptions.InvalidArgumentError):
        shared.execute("x", language="cobol")
    with AgentBox(api_key="not-a-key", base_url=daemon.url) as bad, \
            pytest.raises(exceptions.AuthenticationError):
        bad.list()


def test_context_manager_deletes_the_sandbox(box):
    with box.create() as sandbox:
        sid = sandbox.id
        assert sandbox.is_running()
    with pytest.raises(exceptions.SandboxNotFoundError):
        box.get(sid)


def test_async_sdk_round_trip(daemon):
    async def scenario() -> None:
        async with AsyncAgentBox(api_key=daemon.admin_key, base_url=daemon.url) as abox:
            async with await abox.create(environment="python") as sandbox:
                assert isinstance(sandbox, AsyncSandbox)
                assert (await sandbox.execute("print(6*7)")).stdout == "42\n"
                await sandbox.files.write("/tmp/a.txt", "async")
                assert await sandbox.files.read("/tmp/a.txt") == "async"
                with pytest.raises(exceptions.NotFoundError):
                    await sandbox.files.read("/tmp/missing")
                sid = sandbox.id
            with pytest.raises(exceptions.SandboxNotFoundError):
                await AsyncSandbox.connect(sid, api_key=daemon.admin_key, base_url=daemon.url)
    asyncio.run(scenario())


# -- interpreter, commands, lifecycle (skipped where the server lacks the endpoint) ------------

def test_run_code_keeps_state_and_streams(shared):
    try:
        shared.run_code("counter = 41")
    except exceptions.EndpointNotFoundError as exc:
        skip_without(exc, "POST /v1/sandboxes/{id}/run_code")
    ex = shared.run_code("counter += 1\ncounter")
    assert ex.text == "42" and ex.error is None
    chunks: list[str] = []
    ex = shared.run_code("for i in range(3):\n    print(i)\n'done'", on_stdout=chunks.append)
    assert "".join(chunks) == "0\n1\n2\n" and ex.text == "'done'"
    ex = shared.run_code("raise ValueError('bad')")
    assert ex.error.name == "ValueError" and "bad" in ex.error.traceback
    image = shared.run_code(textwrap.dedent(f"""\
        import base64
        class Img:
            def _repr_png_(self):
                return base64.b64decode({PNG_1PX!r})
        Img()"""))
    assert image.results[0].image_bytes().startswith(b"\x89PNG")


def test_matplotlib_chart_comes_back_as_png(box):
    # matplotlib lives in the python-datascience template (its golden snapshot has it imported).
    with box.create("python-datascience") as sandbox:
        ex = sandbox.run_code("import matplotlib.pyplot as plt\n"
                              "plt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
        pngs = [r.image_bytes() for r in ex.results if r.png]
        assert pngs and pngs[0].startswith(b"\x89PNG"), ex
        import struct
        width, height = struct.unpack(">II", pngs[0][16:24])  # IHDR: a real, non-empty image
        assert width > 100 and height > 100
        df = sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        main = [r for r in df.results if r.is_main_result][0]
        assert "<table" in (main.html or "") and "a" in (main.text or ""), df


def test_background_command_reattach_from_another_client(daemon, shared):
    try:
        handle = shared.commands.run("for i in 1 2 3 4 5; do echo line $i; sleep 0.3; done",
                                     background=True)
    except exceptions.EndpointNotFoundError as exc:
        skip_without(exc, "POST /v1/sandboxes/{id}/commands")
    first = next(iter(handle))
    assert first.data.startswith("line 1")
    with AgentBox(api_key=daemon.admin_key, base_url=daemon.url) as other:
        again = other.connect(shared.id).commands.connect(handle.pid, offset=first.next_offset)
        result = again.wait(timeout=60)
    assert result.exit_code == 0
    assert first.data + result.stdout == "".join(f"line {i}\n" for i in range(1, 6))
    assert handle.pid in [p.pid for p in shared.commands.list()]

    cat = shared.commands.run("cat", background=True, stdin=True)
    cat.send_stdin("via stdin\n", eof=True)
    assert cat.wait(timeout=30).stdout == "via stdin\n"
    sleeper = shared.commands.run("sleep 300", background=True)
    assert sleeper.kill() and sleeper.wait(timeout=30).exit_code == -9
    fg = shared.commands.run("echo fg; exit 3")
    assert (fg.stdout, fg.exit_code) == ("fg\n", 3)


def test_suspend_resume_keeps_files_and_state(box):
    with box.create() as sandbox:
        sandbox.files.write("/root/keep.txt", "kept")
        try:
            assert sandbox.suspend().state == "suspended"
        except exceptions.EndpointNotFoundError as exc:
            skip_without(exc, "POST /v1/sandboxes/{id}/suspend")
        assert sandbox.get_info().state == "suspended"
        assert sandbox.resume().state == "running"
        assert sandbox.files.read("/root/keep.txt") == "kept"
        sandbox.suspend()
        # any request wakes it (wake on request)
        assert sandbox.execute(command="cat /root/keep.txt").stdout == "kept"
        assert sandbox.set_idle_timeout(120).idle_timeout == 120


def test_preview_url(box, shared):
    url = shared.get_url(8000)
    assert f"8000-{shared.id}" in url and shared.get_host(8000) in url
    if box.server_info().preview_url_template is None:
        pytest.skip("the server has no GET /v1/info (checked only the fallback URL)")


# -- the CLI and the MCP server as subprocesses ------------------------------------------------

def cli(env, *args: str, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "agentbox", *args], env=env,
                          capture_output=True, text=True, timeout=180, input=input)
    if check:
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def test_cli_create_exec_cp_ls_rm(env, tmp_path):
    sid = json.loads(cli(env, "create", "--json").stdout)["id"]
    try:
        res = json.loads(cli(env, "exec", "--json", sid, "echo hello; uname -s").stdout)
        assert res["stdout"] == "hello\nLinux\n" and res["exit_code"] == 0
        assert cli(env, "exec", sid, "exit 5", check=False).returncode == 5
        local = tmp_path / "up.bin"
        local.write_bytes(os.urandom(300_000))
        up = json.loads(cli(env, "cp", "--json", str(local), f"{sid}:/tmp/").stdout)
        assert up["path"] == "/tmp/up.bin" and up["bytes"] == 300_000
        cli(env, "cp", f"{sid}:/tmp/up.bin", str(tmp_path / "down.bin"))
        assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
        listed = json.loads(cli(env, "ls", "--json").stdout)
        assert sid in [s["id"] for s in listed]
    finally:
        assert json.loads(cli(env, "rm", "--json", sid).stdout) == {"removed": [sid]}
    assert sid not in [s["id"] for s in json.loads(cli(env, "ls", "--json").stdout)]
    assert cli(env, "rm", sid, check=False).returncode == 1


def test_cli_shell(env, shared, daemon):
    probe = httpx.get(f"{daemon.url}/v1/sandboxes/{shared.id}/terminal",
                      headers={"Authorization": f"Bearer {daemon.admin_key}"})
    if probe.status_code in (404, 405) and probe.json()["error"]["code"] in (
            "not_found", "method_not_allowed"):
        pytest.skip("the server has no GET /v1/sandboxes/{id}/terminal (WebSocket)")
    proc = cli(env, "shell", shared.id, check=False, input="echo from-shell\nexit 3\n")
    assert "from-shell" in proc.stdout and proc.returncode == 3, proc


def test_mcp_server_lists_tools_and_runs_code(env, box, tmp_path):
    mcp = pytest.importorskip("mcp", reason="the mcp package is not installed (extra 'mcp')")
    from mcp.client.stdio import stdio_client

    before = {s.id for s in box.list()}
    params = mcp.StdioServerParameters(command=sys.executable,
                                       args=["-m", "agentbox", "mcp"], env=env)

    async def session() -> tuple[list[str], str]:
        with open(tmp_path / "mcp-server.log", "w") as errlog:
            return await _talk(errlog)

    async def _talk(errlog) -> tuple[list[str], str]:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                mcp.ClientSession(read, write) as s:
            await s.initialize()
            names = [t.name for t in (await s.list_tools()).tools]
            await s.call_tool("run_code", {"code": "x = 20"})
            result = await s.call_tool("run_code", {"code": "print(x + 22)"})
            return names, result.content[0].text

    names, text = asyncio.run(session())
    assert names == ["run_code", "run_command", "read_file", "write_file", "list_files"]
    assert "42" in text
    deadline = time.monotonic() + 30
    while new_ids(box, before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not new_ids(box, before), "the MCP session's sandbox outlived the session"


# -- sessions and preview access ----------------------------------------------------------------

def _via_gateway(daemon, url: str, **headers: str) -> httpx.Response:
    """GET ``url`` (a preview or session URL) from the daemon on 127.0.0.1 with its Host
    header (``*.localhost`` names need not resolve here), waiting for the app to listen."""
    parts = urlsplit(url)
    target = f"{daemon.url}{parts.path or '/'}" + (f"?{parts.query}" if parts.query else "")
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(target, headers={"Host": parts.netloc, **headers}, timeout=60)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.3)


def test_session_put_get_fetch_and_delete(box, daemon):
    name = "sdk-" + secrets.token_hex(3)
    start = "python3 -m http.server 8000"
    try:
        session = box.sessions.put(name, "python", port=8000, start=start,
                                   metadata={"by": "test_sdk"})
        assert (session.name, session.port, session.start) == (name, 8000, start)
        assert session.start_state == "started" and session.start_pid
        assert session.state == "running" and session.preview_token.startswith("pv_")
        again = box.sessions.get(name)
        assert again.sandbox_id == session.sandbox_id and again.metadata == {"by": "test_sdk"}
        assert box.sessions.put(name).sandbox_id == session.sandbox_id  # idempotent
        assert name in [s.name for s in box.sessions.list()]
        assert urlsplit(session.url).hostname == f"{name}.sessions.localhost"

        # The session's host: private (401) without the token, the app with it.
        assert _via_gateway(daemon, session.url).status_code == 401
        r = _via_gateway(daemon, session.url, **{"X-AgentBox-Token": session.preview_token})
        assert r.status_code == 200 and "Directory listing" in r.text, (r.status_code, r.text)

        # Its sandbox's own preview URL, token in the query: a redirect that sets the cookie.
        sandbox = session.sandbox()
        assert sandbox.id == session.sandbox_id and sandbox.preview_token == session.preview_token
        r = _via_gateway(daemon, sandbox.get_url(8000, with_token=True))
        # per-host cookie names since 064afef: agentbox_preview_<hash of the host>=...
        assert r.status_code == 302 and "agentbox_preview_" in r.headers["set-cookie"]
        sandbox.set_public_ports([8000])
        assert _via_gateway(daemon, sandbox.get_url(8000)).status_code == 200
    finally:
        assert box.sessions.delete(name) is True
    with pytest.raises(exceptions.SessionNotFoundError):
        box.sessions.get(name)
    assert box.sessions.delete(name) is False
