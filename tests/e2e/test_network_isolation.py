"""A hostile guest against the network boundary, with real VMs and real listeners.

Every "cannot reach" below aims at a listener this test opened, and the same listener is first
reached from a place that should reach it (the host, the sandbox's namespace itself), so the
test fails if the firewall is missing rather than passing on "nothing listens there". Each
probe also sends one-way UDP datagrams (from the guest's address and from a spoofed one) that
the listeners log: a packet that gets through is seen even when no reply could come back.
Checked by hand: with the namespace firewall replaced by "accept everything" every test here
fails, and main's previous ruleset fails the IPv6, egress and spoofing tests.

Network rule: traffic goes only to the host's own addresses (local delivery) or to addresses
inside namespaces this test created. The "internet" is a namespace joined to the host by a
veth, holding documentation-range addresses (plus a private and a metadata address on its own
interface) with host routes to them through that veth; every target's route is asserted to be
local or through that veth before anything connects to it. Everything created is removed.

Where the host itself would mask a missing namespace firewall (it does not forward by
default), the test turns forwarding on for the guest's host-side veth end while it probes, as
a host that forwards for other reasons would: then only the namespace firewall is left.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import running_daemon
from guest.protocol import GUEST_ADDR, TAP_MAC
from tests.netprobe import (LISTENER, link_local, listener, parse_probe, probe, probe_code,
                            raw_udp_code, sh, udp_seen)

pytestmark = pytest.mark.e2e

PORT = 47321  # every listener of this file (host, internet namespace, sandbox namespace, guests)
INET_NS = f"abinet{os.getpid()}"
INET_HOST_IF = f"abih{os.getpid() % 100000}"
INET_HOST_END, INET_NS_END = "203.0.113.1", "203.0.113.2"  # the veth's /30
# On the internet namespace's own interface:
INTERNET = {
    "allowed-public": "198.51.100.10",  # opened by egress_allow below
    "allowed-private": "10.99.1.10",  # opened by egress_allow below
    "documentation": "203.0.113.10",  # denied by default (not in egress_allow)
    "rfc1918-10": "10.99.0.10",
    "rfc1918-192": "192.168.99.10",
    "cgnat": "100.64.99.10",
    "metadata": "169.254.169.254",
    "metadata-alibaba": "100.100.100.200",
    "metadata-oracle": "192.0.0.192",
}
EGRESS_ALLOW = ["198.51.100.0/24", "10.99.1.0/24"]
EGRESS_POOL = "169.254.32.0/20"  # neither config's pool; clear of 169.254.169.254
GUEST_UDP_LOG = "/tmp/udp.log"  # inside guest B
# Every guest's own address: a host route to it is a blackhole while this module runs, so that
# even with a broken firewall no reply to an un-NATed guest packet follows the default route.
GUEST_NET = "169.254.0.20/30"


# --- helpers ------------------------------------------------------------------------------

def run(api, sid: str, **body) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/execute", json=body)
    assert r.status_code == 200, r.text
    return r.json()


SPOOF = "10.77.0.5"  # a second source the guest gives itself (anti-spoofing must drop it)
_ADD_SPOOF = (f"ip addr add {SPOOF}/32 dev $(ls /sys/class/net | grep -v '^lo$' | head -1)"
              " 2>/dev/null; true")


def guest_probe(api, sid: str, targets: list, setup: str = "") -> tuple[dict[str, str], str]:
    """Probe from inside the guest (as root): TCP connects, and one-way UDP datagrams from
    the guest's address and from a spoofed one. Returns (TCP results, the UDP nonce).
    ``setup``: shell run first (the guest's tricks)."""
    nonce = os.urandom(6).hex()
    res = run(api, sid, command=f"{setup}; {_ADD_SPOOF}" if setup else _ADD_SPOOF, timeout=30)
    assert res["exit_code"] == 0, res
    code = probe_code(targets, timeout=2, udp_nonce=nonce, udp_sources=(None, SPOOF))
    out = run(api, sid, code=code, timeout=30 + 3 * len(targets))
    assert out["exit_code"] == 0, out
    time.sleep(0.5)  # the datagrams went out before the TCP probes; let the logs catch up
    return parse_probe(out["stdout"]), nonce


def route_of(addr: str) -> dict:
    return json.loads(sh("ip", "-j", "route", "get", addr.split("%")[0]))[0]


def assert_stays_here(addr: str) -> None:
    """NETWORK RULE: ``addr`` is the host's own or inside the internet namespace."""
    route = route_of(addr)
    assert route.get("type") == "local" or route.get("dev") == INET_HOST_IF, (addr, route)


def host_addresses() -> dict[str, str]:
    """label -> every address the host holds now (IPv6 link-local with its scope)."""
    found = {}
    for link in json.loads(sh("ip", "-j", "addr")):
        for a in link.get("addr_info", []):
            if "local" not in a or a.get("tentative"):
                continue
            addr = a["local"]
            if ipaddress.ip_address(addr).is_link_local and a["family"] == "inet6":
                addr += f"%{link['ifname']}"
            found[f"host {link['ifname']} {addr}"] = addr
    return found


def slot_of(sid: str) -> tuple[str, str]:
    """(the sandbox's address as the host sees it, the host-side veth name)."""
    out = json.loads(sh("ip", "-n", f"agentbox-{sid}", "-j", "-4", "addr", "show", "dev", "veth0"))
    guest_addr = out[0]["addr_info"][0]["local"]
    base = int(ipaddress.IPv4Address(guest_addr)) - 2
    return guest_addr, f"ab{base & 0xffffff:06x}"


@contextmanager
def host_forwarding(ifname: str):
    """Forward what the guest sends, on its host end only (restored afterwards)."""
    path = Path(f"/proc/sys/net/ipv4/conf/{ifname}/forwarding")
    before = path.read_text().strip()
    path.write_text("1")
    try:
        yield
    finally:
        path.write_text(before)


def create(api, template: str = "python") -> str:
    r = api.post("/v1/sandboxes", json={"template": template})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def start_guest_listener(api, sid: str, token: str) -> None:
    command = f"python3 -c {shlex.quote(LISTENER)} {PORT} {token} {GUEST_UDP_LOG}"
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"command": command, "background": True})
    assert r.status_code == 201, r.text


