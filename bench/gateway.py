"""The gateway's own proxy cost: direct vs our gateway vs nginx, to a fast host-local upstream.

No VM is in the path. Four targets on loopback, one upstream:

* upstream - a minimal asyncio (uvloop) HTTP/1.1 server: ``GET /small`` = 512 bytes, keep-alive
* gateway  - the daemon's real app (``gateway.http.app.build_app``: every middleware, the preview
  router, token check, ``gateway.preview.proxy`` and its connection pool) served by
  ``gateway.http.app.run`` as ``serve()`` serves it: uvloop, no access log, the front lane
  (``gateway.preview.fastlane``) on the listening socket. One change: the lifecycle that would
  load goldens and start VMs is replaced
  by a registry holding one RUNNING sandbox and a sandbox service whose ``running()``/``use()``
  go through a real ``SandboxController`` (admission, pacing, activity) whose machine's guest
  address is the upstream. Requests use ``Host: {port}-{id}.localhost`` + ``X-AgentBox-Token``.
* gateway-aiohttp - the same with ``[server] fast_lane = false`` (every request through aiohttp)
* nginx    - nginx 1.22, 1 worker, keepalive upstream, buffering off (as bench/proxy.py)

wrk (``-t1``) at 1 and 64 connections; rounds interleave the targets (order rotated each round),
so every target sees the same machine conditions. Reports medians and min-max over rounds, the
ratios gateway/nginx req/s, and the p50 each gateway adds over direct.

usage: .venv/bin/python bench/gateway.py [--rounds 5] [--duration 5] [--connections 1,64]
       [--profile FILE]   (cProfile the gateway process during one extra 64-connection run)
       [--vary]           (every request head differs: /small?n=COUNTER, via wrk -s)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _common import REPO
import proxy
from proxy import SMALL, ensure_tools, free_port, start_nginx, wait_ok

VARY_LUA = """
counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, "/small?n=" .. counter)
end
"""

SID = "0123456789abcdef"
TARGETS = ("direct", "gateway", "gateway-aiohttp", "nginx")
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(SMALL), SMALL.encode()))


# -- the upstream --------------------------------------------------------------------------

class Upstream(asyncio.Protocol):
    """Answers every request head with RESPONSE (GETs without bodies only: enough here)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        count = self.buf.count(b"\r\n\r\n")
        if count:
            self.buf = self.buf.rsplit(b"\r\n\r\n", 1)[1]
            self.transport.write(RESPONSE * count)  # type: ignore[attr-defined]


async def serve_upstream(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port,
                                                            backlog=1024)
    async with server:
        await server.serve_forever()


# -- the gateway ---------------------------------------------------------------------------

def gateway_app(data_dir: Path, upstream_port: int, token_file: Path,  # type: ignore[no-untyped-def]
                config: Any):
    from aiohttp import web

    from gateway.http import app as app_mod
    from gateway.store import at_rest
    from gateway.http.sandbox_routes import SERVICE_KEY
    from gateway.sandbox.controller import HoldCounter, SandboxController
    from gateway.sandbox.core import Policy
    from gateway.sandbox.states import State
    from gateway.http.middleware import REGISTRY_KEY
    from gateway.preview.access import ACCESS_KEY
    from gateway.store.registry import Registry, SandboxRecord
    from gateway.sandbox.service import current_wake

    app = app_mod.build_app(config)
    assert app.cleanup_ctx[0] is app_mod._lifecycle  # the one piece that needs VMs

    class BenchService:
        """SandboxService.use() without a VM: registry lookup, then the real controller."""

        def __init__(self, registry: Registry) -> None:
            self.registry, self.config = registry, config
            rec = registry.get(SID)
            machine = SimpleNamespace(
                plan=SimpleNamespace(slot=SimpleNamespace(guest_addr="127.0.0.1")),
                driver=SimpleNamespace(pid=1, started_at=1.0), require_agent=lambda: None,
                vmm_record=lambda: None)
            self.ctl = SandboxController(rec, machine, registry, Policy(), HoldCounter(),
                                         lambda aw, name: asyncio.ensure_future(aw))

        def running(self, sandbox_id: str) -> SandboxController | None:
            ctl = self.ctl  # as SandboxService.running: RUNNING, no operation under way
            return ctl if sandbox_id == SID and ctl.state is State.RUNNING else None

        def get(self, tenant: str, sandbox_id: str) -> SandboxRecord:
            rec = self.registry.get(sandbox_id)
            assert rec is not None and rec.tenant == tenant
            return rec

        @contextlib.asynccontextmanager
        async def use(self, tenant: str, sandbox_id: str):  # type: ignore[no-untyped-def]
            self.get(tenant, sandbox_id)
            async with self.ctl.request() as wake:
                current_wake.set(wake)
                yield self.ctl.machine

        use_stream = use

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        at_rest.private_dir(data_dir)  # as the real lifecycle does
        registry = Registry(data_dir / "registry.sqlite")
        key, _ = registry.create_key("bench")
        now = time.time()
        registry.insert_sandbox(SandboxRecord(
            id=SID, tenant=key.id, template="python", state=State.RUNNING, slot=0, root="/x",
            golden="/g", idle_timeout=0, host="h", created_at=now, updated_at=now,
            last_activity=now))
        app[REGISTRY_KEY] = registry
        app[SERVICE_KEY] = BenchService(registry)  # type: ignore[assignment]
        yield
        registry.close()

    async def announce(app: web.Application) -> None:
        token_file.write_text(app[ACCESS_KEY].get(SID).token)

    app.cleanup_ctx[0] = lifecycle
    app.on_startup.append(announce)
    return app


