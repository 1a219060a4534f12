"""Python /exec through the warm zygote: fresh-process semantics, fallbacks, failures."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from guest.agent import create_app, zygote_preload
from guest.execution import ExecOwner, Executor
from guest.protocol import ExecRequest, ExecResult
from guest.zygote import ZygoteManager, startup_env
from tests.unit.test_guest_execution import read_pid, wait_gone

pytestmark = pytest.mark.timeout(60)
VENV_BIN = os.path.dirname(sys.executable)  # a python3 that has numpy (test deps)


@pytest.fixture
async def client(aiohttp_client, tmp_path):
    return await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))


@pytest.fixture
async def plain(aiohttp_client, tmp_path):
    app = create_app(keepawake_dir=str(tmp_path / "keepawake2"), zygote_preload=None)
    return await aiohttp_client(app)


async def run(client, **body) -> ExecResult:
    resp = await client.post("/exec", json=body)
    assert resp.status == 200, await resp.text()
    return ExecResult.from_dict(await resp.json())


PARENT = "import os\nprint(open(f'/proc/{os.getppid()}/cmdline').read().replace(chr(0), ' '))"


async def parent_of(client, **body) -> str:
    return (await run(client, code=PARENT, **body)).stdout


async def test_python_code_runs_in_a_zygote_child(client):
    assert "zygote_worker.py" in await parent_of(client)
    code = "import os; print(os.getpid() == os.getpgid(0) == os.getsid(0))"
    result = await run(client, code=code)
    assert result.stdout == "True\n"  # its own session: killpg on timeout reaches its tree


async def test_no_zygote_runs_plain_python3(plain):
    assert "zygote_worker.py" not in await parent_of(plain)


NORMALISE = re.compile(r"/tmp/agentbox-exec-\w+\.py")

# Each program's stdout, stderr and exit code must be what `python3 -u FILE` gives.
PARITY = [
    "print(1)",
    "import sys\nprint('x', file=sys.stderr)\nsys.exit(4)",
    "1/0",
    "def f():\n    raise ValueError('v')\nf()",
    "exit('bye')",
    "raise SystemExit(None)",
    "import sys; sys.exit(300)",
    "1 +",
    "raise KeyboardInterrupt",
    "import os; print('a', flush=True); os._exit(5)",
    "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "import sys; print(__name__, sys.argv[0] == __file__, sys.path[0], sys.stdin.read())",
    "import sys; print(sys.flags.unbuffered, sys.stdout.encoding, sys.stdout.line_buffering)",
    "import threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()\nprint('main')",
    "import atexit; atexit.register(print, 'at exit'); print('body')",
    "print('no newline', end='')",
    "import warnings; warnings.warn('careful')",
    "import sys; print(sorted(k for k in globals() if not k.startswith('__')) or 'clean')",
    "print(__builtins__.__name__, __spec__, __package__, __doc__)",
    "# -*- coding: latin-1 -*-\nprint('\xe9')",
]


def normalise(r: ExecResult) -> tuple[str, str, int]:
    return NORMALISE.sub("SCRIPT", r.stdout), NORMALISE.sub("SCRIPT", r.stderr), r.exit_code


SPARE_READY = 0.3  # idle this long and the zygote has forked its spare child


async def run_by(client, way: str, code: str) -> ExecResult:
    """Run ``code`` in the zygote's spare (``spare``) or in a child forked for the
    request (``fork``: two at once after the spare is ready, so one of them forks;
    both must give the same answer)."""
    await asyncio.sleep(SPARE_READY)
    if way == "spare":
        return await run(client, code=code)
    a, b = await asyncio.gather(run(client, code=code), run(client, code=code))
    assert normalise(a) == normalise(b)
    return a


@pytest.mark.parametrize("way", ["spare", "fork"])
@pytest.mark.parametrize("code", PARITY)
async def test_same_result_as_plain_python3(client, plain, code, way):
    a, b = await run_by(client, way, code), await run(plain, code=code)
    assert normalise(a) == normalise(b)
    assert "zygote" not in a.stderr


def zygote_children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_an_idle_zygote_keeps_one_spare_child_and_uses_it(client):
    code = "import os; print(os.getpid(), os.getppid())"
    first, zygote = map(int, (await run(client, code=code)).stdout.split())
    await asyncio.sleep(SPARE_READY)
    spare = zygote_children(zygote)
    assert len(spare) == 1 and spare[0] != first
    pid, parent = map(int, (await run(client, code=code)).stdout.split())
    assert (pid, parent) == (spare[0], zygote)  # the spare ran it
    await asyncio.sleep(SPARE_READY)
    assert len(zygote_children(zygote)) == 1  # a new spare, the used one is gone


async def test_a_spare_killed_while_it_waits_is_replaced(client):
    code = "import os; print(os.getppid())"
    zygote = int((await run(client, code=code)).stdout)
    await asyncio.sleep(SPARE_READY)
    [spare] = zygote_children(zygote)
    os.kill(spare, signal.SIGKILL)
    await asyncio.sleep(SPARE_READY)
    [new] = zygote_children(zygote)
    assert new != spare
    assert (await run(client, code="print(2)")).stdout == "2\n"


LEAK_SETUP = """
import json, os, sys, random
x_global = 1
json.leaked = True
os.environ["LEAKED"] = "1"
os.chdir("/")
sys.path.append("/leaked")
sys.modules["leaked_module"] = json
open("/dev/null")
leak_fd = os.open("/dev/null", os.O_RDONLY)
os.dup2(leak_fd, 42)
random.seed(1234)
import signal; signal.signal(signal.SIGUSR1, signal.SIG_IGN)
os.umask(0o077)
"""

LEAK_CHECK = """
import json, os, sys, signal
print("x_global" in globals(), hasattr(json, "leaked"), "LEAKED" in os.environ,
      os.getcwd(), "/leaked" in sys.path, "leaked_module" in sys.modules,
      sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
      signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, oct(os.umask(0o022)))
