"""What a guest may send, as an nftables ruleset for its sandbox's namespace.

Theory of operation. A sandbox's namespace sits between the guest (TAP ``tap0``) and the
host (veth ``veth0``). Everything the guest sends crosses this namespace, so the ruleset
here is the whole of the guest's network policy. This module is pure (no I/O): a policy
(the sandbox's own, or the operator's default), the host's facts (its own addresses,
discovered at set-up by ``vmctl.network``, and the operator's ``egress_allow`` holes) and
the slot go in; ruleset text comes out. The sets ``dns4``/``dns6`` start empty: the
sandbox's resolver (``vmctl.dnsfwd``) fills them with the addresses of allowed names.

The guest-facing rules, in the order a packet meets them:
1. *prerouting, before conntrack* (priority raw): a packet from the TAP whose source is not
   the guest's fixed address is dropped (no spoofing, not even a conntrack entry), and so is
   every IPv6 packet from the TAP (IPv6 egress is not implemented: denied outright, which
   also keeps the namespace's and the host's link-local addresses out of reach).
2. *input*: the guest can never open anything to the namespace itself, except its resolver
   (``TAP_ADDR``:53, a socket the daemon holds in the namespace).
3. *forward*: replies to connections the host opened to the guest pass; with nothing
   allowed nothing else leaves. Otherwise destinations are checked in tiers: always denied
   (the host's own addresses, the sandbox pool, loopback, link-local, cloud metadata: no rule
   opens them), the policy's ``deny`` CIDRs, its ``allow`` CIDRs, the addresses its resolver
   learned (outside the private ranges, or inside the operator's holes); then, for a
   default-allow policy, the holes, ``DEFAULT_DENIED_V4``/``_V6`` (private, CGNAT,
   documentation, multicast and reserved ranges: dropped) and whatever is left (the public
   internet: accepted). What leaves is masqueraded to the slot's address.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from guest.protocol import GUEST_ADDR, PREFIX_LEN, TAP_ADDR, TAP_NAME

NS_IF = "veth0"
TABLE = "agentbox"

IPv4Net = ipaddress.IPv4Network
IPNet = ipaddress.IPv4Network | ipaddress.IPv6Network

# Documented cloud metadata / host-service addresses. Never reachable from a guest: they hand
# out the host's credentials. (IPv6 ones, e.g. AWS fd00:ec2::254, are covered by "no IPv6".)
METADATA_V4 = (
    "169.254.169.254/32",  # AWS, GCP, Azure IMDS, OpenStack, DigitalOcean, Oracle, Hetzner
    "169.254.170.2/32",  # AWS ECS task metadata / credentials
    "169.254.169.123/32",  # AWS time sync
    "169.254.0.23/32",  # Tencent Cloud metadata
    "100.100.100.200/32",  # Alibaba Cloud metadata
    "192.0.0.192/32",  # Oracle Cloud metadata
    "168.63.129.16/32",  # Azure WireServer (a public address)
)
METADATA_V6 = ("fd00:ec2::254/128", "fd00:ec2::253/128", "fd00:ec2::123/128")

# The host's side of every link: loopback and link-local (every sandbox pool, the guest's own
# link, most metadata services). Never opened, so an allow-list entry overlapping them is refused.
NEVER_ALLOWED_V4 = ("127.0.0.0/8", "169.254.0.0/16")

# Not the public internet (IANA special-purpose registry, RFC 6890 and friends). Denied unless
# the allow-list punches a hole.
DEFAULT_DENIED_V4 = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",  # CGNAT shared space (RFC 6598)
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24",  # documentation (TEST-NET-1..3)
    "192.88.99.0/24",  # 6to4 relay anycast
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and 255.255.255.255 broadcast
)


def _v4(cidr: str) -> IPv4Net:
    net = ipaddress.ip_network(cidr, strict=True)
    if not isinstance(net, IPv4Net):
        raise ValueError(f"{cidr}: IPv6 egress is not supported (all IPv6 is denied)")
    return net


MAX_RULES = 64  # per list (CIDRs and domains each): a tenant's input, bounded
MAX_DOMAIN = 253
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")

# IPv6 a guest never reaches (loopback, link-local, metadata) and ranges denied by default.
NEVER_ALLOWED_V6 = ("::1/128", "::/128", "fe80::/10", *METADATA_V6)
DEFAULT_DENIED_V6 = ("fc00::/7", "ff00::/8", "2001:db8::/32", "::ffff:0:0/96", "64:ff9b::/96",
                     "100::/64", "2001::/23")


def parse_cidr(text: str) -> IPNet:
    """A CIDR (or a bare address, as /32 or /128) with no host bits, never a range a guest
    may never reach."""
    if not isinstance(text, str) or not 0 < len(text) <= 64:
        raise ValueError(f"not a CIDR: {str(text)[:64]!r}")
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"not a CIDR: {text!r} ({exc})") from exc
    never = NEVER_ALLOWED_V4 if net.version == 4 else NEVER_ALLOWED_V6
    for bad in map(ipaddress.ip_network, never):
        if net.overlaps(bad):
            raise ValueError(f"{net} overlaps {bad}, which a guest never reaches")
    return net


def parse_domain(text: str) -> str:
    """A domain name rule: ``example.com`` (that name) or ``*.example.com`` (any name under
    it, not the name itself). Lower-cased, no trailing dot."""
    if not isinstance(text, str) or not 0 < len(text) <= MAX_DOMAIN:
        raise ValueError(f"not a domain name: {str(text)[:64]!r}")
    name = text.lower().rstrip(".")
    labels = name.split(".")
    if labels[0] == "*":
        labels = labels[1:]
    if len(labels) < 1 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"not a domain name (or *.domain): {text!r}")
    return name


def domain_matches(name: str, rule: str) -> bool:
    """``name`` (lower-case, no trailing dot) matches ``rule`` (see ``parse_domain``)."""
    if rule.startswith("*."):
        return name.endswith(rule[1:])
    return name == rule


@dataclass(frozen=True)
class EgressPolicy:
    """What one sandbox's guest may open connections to.

    ``allow_egress``: the default for what no rule names (``deny_all``: False, ``allow_all``:
    True). ``deny`` is checked before ``allow``; both hold CIDRs (IPv4 and IPv6).
    ``allow_domains`` / ``deny_domains`` act at the sandbox's resolver
    (``vmctl.dnsfwd``): only names it lets through resolve, and the addresses of an
    allowed name become reachable for the answer's TTL. No rule ever opens the host's
    addresses, the pool, loopback, link-local or metadata addresses; the private ranges
    (``DEFAULT_DENIED_V4``) open only through ``allow`` or ``HostFacts.holes``.
    """

    allow_egress: bool = False
    allow: tuple[IPNet, ...] = ()
    deny: tuple[IPNet, ...] = ()
    allow_domains: tuple[str, ...] = ()
    deny_domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("allow", "deny"):
            nets = tuple(n if isinstance(n, (IPv4Net, ipaddress.IPv6Network))
                         else parse_cidr(str(n)) for n in getattr(self, name))
            if len(nets) > MAX_RULES:
                raise ValueError(f"at most {MAX_RULES} {name} CIDRs")
            for net in nets:
                parse_cidr(str(net))
            object.__setattr__(self, name, nets)
        for name in ("allow_domains", "deny_domains"):
            domains = tuple(parse_domain(d) for d in getattr(self, name))
            if len(domains) > MAX_RULES:
                raise ValueError(f"at most {MAX_RULES} {name}")
            object.__setattr__(self, name, domains)

    @classmethod
    def from_config(cls, allow_egress: bool, egress_allow: Iterable[str]) -> EgressPolicy:
        """The host-wide default: everyone's policy when a sandbox names none."""
        return cls(allow_egress=allow_egress,
                   allow=tuple(_v4(c) for c in egress_allow) if allow_egress else ())

    def name_allowed(self, name: str) -> bool:
        """Whether the sandbox's resolver answers for ``name``."""
        if any(domain_matches(name, r) for r in self.deny_domains):
            return False
        return self.allow_egress or any(domain_matches(name, r) for r in self.allow_domains)

    def learns(self, name: str) -> bool:
        """Whether the addresses ``name`` resolves to are opened (an allowed-domain rule)."""
        return self.name_allowed(name) and any(domain_matches(name, r)
                                               for r in self.allow_domains)

    @property
    def guest_egress(self) -> bool:
        """Whether anything at all may leave (else no forward rules, no NAT)."""
        return bool(self.allow_egress or self.allow or self.allow_domains)


