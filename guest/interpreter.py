"""The stateful code interpreter behind ``/contexts`` and ``/run_code``.

Theory of operation. A context is one long-lived ``python3`` worker process
(``guest/kernel_worker.py``) holding the user's globals, so variables and
imports persist between runs. Contexts are independent processes; runs in one
context are serialised by its lock. The worker talks to us over two pipes
(requests in, JSON event lines out); its fds 1 and 2 are two more pipes that we
read from the event loop, so everything the run prints is captured, including
the output of C code and child processes.

Ordering: before the worker writes an event line it flushes its streams, and
before we handle an event line we drain the output pipes, so a run's
stdout/stderr chunks, results and error reach the client in the order the code
produced them. Each run's events go through a queue to whoever consumes them
(a streamed response or an :class:`ExecutionCollector`); when the consumer falls
behind we stop reading the output pipes, and the worker blocks on a full pipe:
backpressure, not unbounded buffering.

Timeouts: SIGINT at the deadline (the run ends with a ``TimeoutError`` and the
context keeps its state), then after ``INTERRUPT_GRACE`` SIGKILL of the
worker's process group; the run ends with an error saying the state was lost
and the next run starts a fresh worker. A consumer that goes away (client
disconnected, agent shutting down) interrupts its run the same way.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from guest.errors import AgentError, InvalidCwd, NotFound
from guest import outputs
from guest.execution import READ_CHUNK, kill_group
from guest.protocol import (
    DEFAULT_CONTEXT,
    MAX_OUTPUT_BYTES,
    ContextInfo,
    CreateContextRequest,
    Execution,
    ExecutionError,
    OutputFile,
    RunCodeRequest,
)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_worker.py")
MAX_CONTEXTS = 32
START_TIMEOUT = 60.0  # a worker's python3 start-up under slow emulation
INTERRUPT_GRACE = 3.0  # seconds between SIGINT and SIGKILL
SETTLE_TIMEOUT = 10.0  # how long an abandoned run may take to wind down
QUEUE_HIGH, QUEUE_LOW = 64, 16  # output events queued: pause reading above, resume below
MAX_EVENT_LINE = 64 * 1024 * 1024
MERGE_LIMIT = 64 * 1024  # characters of queued output merged into one event

Emit = Callable[[dict[str, Any]], Awaitable[None]]


class ContextNotFound(NotFound):
    code = "context_not_found"


class ContextExists(AgentError):
    code = "context_exists"
    status = 409


class TooManyContexts(AgentError):
    code = "too_many_contexts"
    status = 429


class ContextStartFailed(AgentError):
    code = "context_start_failed"
    status = 500


class _Reader:
    """Reads one pipe from the event loop (pausable); ``on_data(b"")`` at EOF."""

    def __init__(self, fd: int, on_data: Callable[[bytes], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd, self._on_data, self._paused = fd, on_data, False
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self.read)

    def read(self) -> bool:
        """Read what is there now; False when the pipe is empty or closed."""
        if self._fd < 0:
            return False
        try:
            chunk = os.read(self._fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
        self._on_data(chunk)
        return bool(chunk)

    def drain(self) -> None:
        while self.read():
            pass

    def pause(self, paused: bool) -> None:
        if self._fd < 0 or paused == self._paused:
            return
        self._paused = paused
        if paused:
            self._loop.remove_reader(self._fd)
        else:
            self._loop.add_reader(self._fd, self.read)

    def close(self) -> None:
        if self._fd >= 0:
            if not self._paused:
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


class _Events:
    """A run's event queue; output not yet taken merges into one event per stream."""

    def __init__(self) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, event: dict[str, Any]) -> None:
        last = self._items[-1] if self._items else None
        if (last is not None and last["type"] == event["type"] in ("stdout", "stderr")
                and len(last["data"]) < MERGE_LIMIT):
            last["data"] += event["data"]
        else:
            self._items.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> dict[str, Any]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class _Run:
    """One execution in flight: its event queue and how it is being ended."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.started = time.monotonic()
        self.queue = _Events()
        self.over = False  # "done" or "exited" was consumed
        self.interrupted = ""  # why SIGINT was sent ("" = it was not)
        self.killed = False
        self.timers: list[asyncio.TimerHandle] = []

    def end_event(self) -> dict[str, Any]:
        ms = round((time.monotonic() - self.started) * 1000, 3)
        return {"type": "end", "execution_count": self.count, "duration_ms": ms}


class Context:
    """One named context: its worker process, its lock, the run in flight."""

    def __init__(self, name: str, cwd: str, env: dict[str, str], python: str) -> None:
        self.name, self.cwd, self.env, self.python = name, cwd, env, python
        self.created_at = time.time()
        self.execution_count = 0
        self.lock = asyncio.Lock()
        self.proc: asyncio.subprocess.Process | None = None
        self.run_: _Run | None = None
        self._cmd_fd = -1
        self._readers: list[_Reader] = []
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._line = bytearray()
        self._decoders: dict[str, Any] = {}
        self._tail = bytearray()  # output while no run is active (start-up errors)
        self._alive = False  # the event pipe is open
        self.deleted = False

    def info(self) -> ContextInfo:
        pid = self.proc.pid if self.proc is not None else None
        return ContextInfo(self.name, "python", self.cwd, pid, self.run_ is not None,
                           self.execution_count, self.created_at)

    # -- the worker process ------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker and wait for its ``ready`` line."""
        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, WORKER, str(cmd_r), str(evt_w),
                stdin=asyncio.subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                pass_fds=(cmd_r, evt_w), cwd=self.cwd, env=self.env, start_new_session=True)
        except BaseException as exc:
            for fd in (cmd_w, evt_r, out_r, err_r):
                os.close(fd)
            if isinstance(exc, OSError):
                raise ContextStartFailed(f"cannot start {self.python}: {exc}") from exc
            raise
        finally:
            for fd in (cmd_r, evt_w, out_w, err_w):
                os.close(fd)
        self._cmd_fd = cmd_w
        self._alive = True
        self._line.clear()
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace")
                          for s in ("stdout", "stderr")}
        self._ready = asyncio.get_running_loop().create_future()
        self._readers = [_Reader(out_r, lambda b: self._on_output("stdout", b)),
                         _Reader(err_r, lambda b: self._on_output("stderr", b)),
                         _Reader(evt_r, self._on_events)]
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT)
        except BaseException as exc:
            await asyncio.shield(self.stop())
            if isinstance(exc, (TimeoutError, ConnectionError)):
                tail = self._tail.decode(errors="replace").strip()[-2000:]
                raise ContextStartFailed(f"context {self.name!r} did not start: "
                                         f"{tail or exc or 'no answer'}") from exc
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            kill_group(self.proc.pid)

    async def stop(self) -> int | None:
        """Kill the worker's group, reap it, close our ends (idempotent).

        Returns the worker's exit status if there was a worker."""
        proc, self.proc = self.proc, None
        if proc is not None:
            kill_group(proc.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5.0)
        for reader in self._readers:
            reader.close()
        self._readers = []
        self._alive = False
        if self._cmd_fd >= 0:
            os.close(self._cmd_fd)
            self._cmd_fd = -1
        if self.run_ is not None and not self.run_.over:
            self.run_.queue.put_nowait({"type": "exited"})  # deleted or shut down mid-run
        return None if proc is None else proc.returncode

    async def _send(self, message: bytes) -> None:
        fd = self._cmd_fd

        def write_all() -> None:  # blocking, in a thread: code may be bigger than a pipe
            view = memoryview(message)
            while view:
                view = view[os.write(fd, view):]

        try:
            await asyncio.to_thread(write_all)
        except OSError as exc:  # the worker died between runs; the run reports it
            self._tail += f"cannot send the code: {exc}\n".encode()

    # -- what the worker says ------------------------------------------------------------

    def _on_output(self, stream: str, chunk: bytes) -> None:
        run = self.run_
        if run is None:
            self._tail = (self._tail + chunk)[-4096:]
            return
        text = self._decoders[stream].decode(chunk, final=not chunk)
        if text:
            run.queue.put_nowait({"type": stream, "data": text})
            if run.queue.qsize() > QUEUE_HIGH:
                self._pause_output(True)

    def _pause_output(self, paused: bool) -> None:
        for reader in self._readers[:2]:
            reader.pause(paused)

    def _on_events(self, chunk: bytes) -> None:
        for reader in self._readers[:2]:
            reader.drain()  # output written before the event goes first
        if not chunk:
            self._on_exit()
            return
        self._line += chunk
        if len(self._line) > MAX_EVENT_LINE:
            self.kill()  # a runaway worker; EOF follows
            return
        *lines, rest = self._line.split(b"\n")
        self._line = bytearray(rest)
        for line in lines:
            self._on_event(line)

    def _on_event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return  # not ours (the user wrote to our fd); nothing sensible to do
        if event.get("type") == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(event)
        elif self.run_ is not None:
            self.run_.queue.put_nowait(event)

    def _on_exit(self) -> None:
        self._alive = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ConnectionError("the worker exited during start-up"))
        if self.run_ is not None:
            self.run_.queue.put_nowait({"type": "exited"})

    # -- runs ------------------------------------------------------------------------------

    async def run(self, req: RunCodeRequest, emit: Emit) -> None:
        """Run ``req.code``, passing each event (see ``guest/protocol.py``) to ``emit``."""
        async with self.lock:
            if self.deleted:
                raise ContextNotFound(f"context {self.name!r} was deleted")
            if self.proc is None or not self._alive:
                await self.stop()  # it died between runs: a fresh worker, fresh state
                await self.start()
            self.execution_count += 1
            run = self.run_ = _Run(self.execution_count)
            loop = asyncio.get_running_loop()
            run.timers.append(loop.call_later(req.timeout, self._interrupt, run, "timeout"))
            message = {"code": req.code, "env": req.env, "count": run.count}
            try:
                await self._send(json.dumps(message).encode() + b"\n")
                await self._pump(run, req.timeout, emit)
            except BaseException:
                if not run.over:  # the consumer left: wind the run down before unlocking
                    self._interrupt(run, "abandoned")
                    await asyncio.shield(self._settle(run))
                raise
            finally:
                for timer in run.timers:
                    timer.cancel()
                self.run_ = None
                self._pause_output(False)

    async def _pump(self, run: _Run, timeout: float, emit: Emit) -> None:
        while True:
            event = await run.queue.get()
            if run.queue.qsize() < QUEUE_LOW:
                self._pause_output(False)
            kind = event.get("type")
            if kind == "done":
                run.over = True
                await emit(run.end_event())
                return
            if kind == "exited":
                run.over = True
                code = await self.stop()
                await emit({"type": "error", "error": self._lost(run, timeout, code)})
                await emit(run.end_event())
                return
            if kind == "error" and run.interrupted == "timeout":
                event = {"type": "error", "error": _timed_out(event["error"], timeout)}
            await emit(event)

    def _interrupt(self, run: _Run, why: str) -> None:
        if run.over or run.interrupted or self.proc is None:
            return
        run.interrupted = why
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGINT)
        loop = asyncio.get_running_loop()
        run.timers.append(loop.call_later(INTERRUPT_GRACE, self._kill_run, run))

    def _kill_run(self, run: _Run) -> None:
        if not run.over:
            run.killed = True
            self.kill()  # EOF on the event pipe ends the run as "exited"

    async def _settle(self, run: _Run) -> None:
        async def discard(event: dict[str, Any]) -> None:
            pass

        try:
            await asyncio.wait_for(self._pump(run, 0, discard), SETTLE_TIMEOUT)
        except TimeoutError:
            await self.stop()

    def _lost(self, run: _Run, timeout: float, code: int | None) -> dict[str, Any]:
        if self.deleted:
            head, name = "the context was deleted while this ran", "ContextDeleted"
        elif run.killed and run.interrupted == "timeout":
            head = (f"execution timed out after {timeout:g}s and did not stop on interrupt; "
                    "the context was restarted")
            name = "TimeoutError"
        else:
            head = f"the context's python process exited (code {code}); it will be restarted"
            name = "ContextRestarted"
        value = f"{head}: its state (variables, imports) was lost"
        return ExecutionError(name, value, f"{name}: {value}\n").to_dict()


