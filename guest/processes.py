"""Commands that outlive their request: ``/commands`` (background processes, reattach).

Theory of operation. Each command runs under the shell in its own session (its
pgid is its pid, so a signal can reach its whole tree), with stdout and stderr
read from the event loop into one :class:`OutputRing` per process: the last
``OUTPUT_RING_BYTES`` of its output, stdout and stderr interleaved, each chunk
stamped with its absolute byte offset in the process's output. A client reads
from any offset it was given and follows new output; one that disconnected (or
whose sandbox was suspended and woken: guest memory, and so every ring, is
restored intact) reattaches from the ``next_offset`` it saw last. A reader that
fell more than a ring behind is told how many bytes it missed.

A process is finished when its main process has exited and its pipes are
drained (or ``DRAIN_GRACE`` passed: a daemonised child may hold them forever;
what it writes later is read and dropped). Finished processes stay listed, with
their output, until evicted oldest-first past ``MAX_FINISHED`` entries or
``MAX_FINISHED_BYTES`` of retained output. :class:`ProcessTable` owns them all:
one watcher task per process, killed and reaped on ``aclose``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import os
import signal
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from guest.errors import AgentError, BadRequest, NotFound
from guest.execution import DRAIN_GRACE, READ_CHUNK, REAP_TIMEOUT, _resolve_cwd, kill_group
from guest.protocol import OUTPUT_RING_BYTES, CommandRequest, ProcessInfo, SignalRequest

MAX_RUNNING = 128
MAX_FINISHED = 64
MAX_FINISHED_BYTES = 32 * 1024 * 1024
CHUNK_OVERHEAD = 64  # bytes charged per chunk, so many tiny writes cannot outgrow the bound
READ_BATCH = 1024 * 1024  # output handed to a reader per wake-up


class ProcessNotFound(NotFound):
    code = "process_not_found"


class NotRunning(AgentError):
    code = "not_running"
    status = 409


class StdinClosed(AgentError):
    code = "stdin_closed"
    status = 409


class TooManyProcesses(AgentError):
    code = "too_many_processes"
    status = 429


class OutputRing:
    """The last ``limit`` bytes of a process's output, as (offset, stream, data) chunks."""

    def __init__(self, limit: int = OUTPUT_RING_BYTES) -> None:
        self.limit = limit
        self.chunks: collections.deque[tuple[int, str, bytes]] = collections.deque()
        self.start = 0  # offset of the oldest byte kept
        self.end = 0  # offset just past the newest byte
        self.size = 0

    def append(self, stream: str, data: bytes) -> None:
        self.chunks.append((self.end, stream, data))
        self.end += len(data)
        self.size += len(data) + CHUNK_OVERHEAD
        while self.size > self.limit and len(self.chunks) > 1:
            _, _, old = self.chunks.popleft()
            self.size -= len(old) + CHUNK_OVERHEAD
        self.start = self.chunks[0][0]

    def read(self, offset: int, limit: int = READ_BATCH) -> list[tuple[int, str, bytes]]:
        """Chunks from ``offset`` (clamped to ``start``), up to about ``limit`` bytes."""
        out: list[tuple[int, str, bytes]] = []
        if offset >= self.end:
            return out
        # Readers are usually near the end: find the first chunk scanning backwards.
        index = len(self.chunks)
        for off, _, _ in reversed(self.chunks):
            if off <= offset:
                break
            index -= 1
        index = max(index - 1, 0)
        total = 0
        for off, stream, data in itertools.islice(self.chunks, index, None):
            if off + len(data) <= offset:
                continue
            if off < offset:
                data, off = data[offset - off:], offset
            out.append((off, stream, data))
            total += len(data)
            if total >= limit:
                break
        return out