@dataclass(frozen=True)
class HostFacts:
    """What is true of the host when a namespace is set up (discovered, not configured),
    plus ``holes``: the private ranges the operator lets policies open (``egress_allow``)."""

    addresses: tuple[ipaddress.IPv4Address, ...]  # every IPv4 address the host holds
    pool: IPv4Net  # every sandbox's slot lives here
    holes: tuple[IPv4Net, ...] = ()

    def always_denied(self) -> list[IPv4Net]:
        nets = [ipaddress.ip_network(f"{a}/32") for a in self.addresses]
        nets += [self.pool, ipaddress.ip_network(f"{TAP_ADDR}/{PREFIX_LEN}", strict=False)]
        nets += [ipaddress.ip_network(n) for n in NEVER_ALLOWED_V4]
        nets += [ipaddress.ip_network(m) for m in METADATA_V4]
        return _collapse(nets)


def _collapse(nets: Iterable[ipaddress._BaseNetwork], version: int = 4) -> list[IPNet]:
    # nft refuses overlapping interval elements, and fewer elements are faster to load.
    return list(ipaddress.collapse_addresses(n for n in nets if n.version == version))


def _set(name: str, nets: list[IPNet], version: int = 4) -> str:
    if not nets:
        return ""
    elements = ", ".join(str(n) for n in nets)
    kind = "ipv4_addr" if version == 4 else "ipv6_addr"
    return f"  set {name} {{ type {kind}; flags interval; elements = {{ {elements} }} }}\n"


