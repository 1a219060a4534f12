"""Running one command to completion for ``POST /exec``.

Theory of operation. Every exec gets its own session (``start_new_session``),
so its process group id is its pid and ``killpg`` reaches the whole tree it
forks (except grandchildren that call ``setsid`` themselves). stdout and stderr
are pipes we create and read ourselves with ``loop.add_reader``: reading never
blocks the loop, both streams drain concurrently so a chatty child cannot
deadlock on a full pipe, and we keep only the first ``MAX_OUTPUT_BYTES`` of
each while still draining the rest.

The exec is finished when its main process exits (or is killed on timeout).
A background child (``server &``) may still hold the pipes then; after a short
grace we hand those pipes to :class:`ExecOwner`, which keeps draining them to
nowhere, so the child neither blocks on a full pipe nor dies of SIGPIPE.

:class:`ExecOwner` owns everything an exec leaves around: the running process
groups (their count is ``Health.running``) and those lingering pipes. On
cancellation (client gone, agent shutting down) the group is SIGKILLed.

Python code normally runs in a child forked from the warm zygote
(``guest/zygote.py``) rather than a new ``python3``; everything above applies
to that child alike (it is a session leader with our pipes as fds 1 and 2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import signal
import tempfile
import time

from typing import TYPE_CHECKING, Any

from guest.errors import AgentError, BadRequest, InvalidCwd
from guest import outputs
from guest.protocol import MAX_OUTPUT_BYTES, ExecRequest, ExecResult

if TYPE_CHECKING:
    from guest.zygote import ZygoteManager

Proc = Any  # an asyncio.subprocess.Process, or a guest.zygote.ZygoteChild (same interface)

READ_CHUNK = 64 * 1024  # the default Linux pipe capacity: one read empties a full pipe
DRAIN_GRACE = 0.5  # seconds to collect output still in the pipes after the command ends
TIMEOUT_EXIT_CODE = -9  # what a SIGKILLed process reports; the contract for timed_out
REAP_TIMEOUT = 5.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty (or, when not root, not ours to kill)


class PipeCapture:
    """Reads one pipe from the event loop; keeps the first ``limit`` bytes."""

    def __init__(self, fd: int, limit: int = MAX_OUTPUT_BYTES) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._limit = limit
        self.data = bytearray()
        self.truncated = False
        self.closed: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self._fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        room = self._limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > room:
            self.truncated = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    def detach(self) -> None:
        """Stop keeping data (the result is taken); keep draining until EOF."""
        self._limit = 0
        self.data = bytearray()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        if not self.closed.done():
            self.closed.set_result(None)


class ExecOwner:
    """Owns running exec process groups and the pipes their leftovers still hold."""

    def __init__(self) -> None:
        self._running: set[Proc] = set()
        self._lingering: set[PipeCapture] = set()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def lingering(self) -> int:
        return len(self._lingering)

    def add(self, proc: Proc) -> None:
        self._running.add(proc)

    def discard(self, proc: Proc) -> None:
        self._running.discard(proc)

    def adopt(self, capture: PipeCapture) -> None:
        """Keep draining a pipe that outlived its exec until its writers exit."""
        if capture.closed.done():
            return
        capture.detach()
        self._lingering.add(capture)
        capture.closed.add_done_callback(lambda _: self._lingering.discard(capture))

    def kill_all(self) -> None:
        for proc in self._running:
            kill_group(proc.pid)

    async def aclose(self) -> None:
        """Kill every running group, wait (bounded) for them, close lingering pipes."""
        self.kill_all()
        waits = [asyncio.create_task(p.wait(), name=f"exec-reap-{p.pid}") for p in self._running]
        if waits:
            _, stuck = await asyncio.wait(waits, timeout=REAP_TIMEOUT)
            for task in stuck:
                task.cancel()
        for capture in list(self._lingering):
            capture.close()


def default_env(shell: str) -> dict[str, str]:
    """The environment every exec starts from (the agent's own env is init's, not a user's)."""
    return {
        "PATH": DEFAULT_PATH,
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": shell,
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
    }


def find_shell() -> str:
    # bash is Essential in Debian images; /bin/sh is the fallback for minimal ones.
    return "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"


class Executor:
    """Runs ExecRequests to completion; ``env`` is the base env (``/init`` extends it)."""

    def __init__(self, owner: ExecOwner, shell: str | None = None) -> None:
        self.owner = owner
        self.shell = shell or find_shell()
        self.env = default_env(self.shell)
        self.zygote: ZygoteManager | None = None  # Python code forks from it when set
        self.output_dir = outputs.OUTPUT_DIR  # result.files: what a run changed in it

    async def run(self, req: ExecRequest) -> ExecResult:
        env = {**self.env, **req.env}
        cwd = _resolve_cwd(req.cwd, env)
        script = None
        if req.code is not None and req.language == "python":
            script = _write_script(req.code)  # a file, not -c: real tracebacks, no ARG_MAX
        before = await outputs.scan_async(self.output_dir)
        try:
            spawned = None
            if script is not None and self.zygote is not None:
                spawned = await _fork_from_zygote(self.zygote, script, cwd, env)
            if spawned is None:
                spawned = await _spawn(self._argv(req, script), cwd, env)
            result = await self._run(spawned, req.timeout)
            after = await outputs.scan_async(self.output_dir)
            return dataclasses.replace(result, files=outputs.changed(before, after))
        finally:
            if script:
                unlink_quietly(script)

    def _argv(self, req: ExecRequest, script: str | None) -> list[str]:
        if req.command is not None:
            return [self.shell, "-c", req.command]
        if script is not None:
            # ``-u``: output written before a timeout kill still reaches us.
            return ["python3", "-u", script]
        return [self.shell if req.language == "bash" else "/bin/sh", "-c", req.code or ""]

    async def _run(self, spawned: tuple[Proc, tuple[PipeCapture, PipeCapture]],
                   timeout: float) -> ExecResult:
        started = time.monotonic()
        proc, pipes = spawned
        self.owner.add(proc)
        try:
            timed_out = await _wait_or_kill(proc, timeout)
            if not all(p.closed.done() for p in pipes):  # (early completion: both are)
                await asyncio.wait([p.closed for p in pipes], timeout=DRAIN_GRACE)
        except BaseException:
            # Cancelled (client gone, shutdown): nothing of this exec may outlive it.
            kill_group(proc.pid)
            for pipe in pipes:
                pipe.close()
            raise
        finally:
            self.owner.discard(proc)
            if proc.returncode is None:
                await asyncio.shield(_reap(proc))
        out, err = pipes
        if getattr(proc, "lost", False):
            for pipe in pipes:
                pipe.close()
            raise AgentError("the Python zygote died while the code ran; its result is unknown")
        result = ExecResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=TIMEOUT_EXIT_CODE if timed_out else _exit_code(proc),
            duration_ms=round((time.monotonic() - started) * 1000, 3),
            timed_out=timed_out,
            truncated=out.truncated or err.truncated,
        )
        for pipe in pipes:
            self.owner.adopt(pipe)  # still open: a background child holds it
        return result