def _utf8_cut(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for the lead
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if (
            byte & 0xF8 == 0xF0) else 1
        return len(data) - back if need > back else len(data)
    return len(data)


class ManagedProcess:
    """One command: its process, output ring, stdin and exit status."""

    def __init__(self, req: CommandRequest, proc: asyncio.subprocess.Process, cwd: str) -> None:
        self.req, self.proc, self.cwd = req, proc, cwd
        self.pid = proc.pid
        self.ring = OutputRing()
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.exit_code: int | None = None
        self.timed_out = False
        self.stdin_open = req.stdin
        self.stdin_lock = asyncio.Lock()
        self._pending = {"stdout": b"", "stderr": b""}  # an incomplete UTF-8 tail
        self._changed = asyncio.Event()
        self.watcher: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.finished_at is None

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            pid=self.pid, command=self.req.command, cwd=self.cwd,
            background=self.req.background, stdin=self.stdin_open, running=self.running,
            exit_code=self.exit_code, started_at=self.started_at,
            finished_at=self.finished_at, timed_out=self.timed_out,
            output_bytes=self.ring.end)

    def on_output(self, stream: str, chunk: bytes) -> None:
        if not self.running:
            return  # a daemonised child still writing after the exit was reported
        data = self._pending[stream] + chunk
        cut = len(data) if not chunk else _utf8_cut(data)
        self._pending[stream] = data[cut:]
        if cut:
            self.ring.append(stream, data[:cut])
            self._notify()

    def finish(self, exit_code: int) -> None:
        for stream in ("stdout", "stderr"):
            self.on_output(stream, b"")  # flush an incomplete tail as it is
        self.exit_code = exit_code
        self.finished_at = time.time()
        self.stdin_open = False
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, offset: int) -> None:
        """Return once there is output past ``offset`` or the process finished."""
        while self.running and self.ring.end <= offset:
            await self._changed.wait()

    async def events(self, offset: int, follow: bool) -> AsyncIterator[dict[str, Any]]:
        """Output from ``offset`` as protocol events; with ``follow``, until ``exit``."""
        offset = max(offset, 0)
        while True:
            if offset < self.ring.start:
                yield {"type": "dropped", "offset": offset, "next_offset": self.ring.start}
                offset = self.ring.start
            for off, stream, data in self.ring.read(offset):
                offset = off + len(data)
                yield {"type": stream, "data": data.decode("utf-8", "replace"),
                       "offset": off, "next_offset": offset}
            if offset >= self.ring.end and not self.running:
                yield {"type": "exit", "exit_code": self.exit_code, "offset": self.ring.end,
                       "timed_out": self.timed_out}
                return
            if not follow and offset >= self.ring.end:
                return
            await self.changed(offset)


class _Pipe:
    """One output pipe read from the event loop into a process's ring."""

    def __init__(self, fd: int, mp: ManagedProcess, stream: str) -> None:
        self._loop = asyncio.get_running_loop()
        self.fd, self.mp, self.stream = fd, mp, stream
        self.closed: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if chunk:
            self.mp.on_output(self.stream, chunk)
        else:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            self._loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.closed.set_result(None)