"""


@pytest.mark.parametrize("idle", [(0, 0), (SPARE_READY, 0), (0, SPARE_READY)])
async def test_nothing_leaks_between_calls(client, tmp_path, idle):
    await asyncio.sleep(idle[0])
    first = await run(client, code=LEAK_SETUP, cwd=str(tmp_path))
    assert first.exit_code == 0, first.stderr
    await asyncio.sleep(idle[1])
    second = await run(client, code=LEAK_CHECK, cwd=str(tmp_path))
    fds = "[0, 1, 2, 3]"  # stdio, and the listing's own directory fd
    assert second.stdout == f"False False False {tmp_path} False False {fds} True 0o22\n"


async def test_random_state_differs_between_children(client):
    code = "import random; print(random.getrandbits(64))"
    values = {(await run(client, code=code)).stdout for _ in range(4)}
    assert len(values) == 4


async def test_env_and_cwd_per_call(client, tmp_path):
    code = "import os; print(os.environ.get('FOO'), os.getcwd(), os.environ['HOME'])"
    one = await run(client, code=code, env={"FOO": "bar"}, cwd=str(tmp_path))
    two = await run(client, code=code)
    assert one.stdout == f"bar {tmp_path} /root\n"
    assert two.stdout.startswith("None ")


async def test_timeout_kills_the_childs_group(client, tmp_path):
    pidfile = tmp_path / "sleep.pid"
    code = ("import subprocess, time\n"
            f"p = subprocess.Popen(['sleep', '100']); open('{pidfile}', 'w').write(str(p.pid))\n"
            "print('before', flush=True); time.sleep(100)")
    started = time.monotonic()
    result = await run(client, code=code, timeout=1)
    assert time.monotonic() - started < 5
    assert result.timed_out and result.exit_code == -9 and result.stdout == "before\n"
    assert await wait_gone(await read_pid(pidfile))
    assert (await run(client, code="print(2)")).stdout == "2\n"  # the zygote is fine


async def test_output_streams_and_big_output(client):
    code = "import sys\nsys.stdout.write('o' * 3_000_000)\nsys.stderr.write('e' * 100)"
    result = await run(client, code=code, timeout=30)
    assert len(result.stdout) == 3_000_000 and result.stderr == "e" * 100


@pytest.mark.parametrize("env", [{"PYTHONPATH": "/x"}, {"LANG": "C"}, {"HOME": "/tmp"},
                                 {"PYTHONHASHSEED": "0"}])
async def test_startup_env_falls_back_to_plain_python3(client, env):
    assert "zygote_worker.py" not in await parent_of(client, env=env)
    assert "zygote_worker.py" in await parent_of(client, env={"OTHER": "1"})


async def test_another_python3_on_path_falls_back(client, tmp_path):
    (tmp_path / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    assert "zygote_worker.py" not in await parent_of(client, env=env)


def executor_with(preload: tuple[str, ...] = (), **env: str) -> Executor:
    executor = Executor(ExecOwner())
    executor.env.update(env)
    executor.zygote = ZygoteManager(executor.env, preload)
    return executor


async def test_numpy_random_state_differs_between_children():
    executor = executor_with(("numpy",), PATH=f"{VENV_BIN}:/usr/bin:/bin")
    try:
        code = "import numpy, sys; print(numpy.random.randint(1 << 62), 'numpy' in sys.modules)"
        results = [await executor.run(ExecRequest(code=code)) for _ in range(3)]
        assert all(r.exit_code == 0 for r in results), results[0].stderr
        assert len({r.stdout for r in results}) == 3
        assert executor.zygote.current is not None  # they ran in the zygote
    finally:
        await executor.zygote.aclose()


async def test_a_killed_zygote_is_replaced():
    executor = executor_with()
    try:
        code = "import os; print(os.getppid())"
        first = int((await executor.run(ExecRequest(code=code))).stdout)
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.2)
        second = int((await executor.run(ExecRequest(code=code))).stdout)
        assert second != first and executor.zygote.current.proc.pid == second
    finally:
        await executor.zygote.aclose()


async def test_zygote_dying_mid_run_fails_the_exec_and_kills_the_child(tmp_path):
    executor = executor_with()
    pidfile = tmp_path / "pid"
    code = f"import os, time; open('{pidfile}', 'w').write(str(os.getpid())); time.sleep(100)"
    try:
        task = asyncio.create_task(executor.run(ExecRequest(code=code)))
        pid = await read_pid(pidfile)
        os.kill(executor.zygote.current.proc.pid, signal.SIGKILL)
        with pytest.raises(Exception, match="zygote died"):
            await asyncio.wait_for(task, 10)
        assert await wait_gone(pid)
    finally:
        await executor.zygote.aclose()


async def test_new_package_makes_the_zygote_stale(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    executor = executor_with(PYTHONPATH=str(site))
    try:
        code = "import os; print(os.getppid())"
        first = (await executor.run(ExecRequest(code=code))).stdout
        await asyncio.sleep(0.01)
        (site / "newpkg.py").write_text("VALUE = 7\n")
        result = await executor.run(ExecRequest(code="import newpkg; print(newpkg.VALUE)"))
        assert result.stdout == "7\n", result.stderr  # plain python3 ran it
        third = (await executor.run(ExecRequest(code=code))).stdout
        assert third != first  # a new zygote
    finally:
        await executor.zygote.aclose()


async def test_base_env_change_by_init_restarts_the_zygote():
    executor = executor_with()
    try:
        code = "import os; print(os.getppid(), os.environ.get('PYTHONDONTWRITEBYTECODE'))"
        first = (await executor.run(ExecRequest(code=code))).stdout.split()
        executor.env["PYTHONDONTWRITEBYTECODE"] = "1"  # what /init's env merge does
        second = (await executor.run(ExecRequest(code=code))).stdout.split()
        assert second[1] == "1" and second[0] != first[0]
        assert executor.zygote.current.startup == startup_env(executor.env)
    finally:
        await executor.zygote.aclose()


async def test_concurrent_python_execs(client):
    started = time.monotonic()
    results = await asyncio.gather(
        *(run(client, code=f"import time; time.sleep(0.5); print({i})") for i in range(10)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]
    assert time.monotonic() - started < 5


async def test_aclose_stops_the_zygote():
    executor = executor_with()
    await executor.run(ExecRequest(code="pass"))
    pid = executor.zygote.current.proc.pid
    await executor.zygote.aclose()
    assert await wait_gone(pid)


def test_preload_setting(tmp_path: Path):
    f = tmp_path / "preload"
    f.write_text("numpy\npandas\n")
    assert zygote_preload(None, str(f)) == ("numpy", "pandas")
    assert zygote_preload(None, str(tmp_path / "missing")) == ()
    assert zygote_preload("json, re", str(f)) == ("json", "re")
    assert zygote_preload("off", str(f)) is None


async def test_client_disconnect_kills_the_child(client, tmp_path):
    import aiohttp

    pidfile = tmp_path / "main.pid"
    code = f"import os, time; open('{pidfile}', 'w').write(str(os.getpid())); time.sleep(100)"
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/exec", json={"code": code}, timeout=aiohttp.ClientTimeout(total=1))
    assert await wait_gone(await read_pid(pidfile))
    health = await (await client.get("/health")).json()
    assert health["running"] == 0


def test_add_entropy_reseeds_the_crng():
    # Clones of one snapshot share the CRNG: mixing bytes in is not enough until a reseed.
    from guest import restore

    calls = []
    restore.add_entropy(b"x" * 16, ioctl=lambda fd, op, *arg: calls.append(op))
    assert calls == [restore.RNDADDENTROPY, restore.RNDRESEEDCRNG]


async def _stopped_zygote_run(tmp_path, body: str) -> tuple[ExecResult, float]:
    """Run ``body`` after the child has started, with its zygote stopped (SIGSTOP): the
    zygote cannot reap the child or report it, so only the child's own report can end
    the exec. Returns the result and how long the exec took."""
    executor = executor_with()
    pidfile = tmp_path / "pid"
    code = (f"import os, sys, time; open('{pidfile}', 'w').write(str(os.getpid()))\n"
            f"time.sleep(0.5)\n{body}")
    try:
        await executor.run(ExecRequest(code="pass"))  # the zygote is up
        zygote = executor.zygote.current.proc.pid
        started = time.monotonic()
        task = asyncio.create_task(executor.run(ExecRequest(code=code, timeout=20)))
        await read_pid(pidfile)
        os.kill(zygote, signal.SIGSTOP)
        try:
            done, _ = await asyncio.wait({task}, timeout=5)
        finally:
            os.kill(zygote, signal.SIGCONT)
        result = await task
        return result, (time.monotonic() - started) if done else float("inf")
    finally:
        await executor.zygote.aclose()


async def test_a_finished_child_reports_its_own_status_before_its_zygote_reaps_it(tmp_path):
    result, took = await _stopped_zygote_run(tmp_path, "print('out'); sys.exit(3)")
    assert took < 5, "the exec waited for the stopped zygote"
    assert (result.stdout, result.exit_code, result.timed_out) == ("out\n", 3, False)


async def test_a_child_killed_by_a_signal_is_known_from_its_zygote(tmp_path):
    # No report (it never returns from its script): only the zygote, once continued, knows.
    result, took = await _stopped_zygote_run(tmp_path, "os.kill(os.getpid(), 9)")
    assert took == float("inf")
    assert result.exit_code == -9


async def test_a_forked_grandchild_does_not_speak_for_the_child(tmp_path):
    # The user's fork returns through the script too; only the child's status counts.
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n    sys.exit(7)\n"
            "time.sleep(0.3)\nsys.exit(5)")
    executor = executor_with()
    try:
        for _ in range(3):
            assert (await executor.run(ExecRequest(code=code))).exit_code == 5
    finally:
        await executor.zygote.aclose()


async def test_a_preload_that_sets_a_variable_does_not_leak_it_into_children(tmp_path):
    # Children whose request env equals the zygote's skip the walk through os.environ;
    # the zygote's env is taken after its imports, so one that set a variable is seen.
    site = tmp_path / "site"
    site.mkdir()
    (site / "setsvar.py").write_text("import os\nos.environ['AGENTBOX_SET_BY_PRELOAD'] = '1'\n")
    executor = executor_with(("setsvar",), PYTHONPATH=str(site))
    try:
        code = ("import os, sys\nprint('setsvar' in sys.modules, "
                "os.environ.get('AGENTBOX_SET_BY_PRELOAD'), os.environ.get('KEEP'))")
        for env in ({}, {"KEEP": "k"}, {}):
            result = await executor.run(ExecRequest(code=code, env=env))
            assert result.stdout == f"True None {env.get('KEEP')}\n", result.stderr
    finally:
        await executor.zygote.aclose()


async def test_the_script_file_is_private_and_removed(client):
    code = ("import os, stat, sys\nst = os.lstat(__file__)\n"
            "print(stat.S_IMODE(st.st_mode) == 0o600, stat.S_ISREG(st.st_mode), __file__)")
    seen = set()
    for _ in range(3):
        ok, regular, path = (await run(client, code=code)).stdout.split()
        assert (ok, regular) == ("True", "True") and NORMALISE.fullmatch(path)
        assert not os.path.exists(path)
        seen.add(path)
    assert len(seen) == 3


async def test_random_state_differs_between_children_forked_for_their_request(client):
    # Four at once: at most one finds the spare, the others are forked for their request
    # and rely on random's own at-fork reseed (the child does not reseed it again).
    code = "import random; print(random.getrandbits(64))"
    results = await asyncio.gather(*(run(client, code=code) for _ in range(4)))
    assert all(r.exit_code == 0 for r in results)
    assert len({r.stdout for r in results}) == 4


async def test_modules_written_after_the_zygote_started_are_imported(client, tmp_path):
    # The children keep the zygote's import caches (not invalidated per call): a
    # directory's cached listing is only used while its mtime is unchanged.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    code = (f"import sys; sys.path.insert(0, {str(pkg)!r})\n"
            "try:\n    import later\nexcept ImportError:\n    print('missing')\n"
            "else:\n    print(later.VALUE)\n")
    assert (await run(client, code=code)).stdout == "missing\n"
    (pkg / "later.py").write_text("VALUE = 'found'\n")
    assert (await run(client, code=code)).stdout == "found\n"
    neighbour = ("import os, sys\nd = os.path.dirname(__file__)\n"
                 "open(os.path.join(d, 'agentbox_test_nb.py'), 'w').write('X = 1')\n")
    try:
        await run(client, code=neighbour)  # a module next to the scripts (sys.path[0])
        result = await run(client, code="import agentbox_test_nb; print(agentbox_test_nb.X)")
        assert result.stdout == "1\n", result.stderr
    finally:
        Path(tempfile.gettempdir(), "agentbox_test_nb.py").unlink(missing_ok=True)
