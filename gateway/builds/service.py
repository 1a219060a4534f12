"""Template builds from a Dockerfile: the build record, its log, the layer cache, the runner.

Theory of operation
-------------------
``BuildService.start`` parses the Dockerfile (images.dockerfile; errors are a 400 with the
line) and records a ``Build`` (state QUEUED); one owned task per build runs it, one build
at a time per daemon (builds are CPU-heavy under TCG). The runner walks the recipe's steps:
each step has a cache key (images.dockerfile.step_key, chained from the FROM template's
golden and the tenant); its layer is ``DATA_DIR/build-cache/<key>.qcow2``, a qcow2 overlay
over its parent's layer. A step whose layer exists is a cache hit and costs nothing; the
first miss boots a builder VM (gateway.builds.builder_vm) over the parent layer, runs the step,
syncs, and freezes the VM's disk as the new layer. After the last step the final VM boots
over the last layer, starts the start command, waits for readiness, and is snapshotted as a
golden (``build-cache/golden-<final key>``); that too is cached. The golden is then
registered as the tenant's template through ``register`` (the template catalog).

The log is a bounded list of events (dicts, streamed as NDJSON by gateway.http.build_routes):
``step`` (n, of, text, cached), ``output`` (a step's stdout/stderr tail), ``step_done``
(seconds), ``error`` (message, exit_code) and a final ``done`` (state, template).
"""

from __future__ import annotations

import asyncio
import enum
import io
import logging
import os
import secrets
import shlex
import shutil
import tarfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.builds import layer_cache, builder_vm
from gateway.http import wire
from gateway.builds.builder_vm import BootFiles, BuilderVM
from gateway.errors import ApiError, BadRequest, Conflict, NotFound, Unavailable
from guest.protocol import DEFAULT_CONTEXT, CreateContextRequest, ExecRequest, InitRequest
from images import dockerfile as df
from vmctl import agent_interp, store
from vmctl.backend import Backend
from vmctl.golden import Golden

log = logging.getLogger(__name__)

MAX_LOG_EVENTS = 2000
MAX_OUTPUT_CHARS = 16 * 1024
MAX_BUILDS_KEPT = 200
GUEST_CA = "/tmp/.agentbox-build-ca.pem"
GUEST_TAR = "/tmp/.agentbox-copy.tar"


class BuildState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    READY = "ready"
    FAILED = "failed"


TRANSITIONS: dict[BuildState, frozenset[BuildState]] = {
    BuildState.QUEUED: frozenset({BuildState.RUNNING, BuildState.FAILED}),
    BuildState.RUNNING: frozenset({BuildState.READY, BuildState.FAILED}),
    BuildState.READY: frozenset(), BuildState.FAILED: frozenset(),
}


