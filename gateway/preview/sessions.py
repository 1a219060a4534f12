"""Sessions: long-lived, named sandboxes addressable by host (``{name}.{session_domain}``)
or path (``/v1/sessions/{name}/proxy/...``).

Theory of operation
-------------------
A session is a registry row (name, owner, sandbox, app port, start command)
pointing at an ordinary sandbox. It suspends when idle and wakes on a request
like any sandbox, with its processes' memory intact, and it outlives daemon
restarts because both rows are in the registry.

``PUT /v1/sessions/{name}`` is idempotent: the first call reserves the name (one
synchronous INSERT, so two racing calls cannot both win), creates the sandbox
in a task the session service owns (a client that disconnects does not leave a
half-made session; later calls wait for it), then starts ``start`` once as a
background command in the guest. The start is recorded ``starting`` before it
is sent and ``started`` (with its pid) after, and is never sent again: not on
wake (the process was suspended with the VM, not killed), not on restart. If the
session's sandbox is gone (deleted or failed to create), the next PUT makes a
new one and runs ``start`` in it.

Names are DNS labels and global, since hosts are global: another tenant's name
is a 409 ``session_name_taken``; to everyone else it does not exist.

With ``[cluster]`` on, ``fleet`` (gateway.cluster.session_names) holds names fleet-wide:
the name is reserved in etcd just before the INSERT (exactly one host wins a race), a
name another host holds for the same tenant raises ``SessionElsewhere`` (the routing
middleware forwards the request there), and a DELETE releases it. Off: ``fleet`` is None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from aiohttp import web

from gateway.http import wire
from gateway.http.sandbox_routes import json_response, read_json
from gateway.errors import (BadRequest, Conflict, NotFound, OwnerUnavailable, SandboxMoved,
                            SandboxNotFound)
from gateway.sandbox.states import State
from gateway.http.middleware import current_key
from gateway.preview.access import ACCESS_KEY, COOKIE, TOKEN_HEADER, require_previewable
from gateway.preview.proxy import PROXY_KEY, Target, deferred_expect
from gateway.store.registry import Registry
from gateway.sandbox import guest
from gateway.sandbox.service import SandboxService, parse_metadata
from guest.protocol import AGENT_PORT, CommandRequest

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_PREVIEW_LABEL = re.compile(r"\d+-[a-z0-9]+")


class SessionNotFound(NotFound):
    code = "session_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"session {name!r} not found")


class SessionNameTaken(Conflict):
    code = "session_name_taken"


class SessionElsewhere(SandboxMoved):
    """The name is held for this tenant by another fleet host: the routing middleware
    forwards the request there (as for a sandbox that moved)."""

    def __init__(self, name: str, host: str) -> None:
        OwnerUnavailable.__init__(self, f"session {name!r} is held by host {host!r}; retry",
                                  headers={"Retry-After": "1"})
        self.host = host


class FleetNames(Protocol):
    """gateway.cluster.session_names.SessionNames, as the session service sees it."""

    async def reserve(self, name: str, tenant: str) -> tuple[str, str] | None: ...

    async def bind(self, name: str, sandbox_id: str, **fields: Any) -> None: ...

    async def release(self, name: str, tenant: str) -> None: ...

    async def take_over(self, name: str, tenant: str | None,
                        tenant_of: Callable[[str], str | None], *,
                        wait: bool = True) -> dict[str, Any] | None: ...

    def sweep(self, rows: Mapping[str, tuple[str, str | None]],
              tenant_of: Callable[[str], str | None]) -> tuple[list[str], list[str]]: ...


@dataclass(frozen=True)
class SessionSpec:
    template: str | None = None
    port: int = 8000
    idle_timeout: float | None = None
    start: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Session:
    name: str
    tenant: str
    sandbox_id: str | None
    port: int
    start: str | None
    start_state: str  # none | starting | started | failed (never re-run in any state)
    start_pid: int | None
    start_error: str | None
    metadata: dict[str, Any]
    created_at: float
    updated_at: float


def validate_name(name: str, reserve_preview_labels: bool = False) -> str:
    if not NAME_RE.fullmatch(name) or (reserve_preview_labels and _PREVIEW_LABEL.fullmatch(name)):
        raise BadRequest(f"session name {name!r} must be a DNS label: 1-63 of a-z, 0-9 and '-', "
                         "not starting or ending with '-'", code="bad_session_name")
    return name


def validate_spec(body: Any) -> SessionSpec:
    req = wire.parse(wire.SessionSpec, body)
    if req.port == AGENT_PORT:
        raise BadRequest(f"port {AGENT_PORT} is the guest agent's and cannot be a session's "
                         "port", code="port_reserved")
    return SessionSpec(req.template, req.port, req.idle_timeout, req.start,
                       parse_metadata(req.metadata) or {})


class SessionService:
    def __init__(self, service: SandboxService, registry: Registry) -> None:
        self.service = service
        self.registry = registry
        server = service.config.server
        self.reserve_preview_labels = server.preview_domain == server.session_domain
        self._pending: dict[str, asyncio.Task] = {}
        self.fleet: FleetNames | None = None  # [cluster] on: names held fleet-wide

    # -- queries ---------------------------------------------------------------------

    def by_name(self, name: str) -> Session:
        """Any tenant's session (host routing; access is checked by the caller)."""
        row = self.registry.get_session(name)
        if row is None:
            raise SessionNotFound(name)
        return Session(**row)

    def get(self, tenant: str, name: str) -> Session:
        session = self.by_name(name)
        if session.tenant != tenant:
            raise SessionNotFound(name)
        return session

    async def find(self, tenant: str | None, name: str) -> Session:
        """``tenant``'s session (None: any tenant's), taken over from the fleet if its
        sandbox moved here from the host that holds its row (docs/cluster.md, "A session
        follows its sandbox"); a 503 while that sandbox is still arriving."""
        if self.registry.get_session(name) is None and self.fleet is not None:
            await self._take_over(name, tenant, wait=True)
        return self.by_name(name) if tenant is None else self.get(tenant, name)

    async def _take_over(self, name: str, tenant: str | None, *, wait: bool) -> bool:
        row = await self.fleet.take_over(name, tenant, self._tenant_of,  # type: ignore[union-attr]
                                         wait=wait)
        if row is None:
            return False
        self.registry.insert_session(row)  # False: made here meanwhile (that row stands)
        return True

    async def follow(self, every: float = 2.0) -> None:
        """[cluster] on: every ``every`` s, take over the sessions whose sandbox arrived
        here (adopted, migrated, handed over) and drop the rows of sessions another host
        took over with their sandbox, without waiting for a request."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.follow_once()
            except Exception as exc:  # etcd away: the next pass (or a request) retries
                log.warning("sessions: following moved sandboxes failed: %s", exc)

    async def follow_once(self) -> None:
        assert self.fleet is not None
        rows = {r["name"]: (r["tenant"], r["sandbox_id"])
                for r in self.registry.list_sessions(None)}
        take, drop = self.fleet.sweep(rows, self._tenant_of)
        for name in take:
            await self._take_over(name, None, wait=False)
        for name in drop:
            if name not in self._pending:
                log.info("session %s: held by another host with its sandbox: row dropped",
                         name)
                self.registry.delete_session(name)

    def _tenant_of(self, sandbox_id: str) -> str | None:
        rec = self.registry.get(sandbox_id)
        return rec.tenant if rec is not None and rec.state is not State.DESTROYED else None

    def list(self, tenant: str) -> list[Session]:
        return [Session(**row) for row in self.registry.list_sessions(tenant)]

    def sandbox_state(self, session: Session) -> State | None:
        rec = self.registry.get(session.sandbox_id) if session.sandbox_id else None
        return rec.state if rec else None

    # -- create / delete -------------------------------------------------------------

    async def ensure(self, tenant: str, name: str, spec: SessionSpec) -> tuple[Session, bool]:
        """The session ``name``, created with ``spec`` unless it exists. True if created."""
        validate_name(name, self.reserve_preview_labels)
        reserved = self.fleet is None
        while True:
            row = self.registry.get_session(name)
            if row is not None and row["tenant"] != tenant:
                raise SessionNameTaken(f"session name {name!r} is taken")
            pending = self._pending.get(name)
            if pending is not None:
                await asyncio.shield(pending)
                return self.get(tenant, name), False
            if row is None and not reserved:
                assert self.fleet is not None
                if await self._take_over(name, tenant, wait=False):
                    continue  # its sandbox moved here: the session is this host's now
                holder = await self.fleet.reserve(name, tenant)  # before the INSERT
                if holder is not None:
                    if holder[0] != tenant:
                        raise SessionNameTaken(f"session name {name!r} is taken")
                    raise SessionElsewhere(name, holder[1])
                reserved = True
                continue  # the registry may have changed while etcd answered
            if row is None:
                now = time.time()
                if not self.registry.insert_session({
                        "name": name, "tenant": tenant, "port": spec.port, "start": spec.start,
                        "metadata": spec.metadata, "created_at": now, "updated_at": now}):
                    continue  # lost a race for the name: look again
            elif self.sandbox_state(Session(**row)) not in (None, State.DESTROYED):
                return Session(**row), False
            else:  # its sandbox is gone: make a new one under the same name
                self.registry.update_session(name, sandbox_id=None, port=spec.port,
                                             start=spec.start, metadata=spec.metadata,
                                             start_state="none", start_pid=None,
                                             start_error=None)
            task = self.service.spawn(self._create(tenant, name, spec), f"session-{name}")
            self._pending[name] = task
            task.add_done_callback(lambda _t, n=name: self._pending.pop(n, None))
            await asyncio.shield(task)
            return self.get(tenant, name), True

    async def _create(self, tenant: str, name: str, spec: SessionSpec) -> None:
        try:
            rec = await self.service.create(tenant, spec.template, spec.metadata,
                                            spec.idle_timeout)
        except BaseException:
            self.registry.delete_session(name)  # release the name; the error goes to the caller
            if self.fleet is not None:
                with contextlib.suppress(Exception):
                    await self.fleet.release(name, tenant)
            raise
        self.registry.update_session(name, sandbox_id=rec.id)
        if self.fleet is not None:
            await self.fleet.bind(name, rec.id, port=spec.port, start=spec.start,
                                  start_state="none", start_pid=None)
        if spec.start:
            await self._start(tenant, name, rec.id, spec.start)

    async def _start(self, tenant: str, name: str, sandbox_id: str, command: str) -> None:
        await self._start_state(name, sandbox_id, start_state="starting")
        try:
            async with self.service.use(tenant, sandbox_id) as machine:
                started = await guest.start_command(
                    machine, CommandRequest(command=command, background=True))
        except Exception as exc:
            log.warning("session %s: start command failed: %s", name, exc)
            await self._start_state(name, sandbox_id, start_state="failed",
                                    start_error=str(exc))
        else:
            await self._start_state(name, sandbox_id, start_state="started",
                                    start_pid=started.pid)

    async def _start_state(self, name: str, sandbox_id: str, **state: Any) -> None:
        """The start's state in the row and (a takeover reads it there) the fleet record:
        recorded ``starting`` before the command is sent, so it is never sent twice."""
        self.registry.update_session(name, **state)
        if self.fleet is not None:
            await self.fleet.bind(name, sandbox_id, start_state=state["start_state"],
                                  start_pid=state.get("start_pid"))

    async def delete(self, tenant: str, name: str) -> None:
        session = await self.find(tenant, name)
        pending = self._pending.get(name)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
            session = self.get(tenant, name)
        if session.sandbox_id:
            with contextlib.suppress(SandboxNotFound):
                await self.service.destroy(tenant, session.sandbox_id)
        if self.fleet is not None:  # 503 when etcd does not answer: the row stays to retry
            await self.fleet.release(name, tenant)
        self.registry.delete_session(name)

    async def aclose(self) -> None:
        """Creations in flight are owned by the sandbox service's tasks (it closes them)."""
        self._pending.clear()