class ProcessTable:
    """Owns every command started through ``/commands``."""

    def __init__(self, base_env: dict[str, str], shell: str) -> None:
        self.base_env = base_env  # the exec base env; /init updates it in place
        self.shell = shell
        self.procs: dict[int, ManagedProcess] = {}
        self._pipes: set[_Pipe] = set()

    @property
    def running(self) -> int:
        return sum(1 for p in self.procs.values() if p.running)

    def get(self, pid: int) -> ManagedProcess:
        mp = self.procs.get(pid)
        if mp is None:
            raise ProcessNotFound(f"no command with pid {pid}")
        return mp

    def list(self) -> list[ProcessInfo]:
        return [p.info() for p in sorted(self.procs.values(), key=lambda p: p.started_at)]

    async def start(self, req: CommandRequest) -> ManagedProcess:
        if self.running >= MAX_RUNNING:
            raise TooManyProcesses(f"at most {MAX_RUNNING} commands may run at once")
        env = {**self.base_env, **req.env}
        cwd = _resolve_cwd(req.cwd, env)
        proc, out_r, err_r = await self._spawn(req, cwd, env)
        self.procs.pop(proc.pid, None)  # a finished entry whose pid the kernel reused
        mp = ManagedProcess(req, proc, cwd)
        self.procs[mp.pid] = mp
        pipes = [_Pipe(out_r, mp, "stdout"), _Pipe(err_r, mp, "stderr")]
        self._pipes.update(pipes)
        mp.watcher = asyncio.create_task(self._watch(mp, pipes), name=f"command-{mp.pid}")
        return mp

    async def _spawn(self, req: CommandRequest, cwd: str, env: dict[str, str]
                     ) -> tuple[asyncio.subprocess.Process, int, int]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin = asyncio.subprocess.PIPE if req.stdin else asyncio.subprocess.DEVNULL
        try:
            proc = await asyncio.create_subprocess_exec(
                self.shell, "-c", req.command, stdin=stdin, stdout=out_w, stderr=err_w,
                cwd=cwd, env=env, start_new_session=True)
        except BaseException as exc:
            os.close(out_r)
            os.close(err_r)
            if isinstance(exc, ValueError):  # NUL in the command, '=' in an env name
                raise BadRequest(f"cannot start the command: {exc}") from exc
            if isinstance(exc, OSError):
                if exc.errno == errno.E2BIG:
                    raise BadRequest("command too long for 'sh -c' (128 KiB per argument)"
                                     ) from exc
                raise AgentError(f"cannot start {self.shell}: {exc.strerror or exc}") from exc
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return proc, out_r, err_r

    async def _watch(self, mp: ManagedProcess, pipes: list[_Pipe]) -> None:
        proc = mp.proc
        try:
            await asyncio.wait_for(proc.wait(), mp.req.timeout)
        except TimeoutError:
            mp.timed_out = True
            kill_group(mp.pid)
            with contextlib.suppress(TimeoutError):  # stuck in D state: report it killed
                await asyncio.wait_for(proc.wait(), REAP_TIMEOUT)
        finally:
            if proc.returncode is None:  # cancelled: the agent is shutting down
                kill_group(mp.pid)
        await asyncio.wait([p.closed for p in pipes], timeout=DRAIN_GRACE)
        for pipe in pipes:
            # Still open: a background child holds it. It is drained (and dropped) until EOF.
            pipe.closed.add_done_callback(lambda _, p=pipe: self._pipes.discard(p))
        if mp.proc.stdin is not None:
            mp.proc.stdin.close()
        mp.finish(proc.returncode if proc.returncode is not None else -signal.SIGKILL)
        self._evict()

    def _evict(self) -> None:
        finished = [p for p in self.procs.values() if not p.running]
        finished.sort(key=lambda p: p.finished_at or 0.0)
        retained = sum(p.ring.size for p in finished)
        while finished and (len(finished) > MAX_FINISHED or retained > MAX_FINISHED_BYTES):
            old = finished.pop(0)
            retained -= old.ring.size
            self.procs.pop(old.pid, None)

    async def write_stdin(self, pid: int, chunks: AsyncIterable[bytes], eof: bool) -> None:
        mp = self.get(pid)
        async with mp.stdin_lock:
            stdin = mp.proc.stdin
            if stdin is None or not mp.stdin_open:
                raise StdinClosed(f"command {pid} has no open stdin (start it with stdin=true)")
            try:
                async for chunk in chunks:
                    stdin.write(chunk)
                    await stdin.drain()
                if eof:
                    mp.stdin_open = False
                    stdin.close()
            except (BrokenPipeError, ConnectionResetError) as exc:
                mp.stdin_open = False
                raise StdinClosed(f"command {pid} closed its stdin") from exc

    def signal(self, pid: int, req: SignalRequest) -> None:
        mp = self.get(pid)
        if not mp.running or mp.proc.returncode is not None:
            raise NotRunning(f"command {pid} is not running")
        sig = req.signal
        signum = getattr(signal, sig.upper()) if isinstance(sig, str) else sig
        try:
            if req.group:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError as exc:
            raise NotRunning(f"command {pid} is not running") from exc

    async def wait(self, pid: int, timeout: float) -> ProcessInfo:
        mp = self.get(pid)
        if mp.running and mp.watcher is not None:
            await asyncio.wait({mp.watcher}, timeout=timeout)
        return mp.info()

    def kill(self, pid: int) -> None:
        mp = self.procs.get(pid)
        if mp is not None and mp.running:
            kill_group(pid)

    def kill_all(self) -> None:
        for mp in self.procs.values():
            if mp.running:
                kill_group(mp.pid)

    async def aclose(self) -> None:
        """Kill every running command, wait (bounded) for the watchers, close all pipes."""
        self.kill_all()
        watchers = [p.watcher for p in self.procs.values() if p.watcher and not p.watcher.done()]
        if watchers:
            _, stuck = await asyncio.wait(watchers, timeout=REAP_TIMEOUT + DRAIN_GRACE)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=1.0)
        for pipe in list(self._pipes):
            pipe.close()
        self._pipes.clear()