class StepFailed(Exception):
    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Build:
    id: str
    tenant: str
    name: str
    recipe: df.Recipe
    state: BuildState = BuildState.QUEUED
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    step: int = 0
    cached_steps: int = 0
    error: str | None = None
    template: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __repr__(self) -> str:
        return f"<Build {self.id} {self.name} {self.state.name}>"

    def to(self, state: BuildState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"build {self.id}: {self.state.name} -> {state.name}")
        self.state = state
        if state in (BuildState.READY, BuildState.FAILED):
            self.finished_at = time.time()

    def emit(self, kind: str, **data: Any) -> None:
        event = {"type": kind, "t": round(time.time() - self.created_at, 2), **data}
        if len(self.events) >= MAX_LOG_EVENTS:  # keep the first and the newest
            del self.events[MAX_LOG_EVENTS // 2]
            self.dropped += 1
        self.events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()

    def view(self) -> wire.Build:
        return wire.Build(id=self.id, name=self.name,
                          state=self.state.value,  # type: ignore[arg-type]
                          created_at=self.created_at, finished_at=self.finished_at,
                          step=self.step, steps=len(self.recipe.steps) + 1,
                          cached_steps=self.cached_steps, error=self.error,
                          template=self.template)

    async def follow(self) -> AsyncIterator[dict[str, Any]]:
        """Every event so far, then new ones as they come, until the build ends."""
        sent = 0
        while True:
            changed = self._changed
            start = max(0, sent - self.dropped)
            for event in self.events[start:]:
                yield event
            sent = self.dropped + len(self.events)
            if self.state in (BuildState.READY, BuildState.FAILED):
                return
            await changed.wait()


# (tenant, name, the built golden, the FROM golden its disk chain stands on) -> the template
Register = Callable[[str, str, Path, Path], dict[str, Any]]
Resolve = Callable[[str, str], Golden]


class BuildService:
    """Owns every build's task; ``aclose`` cancels them (their VMs are cleaned up)."""

    def __init__(self, backend: Backend, cache_dir: Path, resolve: Resolve, register: Register,
                 *, hosts: tuple[str, ...], ca_bundle: str = "", step_timeout: float = 1800,
                 build_timeout: float = 3600, cache_max_bytes: int = 0) -> None:
        self.backend, self.cache = backend, cache_dir
        self.cache_max_bytes = cache_max_bytes  # 0: unbounded (gateway.builds.layer_cache)
        self.resolve, self.register = resolve, register
        self.hosts, self.ca_bundle = hosts, ca_bundle
        self.step_timeout, self.build_timeout = step_timeout, build_timeout
        self.builds: dict[str, Build] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._one_at_a_time = asyncio.Semaphore(1)
        self._remove_leftovers()
        self._collect()

    def _collect(self) -> None:
        """Bound the layer cache (no build may run: at start-up, or under the lock)."""
        if not self.cache_max_bytes:
            return
        try:
            layer_cache.collect(self.cache, self.cache.parent / "templates",
                                self.cache_max_bytes)
        except OSError:
            log.exception("bounding the build cache failed (the next build retries)")

    def _remove_leftovers(self) -> None:
        """Work dirs and uploaded contexts a crashed daemon left (no build runs yet)."""
        stale = [*self.cache.glob(".work-*"), *self.cache.glob(".golden-*")]
        contexts = self.cache.parent / "build-contexts"
        stale += list(contexts.iterdir()) if contexts.is_dir() else []
        for path in stale:
            log.warning("removing a leftover of an interrupted build: %s", path)
            shutil.rmtree(path, ignore_errors=True)

    def start(self, tenant: str, name: str, dockerfile: str, context: Path,
              cleanup: Callable[[], None] = lambda: None) -> Build:
        if self.backend.driver_name != "qemu":  # layers are qcow2 overlays
            raise Unavailable("template builds need the QEMU backend on this host for now",
                              code="builds_unavailable")
        try:
            recipe = df.parse(dockerfile)
        except df.DockerfileError as exc:
            raise BadRequest(f"Dockerfile {exc}", code="bad_dockerfile") from None
        if any(b.tenant == tenant and b.name == name and b.state in
               (BuildState.QUEUED, BuildState.RUNNING) for b in self.builds.values()):
            raise Conflict(f"template {name!r} is already being built", code="build_running")
        build = Build(id="bld_" + secrets.token_hex(8), tenant=tenant, name=name, recipe=recipe)
        self._forget_old()
        self.builds[build.id] = build
        task = asyncio.create_task(self._run(build, context, cleanup), name=f"build-{build.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return build

    def get(self, tenant: str, build_id: str) -> Build:
        build = self.builds.get(build_id)
        if build is None or build.tenant != tenant:
            raise NotFound(f"build {build_id!r} not found", code="build_not_found")
        return build

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)

    def _forget_old(self) -> None:
        done = [b for b in self.builds.values() if b.finished_at is not None]
        for b in sorted(done, key=lambda b: b.created_at)[:max(0, len(self.builds) -
                                                                 MAX_BUILDS_KEPT + 1)]:
            del self.builds[b.id]

    async def _run(self, build: Build, context: Path, cleanup: Callable[[], None]) -> None:
        try:
            build.emit("queued")
            async with self._one_at_a_time:
                build.to(BuildState.RUNNING)
                try:
                    await asyncio.wait_for(self._steps(build, context), self.build_timeout)
                finally:
                    await asyncio.shield(asyncio.to_thread(self._collect))
            build.to(BuildState.READY)
            build.emit("done", state="ready", template=build.template)
        except BaseException as exc:
            build.error = _message(exc)
            build.emit("error", step=build.step, message=build.error,
                       exit_code=getattr(exc, "exit_code", None))
            build.to(BuildState.FAILED)
            build.emit("done", state="failed", error=build.error)
            if not isinstance(exc, Exception):
                raise  # cancelled: the daemon is stopping
            if not isinstance(exc, (StepFailed, df.DockerfileError, ApiError)):
                log.exception("build %s failed", build.id)
        finally:
            cleanup()

    async def _steps(self, build: Build, context: Path) -> None:
        recipe = build.recipe
        base = self.resolve(build.tenant, recipe.base)
        boot = BootFiles(base.kernel, base.initrd, base.cmdline, base.mem_mib, base.vcpus)
        key = df.base_key(f"{build.tenant}\0{base.dir}")
        disk = base.snapshot.disk
        total = len(recipe.steps) + 1
        self.cache.mkdir(parents=True, exist_ok=True)
        for n, step in enumerate(recipe.steps, 1):
            build.step = n
            files = df.context_files(context, step.sources) if step.sources else []
            key = df.step_key(key, step, df.context_digest(files) if files else "")
            layer = self.cache / f"{key}.qcow2"
            cached = layer.is_file()
            if cached:
                layer_cache.touch(layer)  # its last use: the cache evicts oldest first
            build.cached_steps += cached
            build.emit("step", n=n, of=total, line=step.line, text=step.text[:500],
                       cached=cached, key=key[:16])
            if not cached:
                started = time.monotonic()
                await self._run_step(build, boot, disk, layer, step, files)
                build.emit("step_done", n=n, seconds=builder_vm.elapsed(started))
            disk = layer
        build.step = total
        fkey = df.final_key(key, recipe, boot.mem_mib, boot.vcpus)
        golden = self.cache / f"golden-{fkey}"
        cached = (golden / store.MANIFEST).is_file()
        if cached:
            layer_cache.touch(golden)
        build.cached_steps += cached
        build.emit("step", n=total, of=total, text="start + readiness + snapshot", cached=cached,
                   key=fkey[:16])
        if not cached:
            started = time.monotonic()
            await self._make_golden(build, boot, disk, golden)
            build.emit("step_done", n=total, seconds=builder_vm.elapsed(started))
        build.template = self.register(build.tenant, build.name, golden, base.dir)

    async def _run_step(self, build: Build, boot: BootFiles, parent: Path, layer: Path,
                        step: df.Step, files: list[tuple[str, Path]]) -> None:
        work = self.cache / f".work-{secrets.token_hex(6)}"
        try:
            async with builder_vm.builder_vm(self.backend, boot, parent, work,
                                             self.hosts) as vm:
                env = await self._build_env(vm)
                if step.kind is df.StepKind.COPY:
                    await self._copy(vm, step, files)
                else:
                    await self._exec(build, vm, step, env)
                await vm.agent.execute(ExecRequest(command=f"rm -f {GUEST_CA} {GUEST_TAR}; sync",
                                                   timeout=120))
            await asyncio.to_thread(builder_vm.freeze, work / "disk.qcow2", layer)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def _build_env(self, vm: BuilderVM) -> dict[str, str]:
        env = {name: vm.proxy_url for name in ("http_proxy", "https_proxy", "HTTP_PROXY",
                                                "HTTPS_PROXY", "npm_config_proxy",
                                                "npm_config_https_proxy")}
        env |= {"PIP_BREAK_SYSTEM_PACKAGES": "1", "DEBIAN_FRONTEND": "noninteractive",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
        if self.ca_bundle and Path(self.ca_bundle).is_file():
            data = await asyncio.to_thread(Path(self.ca_bundle).read_bytes)
            await vm.agent.write_file(GUEST_CA, _chunks(data), size=len(data))
            env |= {name: GUEST_CA for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
                                                 "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                                                 "npm_config_cafile")}
        return env

    async def _exec(self, build: Build, vm: BuilderVM, step: df.Step,
                    env: dict[str, str]) -> None:
        st = step.state
        script = f"mkdir -p {shlex.quote(st.workdir)} && cd {shlex.quote(st.workdir)} && " \
                 f"{step.command}"
        res = await vm.agent.execute(ExecRequest(
            command=as_user(st.user, script), env=st.env_dict() | env,
            timeout=self.step_timeout))
        for stream in ("stdout", "stderr"):
            text = getattr(res, stream)
            if text:
                build.emit("output", n=build.step, stream=stream,
                           text=text[-MAX_OUTPUT_CHARS:])
        if res.timed_out:
            raise StepFailed(f"step {build.step} (line {step.line}) timed out after "
                             f"{self.step_timeout:g}s", res.exit_code)
        if res.exit_code != 0:
            raise StepFailed(f"step {build.step} (line {step.line}) `{step.text[:200]}` "
                             f"exited with code {res.exit_code}", res.exit_code)

    async def _copy(self, vm: BuilderVM, step: df.Step, files: list[tuple[str, Path]]) -> None:
        to_file = len(files) == 1 and not step.dest.endswith("/") and len(step.sources) == 1 \
            and not Path(step.sources[0]).name == "." and files[0][1].name == \
            Path(step.sources[0]).name
        target = step.dest.rstrip("/") or "/"
        data = await asyncio.to_thread(_tar, files, step.chown,
                                       Path(target).name if to_file else None)
        await vm.agent.write_file(GUEST_TAR, _chunks(data), size=len(data))
        into = str(Path(target).parent) if to_file else target
        res = await vm.agent.execute(ExecRequest(
            command=f"mkdir -p {shlex.quote(into)} && tar -xf {GUEST_TAR} -C {shlex.quote(into)}"
                    f" && rm -f {GUEST_TAR}", timeout=300))
        if res.exit_code != 0:
            raise StepFailed(f"COPY (line {step.line}) failed: {res.stderr[-2000:]}",
                             res.exit_code)

    async def _make_golden(self, build: Build, boot: BootFiles, parent: Path,
                           final: Path) -> None:
        tmp = self.cache / f".golden-{secrets.token_hex(6)}"
        try:
            async with builder_vm.builder_vm(self.backend, boot, parent, tmp, ()) as vm:
                await self._start_and_wait(build, vm)
                # ENV also holds for every exec and interpreter of the template's sandboxes:
                # the agent's base env is in the snapshot's memory.
                await vm.agent.init(InitRequest(time_ns=time.time_ns(),
                                                env=build.recipe.final.env_dict()))
                await agent_interp.create_context(vm.agent,
                                                  CreateContextRequest(name=DEFAULT_CONTEXT))
                await vm.agent.execute(ExecRequest(command="sync", timeout=120))
                snap = await vm.driver.snapshot(tmp)
            await asyncio.to_thread(_seal, snap, build, boot, tmp, final)
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)

    async def _start_and_wait(self, build: Build, vm: BuilderVM) -> None:
        recipe = build.recipe
        st = recipe.final
        if recipe.start:
            cmd = (f"mkdir -p {shlex.quote(st.workdir)} && cd {shlex.quote(st.workdir)} && "
                   f"exec {shlex.join(recipe.start)}")
            launch = (f"setsid -f {as_user(st.user, cmd)} "
                      f"> /var/log/agentbox-start.log 2>&1 < /dev/null")
            res = await vm.agent.execute(ExecRequest(command=launch, env=st.env_dict(),
                                                     timeout=60))
            if res.exit_code != 0:
                raise StepFailed(f"the start command did not launch: {res.stderr[-2000:]}",
                                 res.exit_code)
            build.emit("output", n=build.step, stream="stdout",
                       text=f"started: {shlex.join(recipe.start)}\n")
        if recipe.ready is None:
            return
        ready = recipe.ready
        res = await vm.agent.execute(ExecRequest(code=ready_probe(ready),
                                                 timeout=ready.timeout + 10))
        if res.exit_code != 0:
            tail = await vm.agent.execute(ExecRequest(
                command="tail -c 4000 /var/log/agentbox-start.log", timeout=30))
            raise StepFailed(f"readiness check ({ready.kind}) failed after {ready.timeout:g}s: "
                             f"{res.stdout[-500:]}{res.stderr[-500:]}\nstart command log:\n"
                             f"{tail.stdout}", res.exit_code)
        build.emit("output", n=build.step, stream="stdout", text=res.stdout[-2000:])


def ready_probe(ready: df.Ready) -> str:
    """Python run in the guest: exit 0 once the readiness check passes, 1 at its timeout."""
    return f"""
import socket, subprocess, sys, time, urllib.error, urllib.request
kind, port, path, command, deadline = {ready.kind!r}, {ready.port}, {ready.path!r}, \\
    {ready.command!r}, time.monotonic() + {ready.timeout}
last = ''
while time.monotonic() < deadline:
    try:
        if kind == 'http':
            try:
                url = f'http://127.0.0.1:{{port}}{{path}}'
                code = urllib.request.urlopen(url, timeout=5).status
            except urllib.error.HTTPError as e:
                code = e.code
            if code < 500:
                print(f'ready: http {{port}}{{path}} answered {{code}}'); sys.exit(0)
            last = f'http {{code}}'
        elif kind == 'tcp':
            socket.create_connection(('127.0.0.1', port), timeout=5).close()
            print(f'ready: tcp {{port}} accepts'); sys.exit(0)
        else:
            r = subprocess.run(['/bin/sh', '-c', command], capture_output=True, timeout=30)
            if r.returncode == 0:
                print('ready: command exited 0'); sys.exit(0)
            last = f'exit {{r.returncode}}'
    except (OSError, subprocess.TimeoutExpired) as e:
        last = str(e)
    time.sleep(0.5)
print(f'not ready: {{last}}'); sys.exit(1)
"""


def as_user(user: str, script: str) -> str:
    if user in ("root", "0", "0:0"):
        return f"/bin/sh -c {shlex.quote(script)}"
    if user.replace(":", "").isdigit():
        uid, _, gid = user.partition(":")
        return (f"setpriv --reuid={uid} --regid={gid or uid} --clear-groups "
                f"/bin/sh -c {shlex.quote(script)}")
    name = user.partition(":")[0]
    return f"runuser -u {shlex.quote(name)} -- /bin/sh -c {shlex.quote(script)}"


def _tar(files: list[tuple[str, Path]], chown: str, single_name: str | None) -> bytes:
    buf = io.BytesIO()
    owner, _, group = chown.partition(":")
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel, path in files:
            info = tar.gettarinfo(str(path), arcname=single_name or rel)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if owner:
                if owner.isdigit():
                    info.uid, info.uname = int(owner), ""
                else:
                    info.uname = owner
                grp = group or owner
                if grp.isdigit():
                    info.gid, info.gname = int(grp), ""
                else:
                    info.gname = grp
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


async def _chunks(data: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _seal(snap: Any, build: Build, boot: BootFiles, tmp: Path, final: Path) -> None:
    for path in (snap.disk, snap.memory, snap.state):
        if path.exists():
            os.chown(path, 0, 0)
            os.chmod(path, 0o444 if path == snap.disk else 0o400)
    meta = {"template": build.name, "kernel": str(boot.kernel), "cmdline": boot.cmdline,
            "initrd": str(boot.initrd) if boot.initrd else None, "mem_mib": boot.mem_mib,
            "vcpus": boot.vcpus, "dockerfile": build.recipe.config_dict()}
    store.write_manifest(tmp, snap, meta)
    shutil.rmtree(tmp / "vm", ignore_errors=True)
    for leftover in ("disk.qcow2.tmp",):
        (tmp / leftover).unlink(missing_ok=True)
    os.replace(tmp, final)


def _message(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "the build took longer than its time limit"
    if isinstance(exc, asyncio.CancelledError):
        return "the build was cancelled (daemon shutting down)"
    return str(exc) or type(exc).__name__