def guest_udp_log(api, sid: str) -> str:
    return run(api, sid, command=f"cat {GUEST_UDP_LOG} 2>/dev/null; true")["stdout"]


def wait_reached(targets: list, expect: str, netns: str | None = None, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        got = probe(targets, netns=netns, timeout=2)
        if all(v == f"reached:{expect}" for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


# --- fixtures -----------------------------------------------------------------------------

@dataclass
class Listening:
    addrs: dict[str, str]  # label -> address its listener was reached on (from its side)
    udp_log: Path

    def udp(self, nonce: str) -> set[str]:
        return udp_seen(self.udp_log.read_text(), nonce)


def _prove_udp(listening: Listening, netns: str | None = None) -> None:
    """Datagrams sent from the right side arrive in the log (so silence later means drop)."""
    nonce = os.urandom(6).hex()
    probe([(k, a, PORT, None) for k, a in listening.addrs.items()], netns=netns,
          udp_nonce=nonce)
    time.sleep(0.5)
    assert listening.udp(nonce) == {f"{k} None" for k in listening.addrs}, listening.addrs


@pytest.fixture(scope="module")
def internet(tmp_path_factory):
    """The test's "internet": a namespace with a listener on every address in INTERNET."""
    udp_log = tmp_path_factory.mktemp("inet") / "udp.log"
    udp_log.touch()
    blackhole = not json.loads(sh("ip", "-j", "route", "show", "type", "blackhole", GUEST_NET))
    try:
        if blackhole:
            sh("ip", "route", "add", "blackhole", GUEST_NET)
        sh("ip", "netns", "add", INET_NS)
        sh("ip", "link", "add", INET_HOST_IF, "type", "veth", "peer", "name", "up0",
           "netns", INET_NS)
        sh("ip", "addr", "add", f"{INET_HOST_END}/30", "dev", INET_HOST_IF)
        sh("ip", "link", "set", INET_HOST_IF, "up")
        sh("ip", "-n", INET_NS, "link", "set", "lo", "up")
        sh("ip", "-n", INET_NS, "addr", "add", f"{INET_NS_END}/30", "dev", "up0")
        for addr in INTERNET.values():
            sh("ip", "-n", INET_NS, "addr", "add", f"{addr}/32", "dev", "up0")
            sh("ip", "route", "add", f"{addr}/32", "via", INET_NS_END, "dev", INET_HOST_IF)
        sh("ip", "-n", INET_NS, "link", "set", "up0", "up")
        # Only back to the host: this namespace has no other link.
        sh("ip", "-n", INET_NS, "route", "add", "default", "via", INET_HOST_END)
        # Replies to a guest arrive here and are forwarded to its veth.
        Path(f"/proc/sys/net/ipv4/conf/{INET_HOST_IF}/forwarding").write_text("1")
        for addr in INTERNET.values():
            assert_stays_here(addr)
        with listener(PORT, "internet", netns=INET_NS, udp_log=str(udp_log)):
            got = wait_reached([(k, a, PORT, None) for k, a in INTERNET.items()], "internet")
            assert all(v == "reached:internet" for v in got.values()), got
            listening = Listening(dict(INTERNET), udp_log)
            _prove_udp(listening)
            yield listening
    finally:
        subprocess.run(["ip", "netns", "del", INET_NS], capture_output=True)
        subprocess.run(["ip", "link", "del", INET_HOST_IF], capture_output=True)
        if blackhole:
            subprocess.run(["ip", "route", "del", "blackhole", GUEST_NET], capture_output=True)
    assert INET_NS not in sh("ip", "netns", "list")
    assert not os.path.exists(f"/sys/class/net/{INET_HOST_IF}")
    for addr in INTERNET.values():  # the host routes went with the veth
        assert route_of(addr).get("dev") != INET_HOST_IF


@pytest.fixture(scope="module")
def host_listener(internet, tmp_path_factory):
    """A listener on every host address (those the host itself reaches it on)."""
    udp_log = tmp_path_factory.mktemp("host") / "udp.log"
    udp_log.touch()
    with listener(PORT, "host", udp_log=str(udp_log)):
        addrs = host_addresses()
        for addr in addrs.values():
            assert_stays_here(addr)
        got = probe([(k, a, PORT, None) for k, a in addrs.items()], timeout=2)
        reached = {k: addrs[k] for k, v in got.items() if v == "reached:host"}
        # The ones that must be there (others may come and go with other daemons' sandboxes).
        for must in ("127.0.0.1", INET_HOST_END):
            assert must in reached.values(), got
        listening = Listening(reached, udp_log)
        _prove_udp(listening)
        yield listening


@pytest.fixture(scope="module")
def egress_daemon(images_built, tmp_path_factory, internet):
    """A second daemon with egress allowed (and an allow-list), on its own pool."""
    root = tmp_path_factory.mktemp("egress")
    config = root / "agentbox-egress.toml"
    config.write_text(
        '[sandbox]\ntemplates = ["python"]\nidle_timeout = 0\n\n'
        f'[network]\npool = "{EGRESS_POOL}"\nallow_egress = true\n'
        f"egress_allow = {json.dumps(EGRESS_ALLOW)}\n\n[pool]\nsize = 0\n")
    with running_daemon(root / "data", config=config) as d:
        yield d


@pytest.fixture(scope="module")
def egress_api(egress_daemon):
    with egress_daemon.client() as client:
        yield client


def _pair(api):
    """Two sandboxes: A (the attacker) and B with a listener in its guest, which the host
    reaches (TCP, and UDP that lands in B's log)."""
    a, b = create(api), create(api)
    try:
        start_guest_listener(api, b, "guest-b")
        b_addr, b_if = slot_of(b)
        assert route_of(b_addr).get("dev") == b_if  # B's own veth, into its namespace
        got = wait_reached([("b", b_addr, PORT, None)], "guest-b")
        assert got["b"] == "reached:guest-b", got
        nonce = os.urandom(6).hex()
        probe([("b", b_addr, PORT, None)], udp_nonce=nonce)
        assert udp_seen(guest_udp_log(api, b), nonce) == {"b None"}
        yield a, b
    finally:
        for sid in (a, b):
            api.delete(f"/v1/sandboxes/{sid}")


@pytest.fixture(scope="module")
def pair(daemon, internet):
    with daemon.client() as api:
        yield from _pair(api)


@pytest.fixture(scope="module")
def egress_pair(egress_api):
    yield from _pair(egress_api)


def _blocked(got: dict[str, str]) -> None:
    assert all(v.startswith("blocked:") for v in got.values()), got


# --- egress denied (the default config) ---------------------------------------------------

def test_guest_cannot_reach_any_host_address(api, pair, host_listener):
    a, _ = pair
    _, host_if = slot_of(a)
    targets = _host_targets(a, host_listener)
    with host_forwarding(host_if):
        got, nonce = guest_probe(api, a, targets, setup=_V6_ROUTE)
    _blocked(got)
    assert host_listener.udp(nonce) == set()


def test_guest_cannot_reach_another_guest(api, pair):
    a, b = pair
    b_addr, _ = slot_of(b)
    _, host_if = slot_of(a)
    with host_forwarding(host_if):
        got, nonce = guest_probe(api, a, [("guest-b", b_addr, PORT, None)])
    _blocked(got)
    assert udp_seen(guest_udp_log(api, b), nonce) == set()
    # ... and the host still reaches B's listener (it is alive).
    assert probe([("b", b_addr, PORT, None)])["b"] == "reached:guest-b"


def test_guest_cannot_reach_the_internet_when_egress_is_denied(api, pair, internet):
    a, _ = pair
    _, host_if = slot_of(a)
    targets = [(k, addr, PORT, None) for k, addr in INTERNET.items()]
    for _label, addr, _port, _src in targets:
        assert_stays_here(addr)
    with host_forwarding(host_if):
        got, nonce = guest_probe(api, a, targets)
    _blocked(got)
    assert internet.udp(nonce) == set()


def test_guest_cannot_reach_its_own_namespace_over_ipv4_or_ipv6(api, pair, tmp_path):
    a, _ = pair
    ns = f"agentbox-{a}"
    log = tmp_path / "udp.log"
    log.touch()
    with listener(PORT, "sandbox-ns", netns=ns, udp_log=str(log)):
        ll = link_local(ns, "tap0")
        guest_addr, _ = slot_of(a)
        inside = {"tap-v4": "169.254.0.22", "veth-v4": guest_addr, "tap-v6-ll": f"{ll}%tap0"}
        got = wait_reached([(k, v, PORT, None) for k, v in inside.items()], "sandbox-ns",
                           netns=ns)  # the namespace reaches itself
        assert all(v == "reached:sandbox-ns" for v in got.values()), got
        _prove_udp(Listening(inside, log), netns=ns)
        eth = _guest_ifname(api, a)
        # The guest has IPv6 (else this part would pass without any firewall).
        v6 = run(api, a, command="cat /proc/sys/net/ipv6/conf/all/disable_ipv6")["stdout"]
        assert v6.strip() == "0", v6
        from_guest = [("tap-v4", "169.254.0.22", PORT, None),
                      ("tap-v6-ll", f"{ll}%{eth}", PORT, None)]
        got, nonce = guest_probe(api, a, from_guest)
    _blocked(got)
    assert udp_seen(log.read_text(), nonce) == set()


def _handmade_frames_to_host_loopback(api, sid: str, host: Listening,
                                      control: Listening | None = None) -> None:
    """The guest's kernel never sends to 127.0.0.1; a raw socket does, straight at the TAP.
    ``control``: where a frame to an allowed address must arrive (the frames are good)."""
    _, host_if = slot_of(sid)
    nonce = os.urandom(6).hex()
    frames = [("loopback", GUEST_ADDR, "127.0.0.1", PORT), ("loopback-2", GUEST_ADDR,
              "127.0.0.2", PORT), ("loopback-spoofed", "127.0.0.1", "127.0.0.1", PORT)]
    frames += [(k, GUEST_ADDR, a, PORT) for k, a in host.addrs.items() if "." in a]
    if control:
        assert_stays_here(INTERNET["allowed-public"])
        frames.append(("control", GUEST_ADDR, INTERNET["allowed-public"], PORT))
    with host_forwarding(host_if):
        res = run(api, sid, code=raw_udp_code(frames, TAP_MAC, nonce), timeout=60)
        assert res["exit_code"] == 0 and res["stdout"].startswith("sent"), res
        time.sleep(1)
    assert host.udp(nonce) == set()
    if control:
        assert control.udp(nonce) == {f"control {GUEST_ADDR}"}


def test_guest_cannot_reach_host_loopback_with_handmade_frames(api, pair, host_listener):
    _handmade_frames_to_host_loopback(api, pair[0], host_listener)


# --- egress allowed (a second daemon) -----------------------------------------------------

def test_allowed_egress_reaches_only_the_allowed_internet(egress_api, egress_pair, internet):
    a, _ = egress_pair
    targets = [(k, addr, PORT, None) for k, addr in INTERNET.items()]
    for _label, addr, _port, _src in targets:
        assert_stays_here(addr)
    got, nonce = guest_probe(egress_api, a, targets)
    assert got.pop("allowed-public") == "reached:internet", got
    assert got.pop("allowed-private") == "reached:internet", got
    _blocked(got)
    # Only the guest's own datagrams to the allowed addresses arrive; no spoofed ones.
    assert internet.udp(nonce) == {"allowed-public None", "allowed-private None"}


def test_allowed_egress_still_denies_host_addresses_and_other_guests(
        egress_api, egress_pair, host_listener):
    a, b = egress_pair
    b_addr, _ = slot_of(b)
    targets = _host_targets(a, host_listener) + [("guest-b", b_addr, PORT, None)]
    got, nonce = guest_probe(egress_api, a, targets, setup=_V6_ROUTE)
    _blocked(got)
    assert host_listener.udp(nonce) == set()
    assert udp_seen(guest_udp_log(egress_api, b), nonce) == set()
    assert probe([("b", b_addr, PORT, None)])["b"] == "reached:guest-b"


def test_allowed_egress_cannot_reach_host_loopback_with_handmade_frames(
        egress_api, egress_pair, host_listener, internet):
    _handmade_frames_to_host_loopback(egress_api, egress_pair[0], host_listener, internet)


def test_allowed_egress_drops_spoofed_sources(egress_api, egress_pair, internet):
    """Other sources than the guest's: made up, in the allow-list, another guest's slot."""
    a, b = egress_pair
    allowed = INTERNET["allowed-public"]
    assert_stays_here(allowed)
    spoofed = ["10.99.1.77", "198.51.100.77", slot_of(b)[0]]
    eth = _guest_ifname(egress_api, a)
    setup = "; ".join(f"ip addr add {s}/32 dev {eth} 2>/dev/null" for s in spoofed)
    assert run(egress_api, a, command=setup + "; true")["exit_code"] == 0
    nonce = os.urandom(6).hex()
    code = probe_code([("allowed", allowed, PORT, None)], udp_nonce=nonce,
                      udp_sources=(None, *spoofed))
    assert run(egress_api, a, code=code, timeout=60)["exit_code"] == 0
    time.sleep(0.5)
    assert internet.udp(nonce) == {"allowed None"}


def _host_targets(sid: str, host: Listening) -> list:
    """Every host address the host reached its listener on, plus this guest's own veth host
    end (the one address a guest is most likely to find), checked to reach the host now."""
    guest_addr, _ = slot_of(sid)
    own = str(ipaddress.IPv4Address(guest_addr) - 1)
    assert_stays_here(own)
    assert probe([("own", own, PORT, None)])["own"] == "reached:host"
    return [(k, addr, PORT, None) for k, addr in host.addrs.items()] + [
        ("own-veth-host-end", own, PORT, None)]


# --- guest-side helpers -------------------------------------------------------------------

# The guest's "any trick" for IPv6: a global address and a default route out of its interface,
# so that IPv6 targets are tried for real instead of failing with "no route".
_V6_ROUTE = ("dev=$(ls /sys/class/net | grep -v '^lo$' | head -1); "
             "ip -6 addr add fd99::21/64 dev $dev nodad 2>/dev/null; "
             "ip -6 route add default dev $dev 2>/dev/null; true")


def _guest_ifname(api, sid: str) -> str:
    out = run(api, sid, command="ls /sys/class/net | grep -v '^lo$' | head -1")["stdout"]
    assert out.strip(), out
    return out.strip()
