"""A sandbox's egress policy on the wire: parsing the tenant's JSON, storing it, showing it.

Wire form (``POST /v1/sandboxes`` and ``PATCH /v1/sandboxes/{id}``, field ``egress``)::

    "deny_all" | "allow_all" |
    {"default": "deny" | "allow", "allow": [RULE, ...], "deny": [RULE, ...]}

A RULE is a CIDR or address (IPv4 or IPv6) or a domain name (``example.com``, or
``*.example.com`` for every name under it). ``deny`` wins over ``allow``; what neither names
gets ``default``. Domain rules act at the sandbox's resolver (vmctl.dnsfwd). The registry
stores the normalised object; a sandbox with none stored follows the host's default
(``[network] allow_egress`` / ``egress_allow``), shown as such in ``GET``.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from gateway.http import wire
from gateway.errors import BadRequest
from vmctl import egress
from vmctl.egress import EgressPolicy
from vmctl.network import NetworkConfig

PRESETS = {"deny_all": "deny", "allow_all": "allow"}


def _bad(message: str) -> BadRequest:
    return BadRequest(f"egress: {message}", code="invalid_egress")


def _is_cidr(rule: str) -> bool:
    # A domain name never holds ':' and is never digits and dots only.
    return ":" in rule or all(c in "0123456789./" for c in rule)


def _split(rules: Any, field: str) -> tuple[list[str], list[str]]:
    """(CIDRs, domains) of one rule list, validated."""
    if not isinstance(rules, list):
        raise _bad(f"'{field}' must be a list of CIDRs and domain names")
    if len(rules) > egress.MAX_RULES:
        raise _bad(f"'{field}' holds at most {egress.MAX_RULES} rules")
    cidrs, domains = [], []
    for rule in rules:
        if not isinstance(rule, str) or not rule:
            raise _bad(f"'{field}' entries must be non-empty strings")
        try:
            if _is_cidr(rule):
                cidrs.append(str(egress.parse_cidr(rule)))
            else:
                domains.append(egress.parse_domain(rule))
        except ValueError as exc:
            raise _bad(f"{field}: {exc}") from exc
    return cidrs, domains


def parse_egress(value: Any, config: NetworkConfig) -> dict[str, Any]:
    """The normalised, stored form of a tenant's ``egress`` value (400 ``invalid_egress``)."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise _bad(f"{value[:40]!r} is not one of {', '.join(PRESETS)} or a rule object")
        value = {"default": PRESETS[value]}
    if not isinstance(value, dict):
        raise _bad("must be 'deny_all', 'allow_all' or an object")
    unknown = set(value) - {"default", "allow", "deny"}
    if unknown:
        raise _bad(f"unknown field(s) {', '.join(sorted(unknown))[:100]}")
    default = value.get("default", "deny")
    if default not in ("deny", "allow"):
        raise _bad("'default' must be 'deny' or 'allow'")
    stored: dict[str, Any] = {"default": default}
    for field in ("allow", "deny"):
        cidrs, domains = _split(value.get(field, []), field)
        stored[field] = cidrs + domains
    _check_private(stored["allow"], config)
    policy_of(stored, config)  # whatever EgressPolicy refuses is a 400 too
    return stored


def _check_private(rules: list[str], config: NetworkConfig) -> None:
    """An allowed CIDR in a private range must lie in a range the operator opened."""
    holes = config.holes()
    denied = [ipaddress.ip_network(n) for n in (*egress.DEFAULT_DENIED_V4,
                                                *egress.DEFAULT_DENIED_V6)]
    for rule in rules:
        if not _is_cidr(rule):
            continue
        net = ipaddress.ip_network(rule)
        inside_hole = any(net.version == h.version and net.subnet_of(h)  # type: ignore[arg-type]
                          for h in holes)
        if not inside_hole and any(net.version == d.version and net.overlaps(d)  # type: ignore[arg-type]
                                   for d in denied):
            raise _bad(f"{rule} is in a private or reserved range this host does not open "
                       "(network.egress_allow)")


def policy_of(stored: dict[str, Any] | None, config: NetworkConfig) -> EgressPolicy:
    """The policy a sandbox runs under (its own, else the host's default)."""
    if stored is None:
        return config.egress_policy()
    nets: dict[str, list[str]] = {"allow": [], "deny": []}
    names: dict[str, list[str]] = {"allow": [], "deny": []}
    for field in ("allow", "deny"):
        for rule in stored.get(field, []):
            (nets if _is_cidr(rule) else names)[field].append(rule)
    try:
        return EgressPolicy(
            allow_egress=stored.get("default") == "allow",
            allow=tuple(egress.parse_cidr(c) for c in nets["allow"]),
            deny=tuple(egress.parse_cidr(c) for c in nets["deny"]),
            allow_domains=tuple(names["allow"]), deny_domains=tuple(names["deny"]))
    except ValueError as exc:
        raise _bad(str(exc)) from exc


def egress_view(stored: dict[str, Any] | None,
                config: NetworkConfig | None = None) -> wire.Egress:
    """What ``GET`` shows: the sandbox's policy, or the host default it follows (spelled out
    when ``config`` is given)."""
    if stored is not None:
        return wire.Egress(default=stored.get("default"), allow=stored.get("allow"),
                           deny=stored.get("deny"), source="sandbox")
    if config is None:
        return wire.Egress(source="host")
    return wire.Egress(default="allow" if config.allow_egress else "deny",
                       allow=list(config.egress_allow) if config.allow_egress else [],
                       deny=[], source="host")
