"""``AsyncSandbox``: one microVM sandbox, used from asyncio.

Made by :meth:`AsyncSandbox.create` / :meth:`AsyncAgentBox.create` (a new sandbox) or
:meth:`AsyncSandbox.connect` (an existing one). As a context manager it kills the
sandbox on exit, unless it was created with ``keep=True`` or connected to.
A sandbox that went to sleep (suspended when idle) needs no special call: the
server wakes it for the next request. Callbacks may be plain functions or, in the
asyncio SDK, coroutine functions.
"""
# The source of agentbox/sandbox.py (the sync twin), which  # unasync: drop
# sdk/python/gen_sync.py generates from it: edit this file, then run that.  # unasync: drop

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox import _calls, _common
from agentbox._streams import ExecutionBuilder, maybe_await, notify
from agentbox.async_commands import AsyncCommands
from agentbox.exceptions import AgentBoxError, SandboxNotFoundError
from agentbox.async_files import AsyncFiles
from agentbox.models import (
    CodeContext,
    Execution,
    ExecResult,
    FileInfo,
    PreviewAccess,
    SandboxInfo,
    SandboxLogs,
    SandboxMetrics,
    Template,
)

if TYPE_CHECKING:
    from agentbox.async_client import AsyncAgentBox

Callback = Callable[[Any], Any]


