"""Per-sandbox resources (vCPUs, memory, disk): what a create may ask for.

Theory of operation
-------------------
A sandbox's *shape* is its vCPU count, guest RAM (MiB) and disk size (MiB). A create
names any of the three (``vcpus``, ``memory_mib``, ``disk_mib``); what it leaves out is
the template's default (the config's ``[vm] vcpus``, the template's RAM, the template's
root disk). No I/O here: the caller supplies the defaults and the limits.

Limits come from two places and both apply; 0 means "no limit from here":

* the operator's, per template: ``[resources]`` ``max_vcpus``, ``max_memory_mib``,
  ``max_disk_mib``, overridden for one template by ``[resources.templates.NAME]``;
* the key's (``gateway.tenancy.quotas.Limits``: ``max_vcpus``, ``max_memory_mib``,
  ``max_sandbox_disk_mib``; set with ``agentbox-server keys set``).

A malformed or impossible value (not an integer, fewer than 1 vCPU, less RAM than
``min_memory_mib``, a disk smaller than the template's, since a file system is never
shrunk) is 400 ``invalid_resources``; a value over a limit is 403 ``resource_limit``
(no retry can fix it). The default shape is always allowed, so lowering a limit never
breaks plain creates. The disk also counts against the key's ``max_disk_mib`` quota
(``gateway.tenancy.quotas.check_create``).

A restore needs a snapshot of the same vCPU count and RAM size, so each (vcpus,
memory_mib) has its own golden snapshot (``vmctl.golden.golden_dir``), built on first
use; the disk size is not part of it (``vmctl.disk_grow``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest, Forbidden

FIELDS = ("vcpus", "memory_mib", "disk_mib")
HARD_MAX_VCPUS = 32  # vmctl.spec.VMSpec's bound


@dataclass(frozen=True)
class Shape:
    vcpus: int
    memory_mib: int
    disk_mib: int

    def as_dict(self) -> dict[str, int]:
        return {"vcpus": self.vcpus, "memory_mib": self.memory_mib, "disk_mib": self.disk_mib}


@dataclass(frozen=True)
class ShapeRequest:
    """What a create asked for (None: the template's default)."""

    vcpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None


def _check_limit(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0 = no limit), not {value!r}")


@dataclass(frozen=True)
class ResourceLimits:
    max_vcpus: int = 0
    max_memory_mib: int = 0
    max_disk_mib: int = 0

    def __post_init__(self) -> None:
        for name in ("max_vcpus", "max_memory_mib", "max_disk_mib"):
            _check_limit(name, getattr(self, name))


@dataclass(frozen=True)
class ResourcesConfig:
    """``[resources]``: per-sandbox limits for every template, and per-template overrides."""

    max_vcpus: int = 2
    max_memory_mib: int = 4096
    max_disk_mib: int = 16384
    min_memory_mib: int = 128
    templates: dict[str, dict[str, int]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _ = self.for_template("")
        if isinstance(self.min_memory_mib, bool) or not isinstance(self.min_memory_mib, int) \
                or self.min_memory_mib < 64:
            raise ValueError("min_memory_mib must be an integer >= 64")
        if not isinstance(self.templates, dict):
            raise ValueError("templates must be a table of template names")
        for name, overrides in self.templates.items():
            try:
                self.for_template(name)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"templates.{name}: {exc}") from exc
            if not isinstance(overrides, dict):
                raise ValueError(f"templates.{name} must be a table")

    def for_template(self, template: str) -> ResourceLimits:
        base = {"max_vcpus": self.max_vcpus, "max_memory_mib": self.max_memory_mib,
                "max_disk_mib": self.max_disk_mib}
        return ResourceLimits(**(base | dict(self.templates.get(template, {}))))


def template_view(golden: Any, limits: ResourceLimits) -> dict[str, Any]:
    """``GET /v1/templates``: a template's default shape and its per-sandbox limits (fields
    of ``gateway.http.wire.Template``)."""
    return {"vcpus": golden.vcpus, "disk_mib": golden.disk_mib,
            "max_vcpus": limits.max_vcpus, "max_memory_mib": limits.max_memory_mib,
            "max_disk_mib": limits.max_disk_mib}


def resolve(request: ShapeRequest, default: Shape, template: ResourceLimits,
            key: ResourceLimits, min_memory_mib: int = 128) -> Shape:
    """The shape to create, or BadRequest (impossible) / Forbidden (over a limit)."""
    shape = Shape(vcpus=default.vcpus if request.vcpus is None else request.vcpus,
                  memory_mib=default.memory_mib if request.memory_mib is None
                  else request.memory_mib,
                  disk_mib=default.disk_mib if request.disk_mib is None else request.disk_mib)
    if not 1 <= shape.vcpus <= HARD_MAX_VCPUS:
        raise BadRequest(f"'vcpus' must be 1..{HARD_MAX_VCPUS}", code="invalid_resources")
    if shape.memory_mib < min_memory_mib:
        raise BadRequest(f"'memory_mib' must be >= {min_memory_mib}", code="invalid_resources")
    if shape.disk_mib < default.disk_mib:
        raise BadRequest(f"'disk_mib' must be >= {default.disk_mib}, the template's disk "
                         "(a file system is never shrunk)", code="invalid_resources")
    for name, value, default_value in (("vcpus", shape.vcpus, default.vcpus),
                                       ("memory_mib", shape.memory_mib, default.memory_mib),
                                       ("disk_mib", shape.disk_mib, default.disk_mib)):
        if value == default_value:
            continue  # the default shape is always allowed
        for who, limits in (("the template", template), ("this key", key)):
            limit = getattr(limits, f"max_{name}")
            if limit and value > limit:
                raise Forbidden(f"'{name}' = {value} is over {who}'s limit of {limit}",
                                code="resource_limit")
    return shape
