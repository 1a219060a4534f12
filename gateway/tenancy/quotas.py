"""Per-key (tenant) limits: what they are, how a key's overrides combine with the
config's defaults, and the quota decisions. No I/O: the caller measures usage.

Theory of operation
-------------------
``[tenancy]`` in the config gives every non-admin key the same defaults (``Limits``;
admin keys start unlimited); a key
may carry overrides (``agentbox-server keys set``, ``PATCH /v1/keys/{id}``), stored as a
JSON object on its registry row. The effective limits are the defaults with the
overrides applied; 0 means "no limit" for every field.

* ``max_sandboxes``: sandboxes that exist (any state but destroyed).
* ``max_awake``: sandboxes holding a VMM (creating, running, paused, restoring,
  suspending). A create, or a request that would wake a suspended (or failed)
  sandbox, is refused at the limit: the tenant chooses which sandbox to suspend,
  rather than the host suspending one behind its back. A *paused* sandbox (idle
  already) is snapshotted first to make room (``gateway.sandbox.pause_policy``).
* ``max_disk_mib``: the sum of the blocks allocated to the key's sandbox
  directories (disk layer, memory file, snapshot), measured when a sandbox is
  created; a create is refused once the sum is at the limit. Each sandbox's disk
  is bounded anyway by its template's virtual size, so the sum between two
  creates can grow by at most that much per sandbox.
* ``rate`` / ``burst``: the key's token bucket (``gateway.tenancy.ratelimit``).
* ``max_vcpus``, ``max_memory_mib``, ``max_sandbox_disk_mib``: the largest shape one
  sandbox of the key may ask for (``gateway.sandbox.resources``; over it: 403 ``resource_limit``).
  A create that names a ``disk_mib`` also counts that size against ``max_disk_mib``.

All quota refusals are 409 ``quota_exceeded``: the tenant can fix the conflict
(delete or suspend a sandbox) and retry; 403 is for what no retry can fix.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest, QuotaExceeded
from gateway.sandbox.states import State

AWAKE_STATES = frozenset({State.CREATING, State.RUNNING, State.PAUSED, State.RESTORING,
                          State.SUSPENDING})
_INT_FIELDS = ("max_sandboxes", "max_awake", "max_disk_mib", "burst", "max_vcpus",
               "max_memory_mib", "max_sandbox_disk_mib")


def _non_negative_int(name: str, value: Any) -> None:
    # bool is an int in Python; a JSON true must never pass for 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, not {value!r}")


@dataclass(frozen=True)
class Limits:
    max_sandboxes: int = 0
    max_awake: int = 0
    max_disk_mib: int = 0
    rate: float = 0.0  # requests per second; 0 = not rate limited
    burst: int = 1
    # Per sandbox (gateway.sandbox.resources); 0 = only the template's limits apply.
    max_vcpus: int = 0
    max_memory_mib: int = 0
    max_sandbox_disk_mib: int = 0

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            _non_negative_int(name, getattr(self, name))
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) \
                or not 0 <= self.rate < float("inf"):
            raise ValueError(f"rate must be a number of requests per second >= 0, "
                             f"not {self.rate!r}")
        object.__setattr__(self, "rate", float(self.rate))
        if self.burst < 1:
            raise ValueError("burst must be >= 1")

    def merged(self, overrides: dict[str, Any]) -> Limits:
        return dataclasses.replace(self, **overrides) if overrides else self

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(Limits))


@dataclass(frozen=True)
class TenancyConfig:
    """``[tenancy]``: per-key defaults, and the per-source-address bucket."""

    max_sandboxes: int = 64
    max_awake: int = 16
    max_disk_mib: int = 65536
    rate: float = 50.0
    burst: int = 200
    address_rate: float = 100.0  # per source address (IPv6: per /64); 0 = off
    address_burst: int = 400
    # Not limited per address: behind a TLS proxy on this host every client has its
    # address. A proxy elsewhere must be listed here (X-Forwarded-For is not trusted).
    address_exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    table_size: int = 10000  # buckets kept per table (least recently used dropped)
    max_vcpus: int = 0  # per-sandbox shape limits of every non-admin key (sandbox.resources)
    max_memory_mib: int = 0
    max_sandbox_disk_mib: int = 0

    def __post_init__(self) -> None:
        _ = self.limits  # validates the per-key defaults
        Limits(rate=self.address_rate, burst=self.address_burst)
        object.__setattr__(self, "address_exempt", tuple(self.address_exempt))
        try:
            for net in self.address_exempt:
                ipaddress.ip_network(net, strict=False)
        except ValueError as exc:
            raise ValueError(f"address_exempt: {exc}") from exc
        _non_negative_int("table_size", self.table_size)
        if self.table_size < 1:
            raise ValueError("table_size must be >= 1")

    @property
    def limits(self) -> Limits:
        return Limits(self.max_sandboxes, self.max_awake, self.max_disk_mib, self.rate,
                      self.burst, self.max_vcpus, self.max_memory_mib,
                      self.max_sandbox_disk_mib)

    def limits_for(self, admin: bool, overrides: dict[str, Any]) -> Limits:
        """A key's effective limits. Admin keys (the operator's) are not limited by the
        defaults, only by overrides set on them."""
        return (Limits() if admin else self.limits).merged(overrides)


@dataclass(frozen=True)
class Usage:
    sandboxes: int = 0
    awake: int = 0
    disk_bytes: int = 0


def usage_of(states: Iterable[State], disk_bytes: int = 0) -> Usage:
    states = [s for s in states if s is not State.DESTROYED]
    return Usage(len(states), sum(s in AWAKE_STATES for s in states), disk_bytes)


def check_create(key_id: str, limits: Limits, usage: Usage, disk_mib: int = 0) -> None:
    """Raise ``QuotaExceeded`` if one more sandbox would break a limit of the key.
    ``disk_mib``: the disk size the create asked for (0: the template's, not counted)."""
    if limits.max_sandboxes and usage.sandboxes >= limits.max_sandboxes:
        raise QuotaExceeded(f"key {key_id} has {usage.sandboxes} sandboxes, its limit "
                            f"(max_sandboxes={limits.max_sandboxes}): delete one first")
    if limits.max_disk_mib and usage.disk_bytes >= limits.max_disk_mib << 20:
        raise QuotaExceeded(f"key {key_id}'s sandboxes use {usage.disk_bytes >> 20} MiB of "
                            f"disk, its limit (max_disk_mib={limits.max_disk_mib}): "
                            "delete one first")
    if limits.max_disk_mib and disk_mib and \
            (usage.disk_bytes >> 20) + disk_mib > limits.max_disk_mib:
        raise QuotaExceeded(f"key {key_id}'s sandboxes use {usage.disk_bytes >> 20} MiB of "
                            f"disk; {disk_mib} MiB more is over its limit "
                            f"(max_disk_mib={limits.max_disk_mib})")
    check_wake(key_id, limits, usage)


def check_fork(key_id: str, limits: Limits, usage: Usage, count: int) -> None:
    """Raise ``QuotaExceeded`` unless ``count`` more (awake) sandboxes fit the key's limits."""
    for i in range(count):
        check_create(key_id, limits, Usage(usage.sandboxes + i, usage.awake + i,
                                           usage.disk_bytes))


def check_wake(key_id: str, limits: Limits, usage: Usage) -> None:
    """Raise ``QuotaExceeded`` if one more awake sandbox would break ``max_awake``."""
    if limits.max_awake and usage.awake >= limits.max_awake:
        raise QuotaExceeded(f"key {key_id} has {usage.awake} awake sandboxes, its limit "
                            f"(max_awake={limits.max_awake}): suspend or delete one first "
                            "(POST /v1/sandboxes/{id}/suspend)")


def parse_overrides(value: Any) -> dict[str, Any]:
    """Validate a ``limits`` object from a request: known fields, JSON types exactly
    (no strings for numbers, no booleans), null = back to the default."""
    if not isinstance(value, dict):
        raise BadRequest("'limits' must be a JSON object", code="invalid_type")
    unknown = set(value) - set(LIMIT_FIELDS)
    if unknown:
        raise BadRequest(f"unknown limit(s): {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(LIMIT_FIELDS)}")
    out = {}
    for name, item in value.items():
        if item is None:
            out[name] = None
            continue
        try:
            Limits(**{name: item})
        except ValueError as exc:
            raise BadRequest(f"'limits.{name}': {exc}", code="invalid_type") from exc
        out[name] = item
    return out


def apply_overrides(current: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A key's stored overrides after ``changes`` (None removes one)."""
    merged = {**current, **changes}
    return {k: v for k, v in merged.items() if v is not None}
