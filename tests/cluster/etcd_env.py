"""A real 3-member etcd cluster, one member per network namespace, made and torn down here.

Layout (every name starts with this run's prefix, ``abc{pid}{random}``, so parallel runs and
other suites never collide, and a crashed run's leftovers are recognisable and swept):

    {p}sw   the "switch": bridge br0 (198.18.0.254/24); tests' observers run here
    {p}h0   eth0 198.18.0.1  -- veth --  p0 on br0      etcd member m0 (:2379, peers :2380)
    {p}h1   eth0 198.18.0.2  -- veth --  p1 on br0      etcd member m1
    {p}h2   eth0 198.18.0.3  -- veth --  p2 on br0      etcd member m2

198.18.0.0/15 is the benchmarking range (RFC 2544): it is used only inside these namespaces,
which have no link to the host's own namespace, so no test traffic can leave them. A host
is cut off with ``ip link set eth0 down`` inside its namespace (its etcd member goes with it).

Python code runs "inside" a namespace on a ``NetnsLoop``: a thread that setns()es itself
(network namespaces are per thread) and runs an asyncio loop; sockets made there belong to
that namespace. Everything is removed in ``close()``, which the fixture calls even on failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
SUBNET = "198.18.0"
ETCD_TUNING = ["--heartbeat-interval=50", "--election-timeout=500", "--pre-vote"]
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_PREFIX_RE = re.compile(r"abc(\d+)x[0-9a-f]{4}")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


class NetnsLoop:
    """An asyncio loop on a thread inside network namespace ``netns``."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"netns-{netns}", daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({self.netns})")
            finally:
                os.close(fd)
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        asyncio.set_event_loop(self.loop)
        self._started.set()
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@dataclass
class Member:
    name: str
    netns: str
    ip: str
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://{self.ip}:2379"

    @property
    def peer_url(self) -> str:
        return f"http://{self.ip}:2380"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdCluster:
    """``size`` etcd members in their own namespaces plus a switch namespace joining them."""

    def __init__(self, base_dir: Path, size: int = 3) -> None:
        self.prefix = f"abc{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{self.prefix}sw"
        self.base_dir = base_dir
        self.members = [Member(f"m{i}", f"{self.prefix}h{i}", f"{SUBNET}.{i + 1}",
                               base_dir / f"m{i}", base_dir / f"m{i}.log") for i in range(size)]
        self._namespaces: list[str] = []
        self._loops: dict[str, NetnsLoop] = {}

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    # --- set-up ------------------------------------------------------------------------

    def start(self, timeout: float = 15.0) -> float:
        """Make the network, start every member, wait for a leader; seconds it took."""
        begin = time.monotonic()
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._make_network()
        for member in self.members:
            self.start_member(member, new=True)
        self.wait_leader(timeout)
        return time.monotonic() - begin

    def _add_netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _make_network(self) -> None:
        self._add_netns(self.switch)
        sw = ("ip", "-n", self.switch)
        sh(*sw, "link", "add", "br0", "type", "bridge")
        sh(*sw, "addr", "add", f"{SUBNET}.254/24", "dev", "br0")
        sh(*sw, "link", "set", "br0", "up")
        for i, member in enumerate(self.members):
            self._add_netns(member.netns)
            ns = ("ip", "-n", member.netns)
            sh(*ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
               "netns", self.switch)
            sh(*ns, "addr", "add", f"{member.ip}/24", "dev", "eth0")
            sh(*ns, "link", "set", "eth0", "up")
            sh(*sw, "link", "set", f"p{i}", "master", "br0")
            sh(*sw, "link", "set", f"p{i}", "up")

    def start_member(self, member: Member, new: bool = False) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        argv = ["ip", "netns", "exec", member.netns, "etcd", "--name", member.name,
                "--data-dir", str(member.data_dir), "--logger=zap", "--log-outputs=stderr",
                "--listen-client-urls", member.client_url,
                "--advertise-client-urls", member.client_url,
                "--listen-peer-urls", member.peer_url,
                "--initial-advertise-peer-urls", member.peer_url,
                "--initial-cluster", initial, "--initial-cluster-token", self.prefix,
                "--initial-cluster-state", "new" if new else "existing", *ETCD_TUNING]
        log = open(member.log_path, "ab")
        try:
            member.proc = subprocess.Popen(argv, stdout=log, stderr=log,
                                           stdin=subprocess.DEVNULL)
        finally:
            log.close()

    # --- looking and breaking ------------------------------------------------------------

    def loop(self, netns: str | None = None) -> NetnsLoop:
        """The asyncio loop inside ``netns`` (default: the switch), made on first use."""
        netns = netns or self.switch
        if netns not in self._loops:
            self._loops[netns] = NetnsLoop(netns)
        return self._loops[netns]

    def statuses(self) -> dict[str, dict[str, Any]]:
        """``/v3/maintenance/status`` of each live member that answers, by member name."""
        from gateway.cluster.errors import ClusterError
        from gateway.cluster.etcd import EtcdClient

        async def ask() -> dict[str, dict[str, Any]]:
            client = EtcdClient(self.endpoints, attempt_timeout=0.5)
            out = {}
            try:
                for member in self.members:
                    with contextlib.suppress(ClusterError):
                        out[member.name] = await client.status(member.client_url)
            finally:
                await client.aclose()
            return out
        return self.loop().run(ask())

    def leader(self) -> Member | None:
        for name, status in self.statuses().items():
            if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return next(m for m in self.members if m.name == name)
        return None

    def wait_leader(self, timeout: float = 10.0) -> Member:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                return leader
            time.sleep(0.05)
        raise TimeoutError(f"no etcd leader within {timeout} s\n{self.logs()}")

    def kill(self, member: Member) -> None:
        assert member.proc is not None
        member.proc.send_signal(signal.SIGKILL)
        member.proc.wait(10)

    def link(self, member: Member, up: bool) -> None:
        sh("ip", "-n", member.netns, "link", "set", "eth0", "up" if up else "down")

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {m.name}\n{m.log_path.read_text(errors='replace')[-tail:]}"
                         for m in self.members if m.log_path.exists())

    # --- tear-down -----------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent; every step runs even if an earlier one failed."""
        for loop in self._loops.values():
            with contextlib.suppress(Exception):
                loop.close()
        self._loops.clear()
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.terminate()
                try:
                    member.proc.wait(5)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait(5)
        for name in reversed(self._namespaces):
            sh("ip", "netns", "del", name, check=False)
        self._namespaces.clear()
        shutil.rmtree(self.base_dir, ignore_errors=True)


def sweep_stale_namespaces() -> list[str]:
    """Remove namespaces a crashed earlier run left (its pid is gone); returns their names."""
    removed = []
    listing = sh("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _PREFIX_RE.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed
