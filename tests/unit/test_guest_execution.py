"""POST /exec against the real agent app (real processes on the host)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest

from guest.agent import create_app
from guest.execution import ExecOwner, Executor
from guest.protocol import MAX_OUTPUT_BYTES, ExecRequest, ExecResult

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def client(aiohttp_client, tmp_path):
    return await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))


async def run(client, **body) -> ExecResult:
    resp = await client.post("/exec", json=body)
    assert resp.status == 200, await resp.text()
    return ExecResult.from_dict(await resp.json())


def gone(pid: int) -> bool:
    """True if ``pid`` is dead (a zombie waiting for a non-reaping init counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def wait_gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        await asyncio.sleep(0.05)
    return gone(pid)


async def read_pid(path: Path, within: float = 5.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        await asyncio.sleep(0.02)
    raise AssertionError(f"no pid in {path}")


async def test_command_stdout(client):
    result = await run(client, command="echo hello")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "", 0)
    assert not result.timed_out and not result.truncated
    assert result.duration_ms > 0


async def test_python_code(client):
    result = await run(client, code="print(1+1)")
    assert result.stdout == "2\n"
    assert result.exit_code == 0


async def test_python_traceback_and_exit_code(client):
    result = await run(client, code="import sys\nprint('x', file=sys.stderr)\nsys.exit(4)")
    assert (result.stderr, result.exit_code) == ("x\n", 4)
    result = await run(client, code="1/0")
    assert result.exit_code == 1 and "ZeroDivisionError" in result.stderr


@pytest.mark.parametrize("language", ["bash", "sh"])
async def test_shell_code(client, language):
    result = await run(client, code="echo out; echo err >&2; exit 7", language=language)
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 7)


async def test_env_is_merged_over_defaults(client):
    result = await run(client, command='echo "$FOO|$LANG|$PATH"', env={"FOO": "bar"})
    foo, lang, path = result.stdout.strip().split("|")
    assert (foo, lang) == ("bar", "C.UTF-8")
    assert "/usr/bin" in path.split(":")


async def test_cwd(client, tmp_path):
    result = await run(client, command="pwd", cwd=str(tmp_path))
    assert result.stdout == f"{tmp_path}\n"


async def test_bad_cwd(client, tmp_path):
    for cwd in (str(tmp_path / "missing"), str(Path(__file__))):
        resp = await client.post("/exec", json={"command": "true", "cwd": cwd})
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_cwd"


async def test_invalid_utf8_is_replaced(client):
    result = await run(client, command=r"printf 'a\377b'")
    assert result.stdout == "a\ufffdb"


async def test_timeout_kills_the_whole_group(client, tmp_path):
    pidfile = tmp_path / "child.pid"
    cmd = f"sleep 100 & echo $! > {pidfile}; echo before; sleep 100"
    started = time.monotonic()
    result = await run(client, command=cmd, timeout=1)
    assert time.monotonic() - started < 5
    assert result.timed_out and result.exit_code == -9
    assert result.stdout == "before\n"  # output up to the kill is kept
    assert 1000 <= result.duration_ms < 5000
    assert await wait_gone(await read_pid(pidfile))


async def test_big_output_is_truncated_without_deadlock(client):
    # 20 MB on each stream at once: a reader that drained one pipe at a time would hang.
    cmd = "(yes | head -c 20000000) & (yes | head -c 20000000 >&2); wait"
    result = await run(client, command=cmd, timeout=30)
    assert result.exit_code == 0 and not result.timed_out
    assert result.truncated
    assert len(result.stdout) == len(result.stderr) == MAX_OUTPUT_BYTES
    assert result.stdout.startswith("y\ny\n")


async def test_output_at_the_cap_is_not_truncated(client):
    result = await run(client, command=f"head -c {MAX_OUTPUT_BYTES} /dev/zero | tr '\\0' x")
    assert len(result.stdout) == MAX_OUTPUT_BYTES and not result.truncated


async def test_concurrent_execs(client):
    started = time.monotonic()
    results = await asyncio.gather(
        *(run(client, command=f"sleep 0.5; echo {i}") for i in range(20))
    )
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]
    assert time.monotonic() - started < 5  # they ran side by side, not one after another


async def test_health_counts_running_commands(client):
    task = asyncio.create_task(run(client, command="sleep 1"))
    deadline = time.monotonic() + 5
    running = 0
    while time.monotonic() < deadline and not running:
        running = (await (await client.get("/health")).json())["running"]
        await asyncio.sleep(0.05)
    assert running == 1
    await task
    assert (await (await client.get("/health")).json())["running"] == 0


async def test_background_child_does_not_hold_the_exec(client):
    started = time.monotonic()
    result = await run(client, command="sleep 30 & echo $!")
    pid = int(result.stdout)
    try:
        assert time.monotonic() - started < 3
        assert not gone(pid)  # a deliberate background job keeps running
    finally:
        os.kill(pid, 9)


async def test_client_disconnect_kills_the_group(client, tmp_path):
    pidfile = tmp_path / "main.pid"
    timeout = aiohttp.ClientTimeout(total=1)
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            "/exec", json={"command": f"echo $$ > {pidfile}; sleep 100"}, timeout=timeout
        )
    pid = await read_pid(pidfile)
    assert await wait_gone(pid)


@pytest.mark.parametrize(
    "body",
    [
        {"command": "true", "code": "pass"},
        {},
        {"code": "x", "language": "cobol"},
        {"command": "true", "timeout": 0},
        {"command": "true", "cwd": "relative"},
        {"command": "true", "bogus": 1},
        {"command": "echo a\x00b"},
        {"command": "true", "env": {"A=B": "1"}},
        ["command"],
    ],
)
async def test_bad_requests(client, body):
    resp = await client.post("/exec", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "bad_request"


async def test_malformed_json(client):
    resp = await client.post("/exec", data=b"{not json")
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "bad_json"


async def test_owner_aclose_kills_running_groups(tmp_path):
    owner = ExecOwner()
    executor = Executor(owner)
    pidfile = tmp_path / "pid"
    req = ExecRequest(command=f"echo $$ > {pidfile}; sleep 100")
    task = asyncio.create_task(executor.run(req))
    pid = await read_pid(pidfile)
    await owner.aclose()
    result = await asyncio.wait_for(task, 5)
    assert result.exit_code == -9
    assert owner.running == 0
    assert await wait_gone(pid)


async def test_background_child_keeps_writing_after_the_exec_returns():
    # Its pipes are drained to nowhere: it neither blocks on a full pipe nor dies of SIGPIPE.
    owner = ExecOwner()
    cmd = "(sleep 1.5; head -c 1000000 /dev/zero; sleep 30) & echo $!"  # writes after the grace
    result = await Executor(owner).run(ExecRequest(command=cmd))
    pid = int(result.stdout)
    try:
        assert owner.lingering == 2  # its stdout and stderr
        await asyncio.sleep(2.5)
        assert not gone(pid)
    finally:
        os.killpg(os.getpgid(pid), 9)  # the whole leftover tree (the exec's group)
    deadline = time.monotonic() + 5
    while owner.lingering and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert owner.lingering == 0  # EOF once the last writer died
