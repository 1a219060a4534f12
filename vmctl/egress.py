"""What a guest may send, as an nftables ruleset for its sandbox's namespace.

Theory of operation. A sandbox's namespace sits between the guest (TAP ``tap0``) and the
host (veth ``veth0``). Everything the guest sends crosses this namespace, so the ruleset
here is the whole of the guest's network policy. This module is pure (no I/O): a policy
(what the operator or, later, the tenant allows), the host's facts (its own addresses,
discovered at set-up by ``vmctl.network``) and the slot go in; ruleset text comes out.

The guest-facing rules, in the order a packet meets them:
1. *prerouting, before conntrack* (priority raw): a packet from the TAP whose source is not
   the guest's fixed address is dropped (no spoofing, not even a conntrack entry), and so is
   every IPv6 packet from the TAP (IPv6 egress is not implemented: denied outright, which
   also keeps the namespace's and the host's link-local addresses out of reach).
2. *input*: the guest can never open anything to the namespace itself.
3. *forward*: replies to connections the host opened to the guest pass; with egress
   disallowed nothing else leaves. With egress allowed, destinations are checked in three
   tiers: always denied (the host's own addresses, the sandbox pool, loopback, link-local,
   cloud metadata: no allow-list entry opens them), then the allow-list (holes punched by the
   operator), then ``DEFAULT_DENIED_V4`` (private, CGNAT, documentation,
   multicast and reserved ranges); whatever is left (the public internet) is accepted and
   masqueraded to the slot's address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from guest.protocol import GUEST_ADDR, PREFIX_LEN, TAP_ADDR, TAP_NAME

NS_IF = "veth0"
TABLE = "agentbox"

IPv4Net = ipaddress.IPv4Network

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


@dataclass(frozen=True)
class EgressPolicy:
    """What one sandbox's guest may open connections to.

    Today built from ``[network]`` (``from_config``); per-sandbox policies (issue 13) build
    one per sandbox. ``allow`` only opens ``DEFAULT_DENIED_V4`` ranges: it never opens the
    host's addresses, the pool, loopback, link-local or metadata addresses.
    """

    allow_egress: bool = False
    allow: tuple[IPv4Net, ...] = ()

    def __post_init__(self) -> None:
        nets = tuple(n if isinstance(n, IPv4Net) else _v4(str(n)) for n in self.allow)
        object.__setattr__(self, "allow", nets)
        for net in nets:
            for never in map(ipaddress.ip_network, NEVER_ALLOWED_V4):
                if net.overlaps(never):
                    raise ValueError(f"{net} overlaps {never}, which a guest never reaches")
        if nets and not self.allow_egress:
            raise ValueError("an egress allow-list needs allow_egress = true")

    @classmethod
    def from_config(cls, allow_egress: bool, egress_allow: Iterable[str]) -> EgressPolicy:
        return cls(allow_egress=allow_egress, allow=tuple(_v4(c) for c in egress_allow))


@dataclass(frozen=True)
class HostFacts:
    """What is true of the host when a namespace is set up (discovered, not configured)."""

    addresses: tuple[ipaddress.IPv4Address, ...]  # every IPv4 address the host holds
    pool: IPv4Net  # every sandbox's slot lives here

    def always_denied(self) -> list[IPv4Net]:
        nets = [ipaddress.ip_network(f"{a}/32") for a in self.addresses]
        nets += [self.pool, ipaddress.ip_network(f"{TAP_ADDR}/{PREFIX_LEN}", strict=False)]
        nets += [ipaddress.ip_network(n) for n in NEVER_ALLOWED_V4]
        nets += [ipaddress.ip_network(m) for m in METADATA_V4]
        return _collapse(nets)


def _collapse(nets: Iterable[ipaddress._BaseNetwork]) -> list[IPv4Net]:
    # nft refuses overlapping interval elements, and fewer elements are faster to load.
    return list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, IPv4Net)))


def _set(name: str, nets: list[IPv4Net]) -> str:
    if not nets:
        return ""
    elements = ", ".join(str(n) for n in nets)
    return f"  set {name} {{ type ipv4_addr; flags interval; elements = {{ {elements} }} }}\n"


def _egress_rules(policy: EgressPolicy, facts: HostFacts) -> tuple[str, str, str]:
    """(sets, forward rules, postrouting rules) for guest-initiated traffic."""
    if not policy.allow_egress:
        return "", "", ""
    allowed = _collapse(policy.allow)
    sets = (_set("always_denied", facts.always_denied()) + _set("allowed", allowed)
            + _set("default_denied", _collapse(ipaddress.ip_network(c) for c in DEFAULT_DENIED_V4)))
    out = f'iifname "{TAP_NAME}" oifname "{NS_IF}"'
    forward = [f"{out} ip daddr @always_denied drop"]
    if allowed:
        forward.append(f"{out} ip daddr @allowed accept")
    forward += [f"{out} ip daddr @default_denied drop", f"{out} meta nfproto ipv4 accept"]
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