async def _fork_from_zygote(
    zygotes: ZygoteManager, script: str, cwd: str, env: dict[str, str]
) -> tuple[Proc, tuple[PipeCapture, PipeCapture]] | None:
    """Run ``script`` in a child of the warm zygote; None if it cannot (use python3)."""
    zygote = await zygotes.get(env)
    if zygote is None:
        return None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        child = await zygote.fork(script, cwd, env, out_w, err_w)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)  # the zygote closed its copies once the child had them
        os.close(err_w)
    if child is None:
        os.close(out_r)
        os.close(err_r)
        return None
    pipes = (PipeCapture(out_r), PipeCapture(err_r))
    child.watch([p.closed for p in pipes])  # early completion: its own status at EOF
    return child, pipes


async def _spawn(
    argv: list[str], cwd: str, env: dict[str, str]
) -> tuple[Proc, tuple[PipeCapture, PipeCapture]]:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            cwd=cwd,
            env=env,
            start_new_session=True,  # own process group: killpg reaches the whole tree
        )
    except BaseException as exc:
        os.close(out_r)
        os.close(err_r)
        if isinstance(exc, OSError):
            raise _spawn_error(exc, argv) from exc
        if isinstance(exc, ValueError):  # NUL in an argument, '=' in an env name
            raise BadRequest(f"cannot start the command: {exc}") from exc
        raise
    finally:
        os.close(out_w)  # only the child writes, so EOF arrives when its tree is done
        os.close(err_w)
    return proc, (PipeCapture(out_r), PipeCapture(err_r))


def _spawn_error(exc: OSError, argv: list[str]) -> AgentError:
    if exc.errno == errno.E2BIG:
        return BadRequest("command too long for 'sh -c' (128 KiB per argument); send it as a file")
    return AgentError(f"cannot start {argv[0]}: {exc.strerror or exc}")


async def _wait_or_kill(proc: Proc, timeout: float) -> bool:
    """Wait for the main process; on timeout kill its group. True if it timed out.
    A zygote child's ``finished`` future is waited for as it is: no task around a
    ``wait()`` coroutine, whose wake-ups cost loop iterations (milliseconds under TCG)."""
    finished = getattr(proc, "finished", None)
    try:
        if finished is None:
            await asyncio.wait_for(proc.wait(), timeout)
        elif not finished.done() and not (await asyncio.wait({finished}, timeout=timeout))[0]:
            raise TimeoutError
        return False
    except TimeoutError:
        kill_group(proc.pid)
        await _reap(proc)
        return True


async def _reap(proc: Proc) -> None:
    try:
        await asyncio.wait_for(proc.wait(), REAP_TIMEOUT)
    except TimeoutError:
        pass  # stuck in uninterruptible sleep; the child watcher reaps it when it dies


def _exit_code(proc: Proc) -> int:
    return proc.returncode if proc.returncode is not None else TIMEOUT_EXIT_CODE


def _resolve_cwd(cwd: str | None, env: dict[str, str]) -> str:
    if cwd is None:
        home = env.get("HOME", "/")
        return home if os.path.isdir(home) else "/"
    if not os.path.exists(cwd):
        raise InvalidCwd(f"cwd does not exist: {cwd}")
    if not os.path.isdir(cwd):
        raise InvalidCwd(f"cwd is not a directory: {cwd}")
    return cwd


SCRIPT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_script(code: str) -> str:
    """``code`` in a new file of the temp dir, as ``tempfile.mkstemp`` makes one (0600,
    ``O_EXCL|O_NOFOLLOW``, a random name), named from ``os.urandom``: under emulation
    mkstemp's name generator and a text-mode file object cost milliseconds per exec."""
    data = code.encode("utf-8")
    tmp = tempfile.gettempdir()
    for _ in range(tempfile.TMP_MAX):
        path = os.path.join(tmp, f"agentbox-exec-{os.urandom(6).hex()}.py")
        try:
            fd = os.open(path, SCRIPT_FLAGS, 0o600)
        except FileExistsError:
            continue
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            unlink_quietly(path)
            raise
        os.close(fd)
        return path
    raise FileExistsError(errno.EEXIST, "no usable temporary file name found")


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
