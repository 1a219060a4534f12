"""Per-sandbox networking: a network namespace holding the VM's TAP, joined to
the host by a veth pair, with nftables inside the namespace.

Every VM sees the same fixed addresses (``guest.protocol``: TAP 169.254.0.22,
guest 169.254.0.21), so any number of clones of one snapshot work. What makes a
sandbox reachable is its *slot*: a /30 out of a configurable link-local pool.
The host end of the veth holds ``.1``, the namespace end ``.2``; traffic from
the host to ``.2`` is DNAT'ed to the guest. Egress is denied by default: the
namespace forwards only host->guest connections (and their replies), and the
guest cannot open connections to the namespace, the host or other guests. What
the ruleset says (also with egress allowed) is ``vmctl.egress``; this module
discovers the host's addresses for it and loads it.

All netlink work goes through pyroute2 in worker threads (it is blocking). Inside
a namespace we use a short-lived thread that ``setns()``es itself into it rather
than pyroute2's ``NetNS``/``netns.create``, which fork the daemon: forking a
process that runs an event loop, child watchers and other threads is how you
get a parent killed by a signal meant for a child.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import re
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

from guest.protocol import PREFIX_LEN, TAP_ADDR, TAP_MAC, TAP_NAME
from vmctl import egress
from vmctl.egress import NS_IF, EgressPolicy, HostFacts
from vmctl.errors import NetworkError

if TYPE_CHECKING:
    from vmctl.dnsfwd import Resolver

log = logging.getLogger(__name__)

# The sandboxes' resolver (``vmctl.dnsfwd.Resolver``), installed by its owner (the gateway
# app) for its lifetime: create/reload give it each namespace's policy, destroy takes it away.
RESOLVER: Resolver | None = None

NETNS_PREFIX = "agentbox-"
NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class NetSlot:
    index: int
    netns: str
    host_if: str
    host_addr: str  # the host's end of the veth
    guest_addr: str  # what the host connects to (DNAT'ed to the guest)


@dataclass(frozen=True)
class NetworkConfig:
    pool: str = "169.254.128.0/17"
    allow_egress: bool = False
    # CIDRs opened in the ranges denied by default (private, CGNAT, ...) when egress is
    # allowed; never the host's own addresses, the pool, loopback or metadata addresses.
    # They are also the private ranges a sandbox's own policy may open (issue 13).
    egress_allow: tuple[str, ...] = ()
    # Where the sandboxes' resolver (vmctl.dnsfwd) forwards allowed names: "ADDR" or
    # "ADDR:PORT"; empty: the first nameserver of the host's /etc/resolv.conf.
    dns_upstream: str = ""
    # Every sandbox's namespace is this + its id. Two daemons on one kernel (a test fleet
    # of hosts in namespaces) need different prefixes: a sandbox that moves keeps its id.
    netns_prefix: str = NETNS_PREFIX

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,22}-", self.netns_prefix):
            raise ValueError("network.netns_prefix must be a lowercase name ending in '-' "
                             f"(at most 24 characters): {self.netns_prefix!r}")
        if isinstance(self.egress_allow, (str, bytes)):
            raise ValueError("network.egress_allow must be a list of CIDRs")
        object.__setattr__(self, "egress_allow", tuple(self.egress_allow))
        try:
            self.holes()
            self.egress_policy()
        except ValueError as exc:
            raise ValueError(f"network.egress_allow: {exc}") from exc
        if self.dns_upstream:
            from vmctl.dnsfwd import upstream_from
            try:
                upstream_from(self.dns_upstream)
            except ValueError as exc:
                raise ValueError(f"network.dns_upstream: {exc}") from exc
        net = ipaddress.ip_network(self.pool)
        if net.version != 4 or net.prefixlen > 30:
            raise ValueError(f"network.pool must be an IPv4 network of /30 or larger: {self.pool}")
        fixed = ipaddress.ip_network(f"{TAP_ADDR}/{PREFIX_LEN}", strict=False)
        if net.overlaps(fixed):
            raise ValueError(f"network.pool {self.pool} overlaps the guest's fixed {fixed}")

    def egress_policy(self) -> EgressPolicy:
        """The default policy: what a sandbox gets when it names none."""
        return EgressPolicy.from_config(self.allow_egress, self.egress_allow)

    def holes(self) -> tuple[ipaddress.IPv4Network, ...]:
        nets = tuple(egress._v4(c) for c in self.egress_allow)
        EgressPolicy(allow=nets)  # the same "never" checks as every policy's
        return nets

    @property
    def capacity(self) -> int:
        return ipaddress.ip_network(self.pool).num_addresses // 4


def slot_for(index: int, vm_id: str, config: NetworkConfig) -> NetSlot:
    if not 0 <= index < config.capacity:
        raise NetworkError(f"slot {index} outside pool {config.pool} ({config.capacity} slots)")
    base = ipaddress.ip_network(config.pool).network_address + 4 * index
    # The host-side name derives from the address, so two daemons with different pools
    # on one host can never collide on interface names.
    return NetSlot(index=index, netns=config.netns_prefix + vm_id,
                   host_if=f"ab{int(base) & 0xffffff:06x}",
                   host_addr=str(base + 1), guest_addr=str(base + 2))


def slot_reserved(index: int, config: NetworkConfig) -> bool:
    """A slot whose /30 holds a cloud metadata address is never handed out: the host would
    route its own metadata requests (169.254.169.254 lies inside the default pool) into
    that sandbox, whose guest could then answer them."""
    base = ipaddress.ip_network(config.pool).network_address + 4 * index
    block = ipaddress.ip_network(f"{base}/30")
    return any(block.overlaps(ipaddress.ip_network(m)) for m in egress.METADATA_V4)


def nft_ruleset(slot: NetSlot, policy: EgressPolicy, facts: HostFacts) -> str:
    return egress.ruleset(slot.guest_addr, policy, facts)


def host_facts(slot: NetSlot, pool: str,
               holes: tuple[ipaddress.IPv4Network, ...] = ()) -> HostFacts:
    """Every IPv4 address the host holds now (local and broadcast, on every interface),
    plus the slot's own host end: a guest must reach none of them."""
    found = {ipaddress.IPv4Address(slot.host_addr)}
    with IPRoute() as ipr:
        for msg in ipr.get_addr(family=socket.AF_INET):
            for attr in ("IFA_LOCAL", "IFA_ADDRESS", "IFA_BROADCAST"):
                value = msg.get_attr(attr)
                if value:
                    found.add(ipaddress.IPv4Address(value))
    return HostFacts(addresses=tuple(sorted(found)), pool=ipaddress.IPv4Network(pool),
                     holes=holes)


