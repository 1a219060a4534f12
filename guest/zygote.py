"""The agent's side of the warm zygote (``guest/zygote_worker.py``) for Python ``/exec``.

Theory of operation. ``python3 -u FILE`` under emulation costs ~200 ms before
the first line of user code runs, nearly all of it interpreter start-up and
imports. The zygote pays that once: it starts with the agent (so a golden
snapshot holds it, warm), imports what the template asks for, and forks one
child per exec. The child is a fresh process in every way that user code can
observe except the ones documented in docs/guest-agent.md (it shares the zygote's
str hash seed; more modules are already in ``sys.modules``).

:class:`ZygoteChild` quacks like the ``asyncio.subprocess.Process`` that
:class:`guest.execution.Executor` waits for, so timeouts (``killpg`` of the
child's session), output capture, the exec owner and ``Health.running`` work as
for any command. A child that ends its script normally writes its exit status to
its own status pipe just before it exits (early completion, see
``guest/zygote_worker.py``), so the exec is answered without waiting for the
kernel to tear the process down; the zygote's report over the control socket
(after it reaped the child) covers every other ending. If the zygote itself dies,
the groups of its children still running are killed and their execs fail
(``lost``), since nobody can tell how they ended.

:class:`ZygoteManager` decides, per exec, whether the zygote may run it: it
must be up (a start in progress is waited for, so a golden snapshot's warm-up
exec waits until the zygote is warm), and the call must not depend on anything
fixed at interpreter start-up: the ``python3`` that ``PATH`` finds, and the
variables in :func:`startup_env` (``PYTHON*``, locale, ``HOME``, ...). Anything
else runs as plain ``python3`` (the fallback). A zygote that reports itself
stale, dies, or was started with a base env that ``/init`` has since changed is
replaced by a new one; old ones finish their running children first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time

from guest.execution import kill_group, unlink_quietly

log = logging.getLogger("agentbox.guest.zygote")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_worker.py")
START_TIMEOUT = 120.0  # preloading pandas + matplotlib under TCG takes many seconds
RETRY_AFTER = 30.0  # after a failed start, execs use plain python3 for this long
MAX_MESSAGE = 256 * 1024  # larger requests (huge env) go the plain python3 way
STOP_TIMEOUT = 5.0
SPARE_WAIT = 2.0  # longest an exec waits for a spare being forked before forking its own
_STARTUP_NAMES = {"HOME", "LANG", "LANGUAGE", "TZ", "MPLBACKEND", "MPLCONFIGDIR",
                  "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                  "LD_PRELOAD", "LD_LIBRARY_PATH"}


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` a Python process reads once, at start-up or first import."""
    return {k: v for k, v in env.items()
            if k in _STARTUP_NAMES or k.startswith(("PYTHON", "LC_"))}


def which_python(env: dict[str, str]) -> str | None:
    return shutil.which("python3", path=env.get("PATH", os.defpath))


class ZygoteLost(Exception):
    """The zygote died while a child of it ran: its exit status is unknown."""


STATUS_BYTES = 16  # a child's status report: a decimal exit code


class ZygoteChild:
    """One forked exec, waited for like an ``asyncio.subprocess.Process``.

    ``status_path``: where the child reports its exit status when it finishes its
    script normally; read once both of its output pipes have reached EOF."""

    def __init__(self, pid: int, status_path: str) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.lost = False
        self._done = asyncio.get_running_loop().create_future()
        self._status_path = status_path

    @property
    def done(self) -> bool:
        return self._done.done()

    @property
    def finished(self) -> asyncio.Future[None]:
        """Done when ``returncode`` is known (``Executor`` waits for it directly)."""
        return self._done

    async def wait(self) -> int:
        await asyncio.shield(self._done)
        assert self.returncode is not None
        return self.returncode

    def exited(self, returncode: int, lost: bool = False) -> None:
        if not self._done.done():
            self.returncode, self.lost = returncode, lost
            self._done.set_result(None)
        if self._status_path:  # once: the zygote's report may follow the child's own
            unlink_quietly(self._status_path)
            self._status_path = ""

    def watch(self, closed: list[asyncio.Future[None]]) -> None:
        """Once every output pipe is at EOF, take the child's own status report if
        it wrote one (else the zygote's returncode message will come)."""
        pending = set(closed)

        def one_closed(fut: asyncio.Future[None]) -> None:
            pending.discard(fut)
            if not pending and not self.done:
                code = _read_status(self._status_path)
                if code is not None:
                    self.exited(code)

        for fut in closed:
            fut.add_done_callback(one_closed)


class Spare:
    """Our end of a spare child's socket, and the zygote's staleness mtimes then."""

    def __init__(self, pid: int, sock: socket.socket, watch: dict[str, int]) -> None:
        self.pid, self.sock, self.watch = pid, sock, watch

    def current(self) -> bool:
        """Whether a fresh python3 would still see the packages the spare sees."""
        return all(_mtime(path) == mtime for path, mtime in self.watch.items())

    def close(self) -> None:
        self.sock.close()


def raise_priority(pid: int | None) -> None:
    """Back to the normal policy: the zygote while it forks a spare, and a spare, run
    at SCHED_IDLE, which a CPU-bound process in the guest would starve."""
    if pid is None:
        return
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass  # gone, or not ours to change: it runs when the CPU is free


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _status_root() -> str | None:
    return "/run" if os.access("/run", os.W_OK) else None  # None: tempfile's default


def _read_status(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            data = f.read(STATUS_BYTES)
    except OSError:
        return None
    return int(data) if data.isdigit() else None


class Zygote:
    """One zygote process and its control socket."""

    def __init__(self, python: str, env: dict[str, str], preload: tuple[str, ...]) -> None:
        self.python, self.env, self.preload = python, dict(env), preload
        self.startup = startup_env(env)
        self.proc: asyncio.subprocess.Process | None = None
        self.sock: socket.socket | None = None
        self.stale = False
        self.started_ms = 0.0
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._replies: dict[int, asyncio.Future[dict]] = {}
        self._children: dict[int, ZygoteChild] = {}
        self._next_id = 0
        self.spare: Spare | None = None  # a child forked ahead of need (the worker's doc)
        self._spare_coming: asyncio.Future[None] | None = None  # the zygote is forking one
        # Early-completion status files (``ZygoteChild``), on tmpfs; removed with us.
        self.status_dir = tempfile.mkdtemp(prefix="agentbox-zygote-", dir=_status_root())

    @property
    def alive(self) -> bool:
        return self.sock is not None

    async def start(self) -> None:
        started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, "-u", WORKER, str(theirs.fileno()), *self.preload,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), cwd="/", env=self.env, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self._loop.add_reader(ours.fileno(), self._readable)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT)
        except BaseException:
            await self.aclose()
            raise
        self.started_ms = (time.monotonic() - started) * 1000

    def _readable(self) -> None:
        assert self.sock is not None
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            self._gone()
            return
        msg = json.loads(data)
        if msg.get("type") == "spare" and len(fds) == 1:
            self._new_spare(Spare(msg["pid"], socket.socket(fileno=fds[0]), msg["watch"]))
            return
        for fd in fds:
            os.close(fd)
        self._handle(msg)

    def _new_spare(self, spare: Spare | None) -> None:
        if self.spare is not None:
            self.spare.close()
        self.spare = spare
        if self.stale:
            self._drop_spare()
        coming, self._spare_coming = self._spare_coming, None
        if coming is not None and not coming.done():
            coming.set_result(None)

    def _drop_spare(self) -> None:
        """Close our end of the spare's socket: it exits unused (the zygote reaps it)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.close()

    def _handle(self, msg: dict) -> None:
        if msg.get("type") == "ready":
            if not self._ready.done():
                self._ready.set_result(None)
        elif msg.get("type") == "forking":
            if self._spare_coming is None:
                self._spare_coming = self._loop.create_future()
        elif msg.get("type") == "no-spare":
            self._new_spare(None)
        elif "returncode" in msg:
            child = self._children.pop(msg["pid"], None)
            if child is not None:
                child.exited(msg["returncode"])
            elif self.spare is not None and self.spare.pid == msg["pid"]:
                self._drop_spare()  # it died while it waited
        else:
            reply = self._replies.pop(msg["id"], None)
            if reply is not None and not reply.done():
                reply.set_result(msg)
            elif "pid" in msg:  # its exec was cancelled before the pid came back
                kill_group(msg["pid"])

    def _gone(self) -> None:
        """The control socket hit EOF: the zygote exited (stale, killed, crashed)."""
        shutil.rmtree(self.status_dir, ignore_errors=True)
        self._new_spare(None)
        if self.sock is not None:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if not self._ready.done():
            self._ready.set_exception(ZygoteLost("the zygote exited before it was ready"))
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(ZygoteLost("the zygote exited"))
        self._replies.clear()
        for child in self._children.values():
            if not child.done:  # one that reported its status may have left a background tree
                kill_group(child.pid)
                child.exited(-9, lost=True)
        self._children.clear()

    async def fork(self, script: str, cwd: str, env: dict[str, str],
                   out_w: int, err_w: int) -> ZygoteChild | None:
        """Fork a child running ``script``; None if the zygote cannot (stale, gone)."""
        if self.sock is None or self.stale:
            return None
        self._next_id += 1
        req_id = self._next_id  # ours: others may take ids while we wait for a spare
        status = os.path.join(self.status_dir, str(req_id))
        msg = json.dumps({"id": req_id, "script": script, "cwd": cwd, "env": env,
                          "status": status})
        if len(msg) > MAX_MESSAGE:
            return None
        if self.spare is None and self._spare_coming is not None:
            # Being forked: waiting for it is never slower than a second fork.
            raise_priority(self.proc.pid if self.proc else None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._spare_coming), SPARE_WAIT)
        spare, self.spare = self.spare, None
        if spare is not None:
            with contextlib.closing(spare):
                if not spare.current():
                    self.stale = True  # the zygote would say so too
                    return None
                child = self._hand(spare, msg.encode(), out_w, err_w, status)
            if child is not None:
                return child
        if self.sock is None:
            return None  # gone while we waited
        reply = self._loop.create_future()
        self._replies[req_id] = reply
        try:
            socket.send_fds(self.sock, [msg.encode()], [out_w, err_w])
        except OSError as exc:
            self._replies.pop(req_id, None)
            log.warning("zygote: cannot send a request: %s", exc)
            return None
        try:
            answer = await reply
        except ZygoteLost:
            return None
        if answer.get("stale"):
            self.stale = True
            return None
        if "pid" not in answer:
            log.warning("zygote: %s", answer.get("error"))
            return None
        child = ZygoteChild(answer["pid"], status)
        self._children[child.pid] = child
        return child

    def _hand(self, spare: Spare, msg: bytes, out_w: int, err_w: int,
              status: str) -> ZygoteChild | None:
        """Give a request to the spare (it is the zygote's child: the zygote reports
        its exit); None if the spare is gone (the caller asks the zygote instead)."""
        raise_priority(spare.pid)  # it waits at idle priority
        try:
            socket.send_fds(spare.sock, [msg], [out_w, err_w])
        except OSError:
            return None
        child = ZygoteChild(spare.pid, status)
        self._children[child.pid] = child
        return child

    def retire(self) -> None:
        """Ask the zygote to exit once its running children are done."""
        self._drop_spare()
        self.stale = True
        if self.sock is not None:
            try:
                self.sock.send(json.dumps({"retire": True}).encode())
            except OSError:
                pass

    async def aclose(self) -> None:
        """Stop the zygote (its running children are the exec owner's to kill)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._gone()


class ZygoteManager:
    """Keeps one current zygote for the exec base env; says which one may run an exec."""

    def __init__(self, base_env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self.base_env = base_env  # the Executor's (``/init`` updates it in place)
        self.preload = preload
        self.current: Zygote | None = None
        self._starting: asyncio.Task[Zygote | None] | None = None
        self._old: set[Zygote] = set()
        self._failed_at = -RETRY_AFTER
        self._closed = False

    def start_soon(self) -> None:
        if self._starting is None and not self._closed:
            self._starting = asyncio.create_task(self._start(), name="zygote-start")

    async def _start(self) -> Zygote | None:
        python = which_python(self.base_env)
        if python is None:
            return None
        zygote = Zygote(python, self.base_env, self.preload)
        try:
            await zygote.start()
        except Exception as exc:
            log.warning("zygote did not start (execs use plain python3): %s", exc)
            self._failed_at = time.monotonic()
            return None
        log.info("zygote ready in %.0f ms (preloaded: %s)", zygote.started_ms,
                 ", ".join(self.preload) or "stdlib only")
        return zygote

    async def get(self, env: dict[str, str]) -> Zygote | None:
        """The zygote that may run an exec with ``env``, or None: use plain python3."""
        zygote = await self._current()
        if zygote is None or startup_env(env) != zygote.startup:
            return None
        if which_python(env) != zygote.python:
            return None  # another python3 first on PATH (a venv): it is not ours
        return zygote

    async def _current(self) -> Zygote | None:
        zygote = self.current
        if zygote is not None and (not zygote.alive or zygote.stale
                                   or startup_env(self.base_env) != zygote.startup):
            self._retire(zygote)
            zygote = None
        if zygote is None and self._starting is None:
            if time.monotonic() - self._failed_at < RETRY_AFTER or self._closed:
                return None
            self.start_soon()
        if self._starting is not None:
            task = self._starting
            zygote = await asyncio.shield(task)
            if self._starting is task:
                self._starting, self.current = None, zygote
        return self.current

    def _retire(self, zygote: Zygote) -> None:
        self.current = None
        zygote.retire()  # it exits by itself once its children are done
        self._old = {z for z in self._old if z.alive}
        if zygote.alive:
            self._old.add(zygote)

    async def aclose(self) -> None:
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()
            try:
                zygote = await self._starting
            except BaseException:
                zygote = None
            if zygote is not None:
                self._old.add(zygote)
        if self.current is not None:
            self._old.add(self.current)
        self.current = None
        for zygote in list(self._old):
            await zygote.aclose()
        self._old.clear()
