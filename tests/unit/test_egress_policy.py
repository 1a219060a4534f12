"""Per-sandbox egress policies: the wire form, the policy model, the rendered ruleset (checked
by ``nft -c``), the strict DNS parser and the resolver's filtering (with a real UDP upstream
on loopback and the firewall step recorded)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from gateway.http import wire
from gateway.sandbox.egress_policy import egress_view, parse_egress, policy_of
from gateway.errors import BadRequest
from vmctl import dnsfwd, dnsmsg
from vmctl.egress import EgressPolicy, HostFacts, domain_matches, ruleset
from vmctl.network import NetworkConfig

CFG = NetworkConfig(pool="169.254.48.0/24", egress_allow=("10.98.0.0/16",))
FACTS = HostFacts(addresses=(ipaddress.IPv4Address("192.0.2.2"),),
                  pool=ipaddress.IPv4Network("169.254.48.0/24"),
                  holes=(ipaddress.IPv4Network("10.98.0.0/16"),))
needs_nft = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"),
                               reason="needs root and nft")


# --- the wire form ---------------------------------------------------------------------------

def test_presets_and_rules_normalise():
    assert parse_egress("deny_all", CFG) == {"default": "deny", "allow": [], "deny": []}
    assert parse_egress("allow_all", CFG)["default"] == "allow"
    stored = parse_egress({"allow": ["10.98.1.10", "Example.COM.", "*.pypi.org",
                                     "2606:4700::/32"], "deny": ["1.2.3.0/24"]}, CFG)
    assert stored == {"default": "deny", "allow": ["10.98.1.10/32", "2606:4700::/32",
                                                   "example.com", "*.pypi.org"],
                      "deny": ["1.2.3.0/24"]}
    policy = policy_of(stored, CFG)
    assert policy.allow_domains == ("example.com", "*.pypi.org")
    assert policy.deny == (ipaddress.ip_network("1.2.3.0/24"),)


@pytest.mark.parametrize("value, message", [
    ("open", "not one of"), (5, "must be"), ({"default": "maybe"}, "'default'"),
    ({"nope": []}, "unknown field"), ({"allow": "10.98.0.0/16"}, "must be a list"),
    ({"allow": ["10.98.1.1/16"]}, "host bits"), ({"allow": ["169.254.169.254"]}, "never"),
    ({"allow": ["127.0.0.1"]}, "never"), ({"allow": ["::1"]}, "never"),
    ({"allow": ["fe80::/64"]}, "never"), ({"allow": ["192.168.0.0/16"]}, "does not open"),
    ({"allow": ["fd10::/16"]}, "does not open"), ({"allow": ["exa mple.com"]}, "domain"),
    ({"allow": ["-bad.com"]}, "domain"), ({"allow": ["a.*.com"]}, "domain"),
    ({"allow": ["x" * 254]}, "domain"), ({"allow": ["x"] * 65}, "at most"),
    ({"allow": [""]}, "non-empty"), ({"allow": [7]}, "non-empty"),
])
def test_bad_policies_are_400_invalid_egress(value, message):
    with pytest.raises(BadRequest, match=message) as info:
        parse_egress(value, CFG)
    assert info.value.code == "invalid_egress"


def test_a_sandbox_without_a_policy_follows_the_host_default():
    assert policy_of(None, CFG) == CFG.egress_policy() == EgressPolicy()
    host = NetworkConfig(allow_egress=True, egress_allow=("10.98.0.0/16",))
    assert wire.encode(egress_view(None, host)) == {
        "default": "allow", "allow": ["10.98.0.0/16"], "deny": [], "source": "host"}
    assert egress_view({"default": "deny", "allow": [], "deny": []}).source == "sandbox"
    assert wire.encode(egress_view(None)) == {"source": "host"}  # omitted, not null


# --- the policy model ------------------------------------------------------------------------

def test_domain_rules():
    assert domain_matches("example.com", "example.com")
    assert not domain_matches("www.example.com", "example.com")
    assert domain_matches("a.b.example.com", "*.example.com")
    assert not domain_matches("example.com", "*.example.com")
    assert not domain_matches("badexample.com", "*.example.com")
    p = EgressPolicy(allow_domains=("*.example.com", "ok.test"), deny_domains=("x.example.com",))
    assert p.name_allowed("ok.test") and p.learns("ok.test")
    assert p.name_allowed("a.example.com") and not p.name_allowed("x.example.com")
    assert not p.name_allowed("other.test")
    everything = EgressPolicy(allow_egress=True, deny_domains=("ads.test",))
    assert everything.name_allowed("any.test") and not everything.learns("any.test")
    assert not everything.name_allowed("ads.test")


# --- the rendered ruleset --------------------------------------------------------------------

def _forward(text: str) -> list[str]:
    chain = text[text.index("chain forward"):]
    return [ln.strip() for ln in chain.splitlines() if 'iifname "tap0" oifname' in ln]


def test_deny_all_has_no_egress_but_the_resolver_is_reachable():
    text = ruleset("169.254.48.2", EgressPolicy(), FACTS)
    assert not _forward(text) and "masquerade" not in text
    assert 'iifname "tap0" ip daddr 169.254.0.22 meta l4proto { udp, tcp } th dport 53 accept' \
        in text


def test_rule_order_never_opens_the_host_and_deny_beats_allow():
    policy = policy_of(parse_egress({"allow": ["10.98.1.10", "2606:4700::/32", "ok.test"],
                                     "deny": ["10.98.1.0/24", "2606:4700:1::/48"]}, CFG), CFG)
    rules = _forward(ruleset("169.254.48.2", policy, FACTS))
    names = [r.split("@")[1].split()[0] for r in rules]
    assert names == ["always_denied4", "always_denied6", "deny4", "deny6", "allowed4",
                     "allowed6", "dns4", "dns6", "dns4"]
    assert rules[-1].endswith("ip daddr @holes4 accept")  # learned + operator's hole
    assert "!= @default_denied4 accept" in rules[6]  # learned private addresses stay shut
    assert not any(r.endswith('oifname "veth0" accept') for r in rules)  # default deny


def test_allow_all_opens_the_holes_and_drops_private_ranges_last():
    rules = _forward(ruleset("169.254.48.2", EgressPolicy(allow_egress=True), FACTS))
    assert rules[-4:] == [
        'iifname "tap0" oifname "veth0" ip daddr @holes4 accept',
        'iifname "tap0" oifname "veth0" ip daddr @default_denied4 drop',
        'iifname "tap0" oifname "veth0" ip6 daddr @default_denied6 drop',
        'iifname "tap0" oifname "veth0" accept']


@needs_nft
@pytest.mark.parametrize("egress", ["deny_all", "allow_all", {
    "allow": ["10.98.1.10", "2606:4700::/32", "ok.test", "*.w.test"],
    "deny": ["8.8.8.8", "2001:4860::/32", "ads.test"]}, {"default": "allow", "deny": ["1.1.1.1"]}])
def test_rendered_rulesets_pass_nft_check(tmp_path: Path, egress):
    path = tmp_path / "rules.nft"
    path.write_text(ruleset("169.254.48.2", policy_of(parse_egress(egress, CFG), CFG), FACTS))
    proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- the DNS parser --------------------------------------------------------------------------

def query(name: str, qtype: int = 1, qid: int = 0x1234, flags: int = 0x0100,
          ar: int = 0) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, flags, 1, 0, 0, ar) + qname + struct.pack("!HH", qtype, 1)


def reply(q: bytes, addrs: list[str], ttl: int = 300, rcode: int = 0) -> bytes:
    answers = b""
    for a in addrs:
        ip = ipaddress.ip_address(a)
        answers += struct.pack("!HHHIH", 0xC00C, 1 if ip.version == 4 else 28, 1, ttl,
                               len(ip.packed)) + ip.packed
    qid = q[:2]
    return qid + struct.pack("!HHHHH", 0x8180 | rcode, 1, len(addrs), 0, 0) + q[12:] + answers


def test_a_query_parses_and_the_refusal_echoes_it():
    q = query("Ok.Test")
    parsed = dnsmsg.parse_query(q)
    assert (parsed.id, parsed.name, parsed.qtype, parsed.end) == (0x1234, "ok.test", 1, len(q))
    r = dnsmsg.error_reply(q, parsed, dnsmsg.NXDOMAIN)
    assert r[:2] == q[:2] and dnsmsg.rcode(r) == dnsmsg.NXDOMAIN and r[12:] == q[12:]
    assert struct.unpack("!H", r[2:4])[0] & 0x8100 == 0x8100  # a reply, RD echoed


@pytest.mark.parametrize("data", [
    b"", b"\0" * 11, query("a.test", flags=0x8100), query("a.test", flags=0x2900),
    query("a.test")[:-1], query("a.test", ar=2), b"\x12\x34\x01\x00\x00\x02" + b"\0" * 6,
    query("a.test")[:12] + b"\xc0\x0c\x00\x01\x00\x01",  # a pointer in a question
    query("a\x00b.test"), query("a b.test"), query("x" * 64 + ".test"),
    query("a.test")[:-2] + b"\x00\x03",  # class CH
    query("a.test") + b"\0" * 600,
])
def test_malformed_queries_are_refused(data):
    with pytest.raises(dnsmsg.DnsError):
        dnsmsg.parse_query(data)


def test_the_parsers_never_fail_otherwise():
    """Random bytes and mutated real messages: DnsError or a result, nothing else."""
    rng = random.Random(13)
    parsed = dnsmsg.parse_query(query("a.test"))
    seeds = [query("a.test"), reply(query("a.test"), ["1.2.3.4", "2001:db8::1"])]
    for _ in range(3000):
        data = bytearray(rng.choice(seeds)) if rng.random() < 0.7 else bytearray(
            rng.randbytes(rng.randrange(0, 600)))
        for _ in range(rng.randrange(1, 4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data[:rng.randrange(len(data) + 1)] if rng.random() < 0.3 else data)
        for fn in (dnsmsg.parse_query, lambda d: dnsmsg.answer_addresses(d, parsed)):
            try:
                fn(data)
            except dnsmsg.DnsError:
                pass


def test_answers_give_addresses_and_ttls_and_must_match_the_query():
    q = query("ok.test")
    parsed = dnsmsg.parse_query(q)
    assert dnsmsg.answer_addresses(reply(q, ["198.51.100.1", "2001:db8::1"], 77), parsed) == [
        ("198.51.100.1", 77), ("2001:db8::1", 77)]
    with pytest.raises(dnsmsg.DnsError):
        dnsmsg.answer_addresses(reply(query("ok.test", qid=9), ["1.2.3.4"]), parsed)
    with pytest.raises(dnsmsg.DnsError):
        dnsmsg.answer_addresses(reply(q, ["1.2.3.4"])[:-2], parsed)


def test_upstream_config():
    assert dnsfwd.upstream_from("192.0.2.53") == ("192.0.2.53", 53)
    assert dnsfwd.upstream_from("192.0.2.53:5353") == ("192.0.2.53", 5353)
    assert dnsfwd.upstream_from("[2001:db8::53]:54") == ("2001:db8::53", 54)
    with pytest.raises(ValueError):
        NetworkConfig(dns_upstream="nonsense")


def test_upstream_defaults_to_resolv_conf(tmp_path: Path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nsearch a\nnameserver 10.255.255.53\nnameserver 1.1.1.1\n")
    assert dnsfwd.upstream_from("", conf) == ("10.255.255.53", 53)


# --- the resolver's filtering ----------------------------------------------------------------

class FakeUpstream(asyncio.DatagramProtocol):
    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names, self.asked = names, []

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        self.transport = transport

    def datagram_received(self, data: bytes, addr):  # type: ignore[no-untyped-def]
        name = dnsmsg.parse_query(data).name
        self.asked.append(name)
        self.transport.sendto(reply(data, self.names.get(name, []), ttl=5), addr)


async def _resolver(policy: EgressPolicy, names: dict[str, list[str]]):
    loop = asyncio.get_running_loop()
    transport, upstream = await loop.create_datagram_endpoint(
        lambda: FakeUpstream(names), local_addr=("127.0.0.1", 0))
    resolver = dnsfwd.Resolver(transport.get_extra_info("sockname"))
    learned: list[tuple[str, list[tuple[str, int]]]] = []

    async def learn(netns, found):  # type: ignore[no-untyped-def]
        learned.append((netns, found))

    resolver._learn = learn  # type: ignore[method-assign]
    box = dnsfwd._Sandbox("agentbox-x", policy)
    return resolver, box, upstream, learned, transport


def test_the_resolver_answers_only_allowed_names_and_learns_their_addresses():
    async def main() -> None:
        policy = EgressPolicy(allow_domains=("ok.test", "*.w.test"))
        names = {"ok.test": ["198.51.100.1"], "bad.test": ["198.51.100.2"],
                 "a.w.test": ["198.51.100.3"]}
        resolver, box, upstream, learned, transport = await _resolver(policy, names)
        try:
            ok = await resolver.answer(box, query("ok.test"), tcp=False)
            assert ok is not None and dnsmsg.rcode(ok) == 0
            bad = await resolver.answer(box, query("bad.test"), tcp=False)
            assert bad is not None and dnsmsg.rcode(bad) == dnsmsg.NXDOMAIN
            await resolver.answer(box, query("a.w.test"), tcp=False)
            assert await resolver.answer(box, b"garbage", tcp=False) is None
            assert upstream.asked == ["ok.test", "a.w.test"]  # bad.test never left
            # a zero/short TTL is kept as given here; the nft step applies MIN_TTL
            assert learned == [("agentbox-x", [("198.51.100.1", 5)]),
                               ("agentbox-x", [("198.51.100.3", 5)])]
            box.policy = EgressPolicy()  # a PATCH to deny_all: the next query is refused
            again = await resolver.answer(box, query("ok.test"), tcp=False)
            assert again is not None and dnsmsg.rcode(again) == dnsmsg.NXDOMAIN
        finally:
            transport.close()
            await resolver.aclose()

    asyncio.run(main())


def test_an_unreachable_upstream_is_servfail_in_bounded_time(monkeypatch):
    monkeypatch.setattr(dnsfwd, "UPSTREAM_TIMEOUT", 0.3)

    async def main() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
            silent.bind(("127.0.0.1", 0))  # receives, never answers
            resolver = dnsfwd.Resolver(silent.getsockname())
            box = dnsfwd._Sandbox("agentbox-y", EgressPolicy(allow_egress=True))
            r = await resolver.answer(box, query("any.test"), tcp=False)
            assert r is not None and dnsmsg.rcode(r) == dnsmsg.SERVFAIL

    asyncio.run(main())


# --- the CLI's options ---------------------------------------------------------------------

def test_cli_options_make_the_wire_form():
    import argparse

    from agentbox import _cli_egress

    parser = argparse.ArgumentParser()
    _cli_egress.add_rule_options(parser)
    assert _cli_egress.policy(parser.parse_args([])) is None
    assert _cli_egress.policy(parser.parse_args(["--egress", "allow_all"])) == "allow_all"
    got = _cli_egress.policy(parser.parse_args(["--allow", "pypi.org", "--allow", "1.2.3.4",
                                                "--deny", "*.ads.test"]))
    assert got == {"default": "deny", "allow": ["pypi.org", "1.2.3.4"], "deny": ["*.ads.test"]}
    assert parse_egress(got, CFG)["allow"] == ["1.2.3.4/32", "pypi.org"]


# --- learned addresses land in the namespace's sets, with the TTL ----------------------------

@needs_nft
def test_learned_addresses_enter_the_sets_with_their_ttl_as_timeout():
    ns = f"abtdns{os.getpid()}"
    policy = EgressPolicy(allow_domains=("ok.test",))
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        text = ruleset("169.254.48.2", policy, FACTS)
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text.encode(),
                       check=True)
        resolver = dnsfwd.Resolver(("127.0.0.1", 53))
        asyncio.run(resolver._learn(ns, [("198.51.100.1", 5), ("2001:db8::1", 4000)]))
        asyncio.run(resolver._learn(ns, [("198.51.100.1", 600), ("198.51.100.2", 0)]))

        def listed(name: str) -> str:
            return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "set", "inet",
                                   "agentbox", name], capture_output=True, text=True,
                                  check=True).stdout

        v4, v6 = listed("dns4"), listed("dns6")
        assert "198.51.100.1 timeout 10m" in v4, v4  # refreshed to the later answer's TTL
        assert "198.51.100.2 timeout 30s" in v4, v4  # MIN_TTL
        assert "2001:db8::1 timeout 1h6m40s" in v6, v6
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