class AsyncSandbox:
    def __init__(self, client: AsyncAgentBox, info: SandboxInfo, *, owns_client: bool = False,
                 keep: bool = False, connected: bool = False) -> None:
        self._client, self._t = client, client._transport
        self.info = info
        self._owns_client, self._keep = owns_client, keep or connected
        self.files = AsyncFiles(info.id, self._t)
        self.commands = AsyncCommands(info.id, self._t)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state} template={self.info.template}>"

    @property
    def id(self) -> str:
        return self.info.id

    sandbox_id = id

    @property
    def state(self) -> str:
        """The state when last fetched (``get_info()`` refreshes it)."""
        return self.info.state

    # -- making one ------------------------------------------------------------------------------

    @classmethod
    async def create(cls, template: str | None = _common.DEFAULT_TEMPLATE, *,
                     environment: str | None = None, idle_timeout: float | None = None,
                     metadata: dict[str, Any] | None = None, keep: bool = False,
                     vcpus: int | None = None, memory_mib: int | None = None,
                     disk_mib: int | None = None,
                     api_key: str | None = None, base_url: str | None = None,
                     timeout: float | None = None, ttl: float | None = None,
                     auto_delete_after: float | None = None,
                     egress: str | dict[str, Any] | None = None) -> AsyncSandbox:
        """Create a sandbox from ``template`` (alias ``environment``). ``idle_timeout``:
        seconds without activity before it is suspended (0 = never; None = the server's
        default). ``keep=True``: leaving a ``with`` block does not kill it. ``egress``:
        ``"deny_all"``, ``"allow_all"`` or ``{"default", "allow", "deny"}`` (docs/api.md).
        ``vcpus``, ``memory_mib``, ``disk_mib``: its shape (None = the template's; the
        server's limits apply, and the first sandbox of a new vCPU/memory shape waits for
        its snapshot)."""
        from agentbox.async_client import AsyncAgentBox

        client = AsyncAgentBox(api_key=api_key, base_url=base_url, timeout=timeout)
        try:
            sandbox = await client.create(template, environment=environment,
                                          idle_timeout=idle_timeout, metadata=metadata,
                                          keep=keep, ttl=ttl,
                                          auto_delete_after=auto_delete_after, egress=egress,
                                          vcpus=vcpus, memory_mib=memory_mib, disk_mib=disk_mib)
        except BaseException:
            await client.aclose()
            raise
        sandbox._owns_client = True
        return sandbox

    @classmethod
    async def connect(cls, sandbox_id: str, *, api_key: str | None = None,
                      base_url: str | None = None,
                      timeout: float | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox (never killed by leaving a ``with`` block)."""
        from agentbox.async_client import AsyncAgentBox

        client = AsyncAgentBox(api_key=api_key, base_url=base_url, timeout=timeout)
        try:
            sandbox = await client.connect(sandbox_id)
        except BaseException:
            await client.aclose()
            raise
        sandbox._owns_client = True
        return sandbox

    @classmethod
    async def list(cls, *, api_key: str | None = None,
                   base_url: str | None = None) -> list[SandboxInfo]:
        from agentbox.async_client import AsyncAgentBox

        async with AsyncAgentBox(api_key=api_key, base_url=base_url) as client:
            return await client.list()

    # -- running code ----------------------------------------------------------------------------

    async def execute(self, code: str | None = None, *, command: str | None = None,
                      language: str | None = None, timeout: float | None = None,
                      env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """Run ``code`` (Python unless ``language`` is "bash"/"sh") or a shell ``command``
        in a fresh process, and wait for it. ``timeout`` (seconds, default 60) kills it."""
        language = language or ("python" if code is not None else None)
        call = _calls.execute(self.id, code, command, language, timeout, env,
                              None if cwd is None else _calls.sandbox_path(cwd))
        return ExecResult.from_dict(await self._t.json(call), language=language)

    async def run_code(self, code: str, language: str = "python",
                       context: str | CodeContext | None = None, *,
                       on_stdout: Callback | None = None, on_stderr: Callback | None = None,
                       on_result: Callback | None = None, on_error: Callback | None = None,
                       timeout: float | None = None,
                       env: dict[str, str] | None = None) -> Execution:
        """Run ``code`` in a stateful interpreter context (variables and imports persist
        between runs; ``context`` None = the default one). Returns its :class:`Execution`
        (stdout, stderr, rich ``results`` such as charts, and ``error``). With callbacks,
        output is streamed to them as it happens."""
        callbacks = _common.run_callbacks(on_stdout, on_stderr, on_result, on_error)
        stream = any(callbacks.values())
        call = _calls.run_code(self.id, code, language, _common.context_name(context), timeout,
                               env, stream)
        if not stream:
            return Execution.from_dict(await self._t.json(call))
        builder = ExecutionBuilder()
        async with contextlib.aclosing(self._t.events(call)) as events:
            async for event in events:
                await maybe_await(notify(callbacks, builder.feed(event)))
        return builder.finish()

    async def create_code_context(self, name: str | None = None, *, cwd: str | None = None,
                                  env: dict[str, str] | None = None) -> CodeContext:
        call = _calls.create_context(self.id, name, cwd, env)
        return CodeContext.from_dict(await self._t.json(call))

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        data = await self._t.json(_calls.list_contexts(self.id))
        return [CodeContext.from_dict(c) for c in data.get("contexts", [])]

    async def remove_code_context(self, context: str | CodeContext) -> None:
        await self._t.send(_calls.delete_context(self.id, _common.context_name(context) or ""))

    # -- files -----------------------------------------------------------------------------------

    async def upload(self, path: str, data: Any, *,
                     on_progress: Callable[[int, int | None], Any] | None = None) -> FileInfo:
        """Write ``data`` (str, bytes, an open binary file, a local ``Path``, or an iterable
        of bytes) to ``path`` in the sandbox, streamed. A relative ``path`` lands under
        ``/input/``: ``upload("data.csv", b)`` is read as ``/input/data.csv``."""
        return await self.files.write(_calls.under(_calls.INPUT_DIR, path), data,
                                      on_progress=on_progress)

    async def download(self, path: str, dest: str | Path | None = None, *,
                       on_progress: Callable[[int, int | None], Any] | None = None) -> Any:
        """The file's bytes; or, with ``dest``, stream it into that local file and return
        its ``Path``. A relative ``path`` is read from ``/output/`` (as ``result.files``
        name them, absolute, either works)."""
        path = _calls.under(_calls.OUTPUT_DIR, path)
        if dest is None:
            return await self.files.read(path, format="bytes")
        return await self.files.download(path, dest, on_progress=on_progress)

    # -- addressing ------------------------------------------------------------------------------

    async def get_url(self, port: int, with_token: bool = False) -> str:
        """The URL where the gateway serves ``port`` of this sandbox (waking it if needed).
        Ports are private unless made public: ``with_token=True`` appends ``?token=``, which
        a browser trades for a cookie on its first visit (programs can instead send the
        header ``X-AgentBox-Token: {preview_token}``)."""
        url = _common.preview_url(await self._client.server_info(),
                                  self._t.config.base_url, self.id, port)
        return _common.with_token(url, await self.preview_token) if with_token else url

    # -- preview access --------------------------------------------------------------------------

    async def get_preview(self) -> PreviewAccess:
        """The preview token and public ports (``GET .../preview``)."""
        return PreviewAccess.from_dict(await self._t.json(_calls.get_preview(self.id)))

    @property
    async def preview_token(self) -> str:
        """The token that opens this sandbox's private ports (``await
        sandbox.preview_token``; fetched on each access)."""
        return (await self.get_preview()).preview_token

    async def rotate_preview_token(self) -> str:
        """A new preview token; the old one, and links and cookies made with it, stop working."""
        data = await self._t.json(_calls.rotate_preview_token(self.id))
        return PreviewAccess.from_dict(data).preview_token

    async def set_public_ports(self, ports: builtins.list[int]) -> PreviewAccess:
        """Serve these ports without a token (replaces the list; ``[]`` = all private)."""
        data = await self._t.json(_calls.set_public_ports(self.id, ports))
        return PreviewAccess.from_dict(data)

    async def get_host(self, port: int) -> str:
        """``{port}-{id}.{domain}`` (host and port of :meth:`get_url`, without scheme)."""
        return _common.host_of(await self.get_url(port))

    def terminal_url(self) -> str:
        """The WebSocket URL of this sandbox's terminal."""
        return _common.ws_url(self._t.config.base_url, _calls.terminal_path(self.id))

    # -- lifecycle -------------------------------------------------------------------------------

    async def get_info(self) -> SandboxInfo:
        self.info = SandboxInfo.from_dict(await self._t.json(_calls.get_sandbox(self.id)))
        return self.info

    async def is_running(self) -> bool:
        return (await self.get_info()).state == "running"

    async def suspend(self) -> SandboxInfo:
        """Snapshot the sandbox to disk and stop its VM (it costs no RAM until resumed)."""
        self.info = SandboxInfo.from_dict(await self._t.json(_calls.suspend_sandbox(self.id)))
        return self.info

    pause = suspend

    async def snapshot(self, template: str) -> Template:
        """Save this sandbox (memory, running processes, files) as the key's template
        ``template``; ``create(template)`` then starts sandboxes in that state. The
        sandbox keeps running (paused only while it is copied)."""
        return Template.from_dict(await self._t.json(_calls.snapshot_sandbox(self.id,
                                                                             template)))

    async def fork(self, n: int = 1, *, keep: bool = False) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes in this one's current state (files, processes, interpreter
        variables); each then goes its own way. ``keep``: as for ``create``."""
        data = await self._t.json(_calls.fork_sandbox(self.id, n))
        return [AsyncSandbox(self._client, SandboxInfo.from_dict(s), keep=keep)
                for s in (data or {}).get("sandboxes", [])]

    async def resume(self) -> SandboxInfo:
        self.info = SandboxInfo.from_dict(await self._t.json(_calls.resume_sandbox(self.id)))
        return self.info

    async def set_idle_timeout(self, seconds: float) -> SandboxInfo:
        """Suspend after this many idle seconds (0 = never)."""
        return await self.update(idle_timeout=seconds)

    async def set_egress(self, egress: str | dict[str, Any]) -> SandboxInfo:
        """Replace the egress policy; it applies at once, to the running guest too."""
        return await self.update(egress=egress)

    async def update(self, *, idle_timeout: float | None = None,
                     metadata: dict[str, Any] | None = None,
                     public_ports: builtins.list[int] | None = None,
                     ttl: float | None = None,
                     auto_delete_after: float | None = None,
                     egress: str | dict[str, Any] | None = None) -> SandboxInfo:
        """Change its settings; ``ttl`` counts from now (extend it; 0 = no deadline);
        ``egress`` applies at once, also to a running guest."""
        call = _calls.update_sandbox(self.id, idle_timeout, metadata, public_ports, ttl,
                                     auto_delete_after, egress)
        self.info = SandboxInfo.from_dict(await self._t.json(call))
        return self.info

    async def set_ttl(self, seconds: float) -> SandboxInfo:
        """Destroy it ``seconds`` from now (0 = never)."""
        return await self.update(ttl=seconds)

    async def metrics(self) -> SandboxMetrics:
        """CPU seconds and memory of its VM, and its disk use, read on the host (a
        suspended sandbox is not woken)."""
        return SandboxMetrics.from_dict(await self._t.json(_calls.sandbox_metrics(self.id)))

    async def logs(self, tail: int | None = None) -> SandboxLogs:
        """The last ``tail`` lines of its console (default 200) and its state changes."""
        return SandboxLogs.from_dict(await self._t.json(_calls.sandbox_logs(self.id, tail)))

    async def kill(self) -> bool:
        """Destroy the sandbox; False if it was already gone."""
        try:
            await self._t.send(_calls.delete_sandbox(self.id))
        except SandboxNotFoundError:
            return False
        return True

    async def aclose(self) -> None:
        """Release the HTTP connections (when this sandbox made its own client)."""
        if self._owns_client:
            await self._client.aclose()

    close = aclose  # unasync: drop

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if not self._keep:
                await self.kill()
        except AgentBoxError:
            if not _common.suppress_on_unwind(exc_type):
                raise
        finally:
            await self.aclose()