SESSIONS_KEY = web.AppKey("sessions", SessionService)
FLEET_NAMES_KEY = web.AppKey("session_fleet_names", object)  # [cluster] on: a FleetNames

# -- API -----------------------------------------------------------------------------------

routes = web.RouteTableDef()


def _sessions(request: web.Request) -> SessionService:
    return request.config_dict[SESSIONS_KEY]


def session_view(request: web.Request, session: Session) -> wire.Session:
    from gateway.http.info import SERVER_KEY, url_templates

    state = _sessions(request).sandbox_state(session)
    template = url_templates(request.config_dict[SERVER_KEY])[1]
    token = (request.config_dict[ACCESS_KEY].get(session.sandbox_id).token
             if session.sandbox_id else None)
    return wire.Session(
        name=session.name, sandbox_id=session.sandbox_id,
        state=state.value if state else "creating", port=session.port,
        start=session.start, start_state=session.start_state,  # type: ignore[arg-type]
        start_pid=session.start_pid, start_error=session.start_error,
        metadata=session.metadata, created_at=session.created_at,
        url=template.replace("{name}", session.name),
        proxy_path=f"/v1/sessions/{session.name}/proxy/", preview_token=token)


@routes.put("/v1/sessions/{name}")
async def put_session(request: web.Request) -> web.Response:
    spec = validate_spec(await read_json(request))
    session, created = await _sessions(request).ensure(
        current_key(request).id, request.match_info["name"], spec)
    return json_response(session_view(request, session), status=201 if created else 200)


