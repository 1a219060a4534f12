"""The egress policy: config validation, the generated ruleset (checked by ``nft -c``), and
the ruleset applied between throwaway namespaces that stand in for guest, sandbox and world.

The namespace test wires three namespaces with no link to the host or any real network:
G (the "guest", eth0 = 169.254.0.21) -- S (the sandbox namespace: tap0, veth0) -- W (the
host and the internet: every target address lives on W's loopback). Every target is probed
once with no ruleset (each must be reached: the test can fail) and then with the ruleset.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.config import ConfigError, load
from tests.netprobe import link_local, listener, probe, sh
from vmctl import network
from vmctl.egress import EgressPolicy, HostFacts, ruleset
from vmctl.network import NetSlot, NetworkConfig

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"),
                                reason="needs root and nft")
POOL = "169.254.48.0/24"  # no daemon's pool: config/agentbox.toml, the e2e configs
FACTS = HostFacts(addresses=(ipaddress.IPv4Address("192.0.2.2"),
                             ipaddress.IPv4Address("169.254.48.1")),
                  pool=ipaddress.IPv4Network(POOL))
OPEN = EgressPolicy(allow_egress=True, allow=tuple(map(ipaddress.IPv4Network, (
    "198.51.100.0/24", "10.1.2.0/24", "192.0.2.0/24", "100.64.0.0/10"))))


# --- config -------------------------------------------------------------------------------

def test_egress_allow_is_parsed_into_the_policy(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text('[network]\nallow_egress = true\negress_allow = ["10.1.2.0/24"]\n')
    cfg = load(path).vm.network
    assert cfg.egress_allow == ("10.1.2.0/24",)
    assert cfg.egress_policy() == EgressPolicy(True, (ipaddress.IPv4Network("10.1.2.0/24"),))


@pytest.mark.parametrize("body, message", [
    ('allow_egress = true\negress_allow = "10.0.0.0/8"', "list of CIDRs"),
    ('allow_egress = true\negress_allow = ["10.1.2.3/24"]', "host bits"),
    ('allow_egress = true\negress_allow = ["fd00::/8"]', "IPv6 egress"),
    ('allow_egress = true\negress_allow = ["169.254.169.0/24"]', "never reaches"),
    ('allow_egress = true\negress_allow = ["127.0.0.1/32"]', "never reaches"),
])
def test_bad_egress_config_fails_with_the_key_name(tmp_path: Path, body: str, message: str):
    path = tmp_path / "c.toml"
    path.write_text(f"[network]\n{body}\n")
    with pytest.raises(ConfigError, match=message) as info:
        load(path)
    assert "egress_allow" in str(info.value)


# --- the generated text -------------------------------------------------------------------

def test_denied_egress_has_no_outbound_accept_and_no_nat():
    text = ruleset("169.254.48.2", EgressPolicy(), FACTS)
    assert "masquerade" not in text and 'iifname "tap0" oifname "veth0"' not in text
    assert "policy drop" in text and 'iifname "tap0" drop' in text


def test_allowed_egress_checks_host_addresses_before_the_allow_list():
    text = ruleset("169.254.48.2", OPEN, FACTS)
    order = [text.index(f"@{s}") for s in ("always_denied", "allowed", "default_denied")]
    assert order == sorted(order)
    always = next(ln for ln in text.splitlines() if "set always_denied" in ln)
    for addr in ("192.0.2.2/32", "169.254.0.0/16", "127.0.0.0/8", "100.100.100.200/32",
                 "192.0.0.192/32", "168.63.129.16/32"):
        assert addr in always


def test_spoofed_sources_and_ipv6_are_dropped_before_conntrack():
    text = ruleset("169.254.48.2", OPEN, FACTS)
    guard = text[text.index("chain guard"):text.index("chain prerouting")]
    assert "priority raw" in guard
    assert 'iifname "tap0" ip saddr != 169.254.0.21 drop' in guard
    assert 'iifname "tap0" meta nfproto ipv6 drop' in guard


@needs_root
@pytest.mark.parametrize("policy", [EgressPolicy(), OPEN, EgressPolicy(allow_egress=True)])
def test_generated_ruleset_passes_nft_check(tmp_path: Path, policy: EgressPolicy):
    path = tmp_path / "rules.nft"
    path.write_text(ruleset("169.254.48.2", policy, FACTS))
    proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- applied between throwaway namespaces -------------------------------------------------

PORT = 48111


def _wire(g: str, s: str, w: str) -> None:
    for ns in (g, s, w):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", g, "link", "add", "eth0", "type", "veth", "peer", "name", "tap0", "netns", s)
    sh("ip", "-n", s, "link", "add", "veth0", "type", "veth", "peer", "name", "up0", "netns", w)
    for ns, dev, addrs in ((g, "eth0", ["169.254.0.21/30", "10.77.0.5/32"]),
                           (s, "tap0", ["169.254.0.22/30"]), (s, "veth0", ["169.254.48.2/30"]),
                           (w, "up0", ["169.254.48.1/30"])):
        for addr in addrs:
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
    sh("ip", "-n", g, "-6", "addr", "add", "fd99::21/64", "dev", "eth0", "nodad")
    sh("ip", "-n", s, "-6", "addr", "add", "fd99::22/64", "dev", "tap0", "nodad")
    for addr in ("198.51.100.10", "10.1.2.10", "10.9.9.9", "169.254.169.254", "192.0.2.2",
                 "100.100.100.200"):
        sh("ip", "-n", w, "addr", "add", f"{addr}/32", "dev", "lo")
    sh("ip", "-n", g, "route", "add", "default", "via", "169.254.0.22")
    sh("ip", "-n", s, "route", "add", "default", "via", "169.254.48.1")
    sh("ip", "-n", s, "route", "add", "10.77.0.0/24", "dev", "tap0")
    for net in ("169.254.0.20/30", "10.77.0.0/24"):  # replies when nothing masquerades
        sh("ip", "-n", w, "route", "add", net, "via", "169.254.48.2")
    sh("ip", "netns", "exec", s, "sysctl", "-qw", "net.ipv4.ip_forward=1")


@pytest.fixture
def three_namespaces():
    names = tuple(f"abt{role}{os.getpid()}" for role in "gsw")
    try:
        _wire(*names)
        with listener(PORT, "world", netns=names[2]), listener(PORT, "sandbox-ns", netns=names[1]):
            yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert not set(names) & set(os.listdir(network.NETNS_DIR))


ALLOWED = [("allowed-doc-range", "198.51.100.10"), ("allowed-private", "10.1.2.10")]
DENIED = [("private", "10.9.9.9"), ("metadata", "169.254.169.254"),
          ("metadata-in-allowed-cgnat", "100.100.100.200"),
          ("host-address-in-allowed-range", "192.0.2.2"), ("veth-host-end", "169.254.48.1"),
          ("namespace-tap", "169.254.0.22"), ("namespace-v6", "fd99::22")]


def _targets(g: str, s: str) -> list:
    targets = [(label, addr, PORT, None) for label, addr in ALLOWED + DENIED]
    targets.append(("namespace-v6-link-local", f"{link_local(s, 'tap0')}%eth0", PORT, None))
    targets.append(("spoofed-source", "198.51.100.10", PORT, "10.77.0.5"))
    return targets


def _load(ns: str, text: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@needs_root
def test_ruleset_applied_denies_all_but_the_allow_list(three_namespaces):
    g, s, _ = three_namespaces
    targets = _targets(g, s)
    before = probe(targets, netns=g, timeout=1)
    # Without the ruleset every target answers: a missing firewall fails this test.
    assert all(v.startswith("reached:") for v in before.values()), before
    _load(s, ruleset("169.254.48.2", OPEN, FACTS))
    after = probe(targets, netns=g, timeout=1)
    for label, _addr in ALLOWED:
        assert after[label] == "reached:world", after
    blocked = {label for label, v in after.items() if v.startswith("blocked:")}
    assert blocked == {t[0] for t in targets} - {label for label, _ in ALLOWED}, after


@needs_root
def test_ruleset_without_egress_denies_even_the_allow_list(three_namespaces):
    g, s, _ = three_namespaces
    _load(s, ruleset("169.254.48.2", EgressPolicy(), FACTS))
    after = probe(_targets(g, s), netns=g, timeout=1)
    assert all(v.startswith("blocked:") for v in after.values()), after


# --- network.create loads it --------------------------------------------------------------

@needs_root
@pytest.mark.parametrize("allow_egress", [False, True])
def test_create_loads_the_policy_and_sets_host_end_forwarding(allow_egress: bool):
    cfg = NetworkConfig(pool=POOL, allow_egress=allow_egress)
    tag = f"{os.getpid() & 0xffff:04x}{int(allow_egress)}"
    slot = NetSlot(index=9, netns=f"abtest-{tag}", host_if=f"abt{tag}", host_addr="169.254.48.37",
                   guest_addr="169.254.48.38")
    try:
        asyncio.run(network.create(slot, cfg))
        tables = sh("ip", "netns", "exec", slot.netns, "nft", "list", "tables")
        assert "table inet agentbox" in tables and "table ip " not in tables
        rules = sh("ip", "netns", "exec", slot.netns, "nft", "list", "table", "inet", "agentbox")
        assert ("masquerade" in rules) is allow_egress
        forwarding = Path(f"/proc/sys/net/ipv4/conf/{slot.host_if}/forwarding").read_text()
        assert forwarding.strip() == ("1" if allow_egress else "0")
    finally:
        asyncio.run(network.destroy(slot))
    assert slot.netns not in os.listdir(network.NETNS_DIR)
    assert not os.path.exists(f"/sys/class/net/{slot.host_if}")


def test_host_facts_include_this_hosts_addresses():
    slot = network.slot_for(0, "x", NetworkConfig(pool=POOL))
    facts = network.host_facts(slot, POOL)
    assert ipaddress.IPv4Address("127.0.0.1") in facts.addresses
    assert ipaddress.IPv4Address(slot.host_addr) in facts.addresses


@needs_root
def test_reload_replaces_an_old_ip_table_and_switches_policy():
    denied, allowed = NetworkConfig(pool=POOL), NetworkConfig(pool=POOL, allow_egress=True)
    tag = f"{os.getpid() & 0xffff:04x}r"
    slot = NetSlot(index=10, netns=f"abtest-{tag}", host_if=f"abt{tag}", host_addr="169.254.48.41",
                   guest_addr="169.254.48.42")
    try:
        asyncio.run(network.create(slot, denied))
        # What a namespace made by an older daemon holds: an ip-family table of that name.
        sh("ip", "netns", "exec", slot.netns, "nft", "add", "table", "ip", "agentbox")
        sh("ip", "netns", "exec", slot.netns, "nft", "add chain ip agentbox forward "
           "{ type filter hook forward priority 0; policy accept; }")
        asyncio.run(network.reload(slot, allowed))
        tables = sh("ip", "netns", "exec", slot.netns, "nft", "list", "tables")
        assert tables.split("\n").count("table inet agentbox") == 1, tables
        assert "table ip agentbox" not in tables
        rules = sh("ip", "netns", "exec", slot.netns, "nft", "list", "table", "inet", "agentbox")
        assert "masquerade" in rules
        forwarding = Path(f"/proc/sys/net/ipv4/conf/{slot.host_if}/forwarding").read_text()
        assert forwarding.strip() == "1"
    finally:
        asyncio.run(network.destroy(slot))
    assert slot.netns not in os.listdir(network.NETNS_DIR)