def _in_netns(name: str, fn: Callable[[IPRoute], Any]) -> Any:
    """Run ``fn(IPRoute)`` in namespace ``name`` on a throwaway thread (setns is per-thread,
    and a thread that never leaves the namespace can never leak it into other work)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(f"{NETNS_DIR}/{name}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({name}): {os.strerror(err)}")
            finally:
                os.close(fd)
            with IPRoute() as ipr:
                outcome["value"] = fn(ipr)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _configure_inside(ns: IPRoute, slot: NetSlot, tap_owner: tuple[int, int] | None) -> None:
    ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
    veth = ns.link_lookup(ifname=NS_IF)[0]
    ns.addr("add", index=veth, address=slot.guest_addr, prefixlen=30)
    ns.link("set", index=veth, state="up")
    # Owned by the VMM's uid: only it (or root) may attach, so an unprivileged VMM (a jailed
    # Firecracker) can, and another sandbox's cannot.
    owner = {"uid": tap_owner[0], "gid": tap_owner[1]} if tap_owner else {}
    ns.link("add", ifname=TAP_NAME, kind="tuntap", mode="tap", **owner)
    tap = ns.link_lookup(ifname=TAP_NAME)[0]
    ns.link("set", index=tap, address=TAP_MAC)
    ns.addr("add", index=tap, address=TAP_ADDR, prefixlen=PREFIX_LEN)
    ns.link("set", index=tap, state="up")
    ns.route("add", dst="0.0.0.0/0", gateway=slot.host_addr)


def _run(argv: list[str], stdin: bytes = b"") -> None:
    proc = subprocess.run(argv, input=stdin, capture_output=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:5])}: {proc.stderr.decode().strip()}")


def _setup(slot: NetSlot, config: NetworkConfig, policy: EgressPolicy,
           tap_owner: tuple[int, int] | None) -> None:
    _run(["ip", "netns", "add", slot.netns])
    with IPRoute() as host:
        host.link("add", ifname=slot.host_if, kind="veth",
                  peer={"ifname": NS_IF, "net_ns_fd": slot.netns})
        idx = host.link_lookup(ifname=slot.host_if)[0]
        host.addr("add", index=idx, address=slot.host_addr, prefixlen=30)
        host.link("set", index=idx, state="up")
    _in_netns(slot.netns, lambda ns: _configure_inside(ns, slot, tap_owner))
    _load_policy(slot, config, policy)


def _load_policy(slot: NetSlot, config: NetworkConfig, policy: EgressPolicy) -> None:
    """(Re)load the namespace's ruleset, with the host's addresses as they are now."""
    script = "echo 1 > /proc/sys/net/ipv4/ip_forward && nft -f -"
    _run(["ip", "netns", "exec", slot.netns, "sh", "-c", script],
         nft_ruleset(slot, policy, host_facts(slot, config.pool, config.holes())).encode())
    # IPv4 forwards what arrives on an interface whose own `forwarding` is on. Only an
    # egress-allowed sandbox's host end gets it; the rest of the path (uplink forwarding,
    # NAT of the pool) is the operator's (docs/operations.md).
    _write_sysctl(f"/proc/sys/net/ipv4/conf/{slot.host_if}/forwarding",
                  "1" if policy.guest_egress else "0")


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _teardown(slot: NetSlot) -> None:
    # Deleting the namespace destroys the TAP and both veth ends with it.
    if slot.netns in netns.listnetns():
        netns.remove(slot.netns)
    with IPRoute() as host:
        for idx in host.link_lookup(ifname=slot.host_if):
            try:
                host.link("del", index=idx)
            except NetlinkError as exc:
                if exc.code != 19:  # ENODEV: went away with the namespace
                    raise


async def create(slot: NetSlot, config: NetworkConfig,
                 policy: EgressPolicy | None = None, *,
                 tap_owner: tuple[int, int] | None = None) -> None:
    """Create the namespace, veth pair, TAP and firewall for ``slot`` (rolled back on failure).
    ``policy``: this sandbox's egress policy (default: the one ``config`` gives everyone).
    ``tap_owner``: uid/gid of the VMM that will attach to the TAP."""
    policy = policy or config.egress_policy()
    try:
        await asyncio.to_thread(_setup, slot, config, policy, tap_owner)
        if RESOLVER is not None:
            RESOLVER.detach(slot.netns)  # sockets of a namespace of that name now gone
            await RESOLVER.attach(slot.netns, policy)
    except BaseException as exc:
        if RESOLVER is not None:
            RESOLVER.detach(slot.netns)
        await asyncio.shield(asyncio.to_thread(_teardown_quiet, slot))
        if isinstance(exc, (NetlinkError, OSError, subprocess.SubprocessError)):
            raise NetworkError(f"setting up {slot.netns}: {exc}") from exc
        raise


async def reload(slot: NetSlot, config: NetworkConfig,
                 policy: EgressPolicy | None = None) -> None:
    """Replace the ruleset of ``slot``'s existing namespace (atomically: one nft transaction).
    Connections the guest already has open stay open (conntrack keeps them)."""
    policy = policy or config.egress_policy()
    try:
        await asyncio.to_thread(_load_policy, slot, config, policy)
        if RESOLVER is not None:
            await RESOLVER.attach(slot.netns, policy)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NetworkError(f"reloading the firewall of {slot.netns}: {exc}") from exc


async def destroy(slot: NetSlot) -> None:
    """Remove everything ``create`` made. Idempotent."""
    if RESOLVER is not None:
        RESOLVER.detach(slot.netns)
    try:
        await asyncio.shield(asyncio.to_thread(_teardown, slot))
    except (NetlinkError, OSError) as exc:
        raise NetworkError(f"tearing down {slot.netns}: {exc}") from exc


def _teardown_quiet(slot: NetSlot) -> None:
    try:
        _teardown(slot)
    except Exception:  # best effort during rollback; the original error wins
        log.exception("rollback of %s failed", slot.netns)


def list_namespaces(prefix: str = NETNS_PREFIX) -> list[str]:
    """Names of every namespace with ``prefix`` (one daemon's: ``netns_prefix``) on the host."""
    return [n for n in netns.listnetns() if n.startswith(prefix)]