def run_gateway(args: argparse.Namespace) -> None:
    from gateway.http import app as app_mod
    from gateway.config import Config, ServerConfig

    config = Config(server=ServerConfig(data_dir=Path(args.data_dir),
                                        listen=f"127.0.0.1:{args.port}",
                                        fast_lane=not args.aiohttp))
    app = gateway_app(Path(args.data_dir), args.upstream_port, Path(args.token_file), config)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
        signal.signal(signal.SIGUSR2, lambda *_: (profiler.disable(),
                                                  profiler.dump_stats(args.profile)))
    app_mod.run(app, config)  # what serve() runs: the front lane, or aiohttp's run_app


# -- the driver ----------------------------------------------------------------------------

def spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv],
                            cwd=REPO, stdout=subprocess.DEVNULL)


def wait_file(path: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited ({proc.returncode})")
        time.sleep(0.1)
    raise SystemExit("the gateway never started")


def stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def summarise(results: dict[tuple[str, int], list[dict[str, float]]], conns: list[int]) -> None:
    print("\nmedian over rounds (min-max)")
    print(f"{'target':<15} {'conns':>5} {'req/s':>22} {'p50 ms':>22} {'p99 ms':>22}")
    for c in conns:
        for name in TARGETS:
            rs = results[name, c]
            print(f"{name:<15} {c:>5} {spread([r['rps'] for r in rs]):>22} "
                  f"{spread([r['p50'] for r in rs], '{:.3f}'):>22} "
                  f"{spread([r['p99'] for r in rs], '{:.3f}'):>22}")
    for c in conns:
        d, n = results["direct", c], results["nginx", c]
        for name in ("gateway", "gateway-aiohttp"):
            g = results[name, c]
            ratio = [a["rps"] / b["rps"] for a, b in zip(g, n, strict=True)]
            added = [a["p50"] - b["p50"] for a, b in zip(g, d, strict=True)]
            print(f"{c:>2} conn: {name}/nginx req/s {spread(ratio, '{:.2f}')}; p50 added over "
                  f"direct {spread(added, '{:.3f}')} ms")
        added_ng = [a["p50"] - b["p50"] for a, b in zip(n, d, strict=True)]
        fast = [a["rps"] / b["rps"] for a, b in zip(results["gateway", c],
                                                     results["gateway-aiohttp", c], strict=True)]
        print(f"{c:>2} conn: nginx p50 added over direct {spread(added_ng, '{:.3f}')} ms; "
              f"gateway/gateway-aiohttp req/s {spread(fast, '{:.2f}')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=5)
    parser.add_argument("--connections", default="1,64")
    parser.add_argument("--profile", help="write a cProfile of the gateway (64 conns) here")
    parser.add_argument("--vary", action="store_true",
                        help="a different request head every time (/small?n=COUNTER)")
    sub = parser.add_subparsers(dest="role")
    up = sub.add_parser("upstream")
    up.add_argument("--port", type=int, required=True)
    gw = sub.add_parser("gateway")
    for name in ("--port", "--upstream-port"):
        gw.add_argument(name, type=int, required=True)
    gw.add_argument("--data-dir", required=True)
    gw.add_argument("--token-file", required=True)
    gw.add_argument("--profile")
    gw.add_argument("--aiohttp", action="store_true", help="[server] fast_lane = false")
    args = parser.parse_args()
    if args.role == "upstream":
        import uvloop

        uvloop.run(serve_upstream(args.port))
        return
    if args.role == "gateway":
        run_gateway(args)
        return
    drive(args)


def drive(args: argparse.Namespace) -> None:
    ensure_tools()
    script = None
    if args.vary:  # every request head differs (a query counter): no head is ever repeated
        script = Path(tempfile.mkstemp(prefix="agentbox-vary-", suffix=".lua")[1])
        script.write_text(VARY_LUA)

    def wrk(url: str, c: int, duration: int, headers: dict[str, str]) -> dict[str, float]:
        return proxy.wrk(url, c, duration, headers, str(script) if script else None)

    conns = [int(c) for c in args.connections.split(",")]
    work = Path(tempfile.mkdtemp(prefix="agentbox-bench-gw-"))
    up_port, gw_port = free_port(), free_port()
    upstream = gateway = slow = nginx = None
    slow_port = free_port()
    try:
        upstream = spawn("upstream", "--port", str(up_port))
        token_file = work / "token"
        extra = ["--profile", args.profile] if args.profile else []
        gateway = spawn("gateway", "--port", str(gw_port), "--upstream-port", str(up_port),
                        "--data-dir", str(work / "data"), "--token-file", str(token_file),
                        *extra)
        token = wait_file(token_file, gateway)
        slow_token_file = work / "token-aiohttp"
        slow = spawn("gateway", "--port", str(slow_port), "--upstream-port", str(up_port),
                     "--data-dir", str(work / "data-aiohttp"), "--token-file",
                     str(slow_token_file), "--aiohttp")
        slow_token = wait_file(slow_token_file, slow)
        nginx, ng_port = start_nginx("127.0.0.1", work, upstream_port=up_port)
        host = f"{up_port}-{SID}.localhost"
        targets = {
            "direct": (f"http://127.0.0.1:{up_port}/small", {}),
            "gateway": (f"http://127.0.0.1:{gw_port}/small",
                        {"Host": host, "X-AgentBox-Token": token}),
            "gateway-aiohttp": (f"http://127.0.0.1:{slow_port}/small",
                                {"Host": host, "X-AgentBox-Token": slow_token}),
            "nginx": (f"http://127.0.0.1:{ng_port}/small", {"Host": host}),
        }
        assert list(targets) == list(TARGETS)
        for url, headers in targets.values():
            wait_ok(url, headers)
            wrk(url, 8, 2, headers)  # warm up
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        names = list(targets)
        print(f"{'round':>5} {'target':<15} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
        for rnd in range(args.rounds):
            k = rnd % len(names)
            order = names[k:] + names[:k]  # rotate: no target always goes first
            for c in conns:
                for name in order:
                    url, headers = targets[name]
                    r = wrk(url, c, args.duration, headers)
                    results.setdefault((name, c), []).append(r)
                    print(f"{rnd:>5} {name:<15} {c:>5} {r['rps']:>9.0f} {r['p50']:>8.3f} "
                          f"{r['p99']:>8.3f}{'  (errors!)' if r['errors'] else ''}", flush=True)
        summarise(results, conns)
        if args.profile:
            gateway.send_signal(signal.SIGUSR1)
            wrk(*targets["gateway"][:1], 64, args.duration, targets["gateway"][1])
            gateway.send_signal(signal.SIGUSR2)
            time.sleep(2)
            import pstats

            print(f"\nprofile of the gateway at 64 connections ({args.profile}), by own time:")
            stats = pstats.Stats(args.profile)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
    finally:
        if nginx is not None:
            stop(nginx, signal.SIGQUIT)
        stop(gateway)
        stop(slow)
        stop(upstream)
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