def _timed_out(error: dict[str, Any], timeout: float) -> dict[str, Any]:
    if error.get("name") != "KeyboardInterrupt":
        return error
    value = (f"execution timed out after {timeout:g}s and was interrupted; "
             "the context keeps its state")
    tb = str(error.get("traceback", "")).rstrip("\n")
    return {"name": "TimeoutError", "value": value, "traceback": f"{tb}\nTimeoutError: {value}\n"}


class ExecutionCollector:
    """Folds a run's events into one :class:`Execution` (the non-streamed answer)."""

    def __init__(self) -> None:
        self.out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.size = {"stdout": 0, "stderr": 0}
        self.truncated = False
        self.results: list[dict[str, Any]] = []
        self.error: ExecutionError | None = None
        self.end: dict[str, Any] = {}

    async def emit(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in self.out:
            data = event["data"]
            room = MAX_OUTPUT_BYTES - self.size[kind]
            if len(data) > room:
                data, self.truncated = data[:max(room, 0)], True
            self.out[kind].append(data)
            self.size[kind] += len(data)
        elif kind == "result":
            self.results.append(event["result"])
        elif kind == "error":
            self.error = ExecutionError.from_dict(event["error"])
        elif kind == "end":
            self.end = event

    def result(self) -> Execution:
        return Execution("".join(self.out["stdout"]), "".join(self.out["stderr"]),
                         self.results, self.error, self.end.get("execution_count", 0),
                         self.end.get("duration_ms", 0.0), self.truncated,
                         OutputFile.list_from(self.end.get("files", [])))


class Interpreter:
    """Owns every context (and so every worker process)."""

    def __init__(self, base_env: dict[str, str], python: str | None = None,
                 max_contexts: int = MAX_CONTEXTS) -> None:
        self.base_env = base_env  # the exec base env; /init updates it in place
        self.python = python or sys.executable or "python3"
        self.max_contexts = max_contexts
        self.contexts: dict[str, Context] = {}
        self.output_dir = outputs.OUTPUT_DIR  # result.files: what a run changed in it

    @property
    def running(self) -> int:
        return sum(1 for c in self.contexts.values() if c.run_ is not None)

    def list(self) -> list[ContextInfo]:
        return [c.info() for c in self.contexts.values()]

    async def create(self, req: CreateContextRequest) -> ContextInfo:
        name = req.name or f"ctx-{secrets.token_hex(6)}"
        if name in self.contexts:
            raise ContextExists(f"context {name!r} already exists")
        ctx = self._add(name, req.cwd, req.env)
        try:
            await ctx.start()
        except BaseException:
            self.contexts.pop(name, None)
            raise
        return ctx.info()

    async def delete(self, name: str) -> None:
        ctx = self.contexts.pop(name, None)
        if ctx is None:
            raise ContextNotFound(f"context {name!r} not found")
        ctx.deleted = True
        await ctx.stop()  # a run in flight ends with "exited"

    async def run(self, req: RunCodeRequest, emit: Emit) -> None:
        ctx = self.contexts.get(req.context)
        if ctx is None:
            if req.context != DEFAULT_CONTEXT:
                raise ContextNotFound(f"context {req.context!r} not found; create it first")
            ctx = self._add(DEFAULT_CONTEXT, None, {})
        before = await outputs.scan_async(self.output_dir)

        async def emit_with_files(event: dict[str, Any]) -> None:
            if event.get("type") == "end":  # the run is over: list what it wrote
                after = await outputs.scan_async(self.output_dir)
                event = {**event, "files": [f.to_dict() for f in outputs.changed(before, after)]}
            await emit(event)

        await ctx.run(req, emit_with_files)

    def _add(self, name: str, cwd: str | None, env: dict[str, str]) -> Context:
        if len(self.contexts) >= self.max_contexts:
            raise TooManyContexts(f"at most {self.max_contexts} contexts; delete one first")
        home = self.base_env.get("HOME", "/")
        cwd = cwd or (home if os.path.isdir(home) else "/")
        if not os.path.isdir(cwd):
            raise InvalidCwd(f"cwd is not a directory: {cwd}")
        full_env = {"MPLBACKEND": "Agg", **self.base_env, **env}
        ctx = self.contexts[name] = Context(name, cwd, full_env, self.python)
        return ctx

    def kill_all(self) -> None:
        for ctx in self.contexts.values():
            ctx.kill()

    async def aclose(self) -> None:
        contexts, self.contexts = list(self.contexts.values()), {}
        for ctx in contexts:
            await ctx.stop()