# The resolver's learned addresses (vmctl.dnsfwd adds them with the answer's TTL).
DNS_SETS = {4: "dns4", 6: "dns6"}
_DNS_SETS = ("  set dns4 { type ipv4_addr; flags timeout; size 4096; }\n"
             "  set dns6 { type ipv6_addr; flags timeout; size 4096; }\n")


def _egress_rules(policy: EgressPolicy, facts: HostFacts) -> tuple[str, str, str]:
    """(sets, forward rules, postrouting rules) for guest-initiated traffic."""
    if not policy.guest_egress:
        return "", "", ""
    ip = {4: "ip", 6: "ip6"}
    lists = {
        "always_denied": {4: facts.always_denied(),
                          6: _collapse(map(ipaddress.ip_network, NEVER_ALLOWED_V6), 6)},
        "deny": {v: _collapse(policy.deny, v) for v in (4, 6)},
        "allowed": {v: _collapse(policy.allow, v) for v in (4, 6)},
        "default_denied": {4: _collapse(map(ipaddress.ip_network, DEFAULT_DENIED_V4)),
                           6: _collapse(map(ipaddress.ip_network, DEFAULT_DENIED_V6), 6)},
        "holes": {4: _collapse(facts.holes), 6: []},
    }
    sets = _DNS_SETS + "".join(_set(f"{name}{v}", nets[v], v)
                               for name, nets in lists.items() for v in (4, 6))
    out = f'iifname "{TAP_NAME}" oifname "{NS_IF}"'
    forward: list[str] = []

    def each(name: str, verdict: str) -> None:
        forward.extend(f"{out} {ip[v]} daddr @{name}{v} {verdict}" for v in (4, 6)
                       if lists[name][v])

    each("always_denied", "drop")
    each("deny", "drop")
    each("allowed", "accept")
    # A name's addresses open only outside the private ranges (or inside the operator's
    # holes): an allowed domain that resolves to 10.0.0.1 must not open the host's LAN.
    for v in (4, 6):
        forward.append(f"{out} {ip[v]} daddr @{DNS_SETS[v]} {ip[v]} daddr != "
                       f"@default_denied{v} accept")
    if lists["holes"][4]:
        forward.append(f"{out} ip daddr @dns4 ip daddr @holes4 accept")
    if policy.allow_egress:
        each("holes", "accept")  # as the host-wide allow_egress + egress_allow always did
        each("default_denied", "drop")
        forward.append(f"{out} accept")
    masq = f'oifname "{NS_IF}" ip saddr {GUEST_ADDR} masquerade'
    return sets, "\n    ".join(forward), masq


def ruleset(guest_addr: str, policy: EgressPolicy, facts: HostFacts) -> str:
    """The namespace's whole ruleset. ``guest_addr``: the slot address the host connects to
    (DNAT'ed to the guest). Loaded with ``nft -f``; it replaces our table atomically."""
    sets, forward, masq = _egress_rules(policy, facts)
    # "add table" + "delete table" makes a reload idempotent (the table may or may not exist);
    # the same for the ip-only table namespaces made before this module had.
    return f"""add table inet {TABLE}
delete table inet {TABLE}
add table ip {TABLE}
delete table ip {TABLE}
table inet {TABLE} {{
{sets}  chain guard {{
    type filter hook prerouting priority raw; policy accept;
    iifname "{TAP_NAME}" meta nfproto ipv6 drop
    iifname "{TAP_NAME}" ip saddr != {GUEST_ADDR} drop
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{NS_IF}" ip daddr {guest_addr} dnat ip to {GUEST_ADDR}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    {masq}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{TAP_NAME}" ip daddr {TAP_ADDR} meta l4proto {{ udp, tcp }} th dport 53 accept
    iifname "{TAP_NAME}" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "{NS_IF}" oifname "{TAP_NAME}" ip daddr {GUEST_ADDR} accept
    {forward}
  }}
}}
"""