@routes.get("/v1/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    found = _sessions(request).list(current_key(request).id)
    return json_response(wire.SessionList(sessions=[session_view(request, s) for s in found]))


@routes.get("/v1/sessions/{name}")
async def get_session(request: web.Request) -> web.Response:
    session = await _sessions(request).find(current_key(request).id,
                                            request.match_info["name"])
    return json_response(session_view(request, session))


@routes.delete("/v1/sessions/{name}")
async def delete_session(request: web.Request) -> web.Response:
    await _sessions(request).delete(current_key(request).id, request.match_info["name"])
    return web.Response(status=204)


@routes.route("*", "/v1/sessions/{name}/proxy", expect_handler=deferred_expect)
@routes.route("*", "/v1/sessions/{name}/proxy/{path:.*}", expect_handler=deferred_expect)
async def proxy_session(request: web.Request) -> web.StreamResponse:
    """The session's app under an API path (API-key auth; the key never reaches the app)."""
    tenant = current_key(request).id
    session = await _sessions(request).find(tenant, request.match_info["name"])
    if not session.sandbox_id:
        raise NotFound(f"session {session.name!r} has no sandbox yet", code="session_not_ready")
    require_previewable(session.port)  # also for a row written before the PUT refused it
    prefix = f"/v1/sessions/{session.name}/proxy"
    raw = request.raw_path
    rest = raw[len(prefix):] if raw.startswith(prefix) else "/" + request.match_info.get("path", "")
    target = Target(tenant, session.sandbox_id, session.port,
                    rest if rest.startswith("/") else "/" + rest,
                    drop_headers=frozenset({"authorization", TOKEN_HEADER.lower()}),
                    drop_cookie=COOKIE)
    return await request.config_dict[PROXY_KEY].handle(request, target)
