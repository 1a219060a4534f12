"""Fleet-wide ``GET /v1/sandboxes``: merging the hosts' pages (no I/O).

Every host answers the same query (filters, ``limit``, ``cursor``) with its own page: its
first ``limit`` matching sandboxes after the cursor, in (created_at, id) order, and whether
it has more. That order is global (ids are unique in the fleet), so the fleet's page is the
first ``limit`` of the union, and its cursor is the last one returned: a host's sandboxes
beyond it come again on the next page, each exactly once. A sandbox two hosts both list
(a copy not yet removed after a move) is listed once, as the host its record names has it.

A host that did not answer is named in ``partial``: its sandboxes are missing from this
page (and, once the client pages past them, from the listing), which the client is told
rather than left to take the list for whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.cluster.errors import ProtocolError
from gateway.sandbox.listing import cursor_at


@dataclass(frozen=True)
class HostPage:
    host: str
    sandboxes: list[dict[str, Any]]
    more: bool  # the host had more after this page (its next_cursor was not null)


@dataclass(frozen=True)
class FleetPage:
    sandboxes: list[dict[str, Any]]
    next_cursor: str | None
    partial: list[str]  # hosts that did not answer (sorted); empty: the whole fleet


def _position(item: Any) -> tuple[float, str]:
    if not isinstance(item, dict):
        raise ProtocolError("a listed sandbox is not an object")
    created, sid = item.get("created_at"), item.get("id")
    if isinstance(created, bool) or not isinstance(created, (int, float)) \
            or not isinstance(sid, str):
        raise ProtocolError("a listed sandbox has no created_at/id")
    return float(created), sid


def page_of(host: str, body: Any) -> HostPage:
    """A host's decoded ``SandboxList`` answer; ProtocolError when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("sandboxes"), list):
        raise ProtocolError(f"{host}: the answer is not a sandbox list")
    items = body["sandboxes"]
    for item in items:
        _position(item)
    return HostPage(host, items, body.get("next_cursor") is not None)


def merge(pages: Iterable[HostPage], limit: int, missing: Iterable[str] = (),
          owner_of: Callable[[str], str | None] | Mapping[str, str] | None = None
          ) -> FleetPage:
    """The fleet's page: the first ``limit`` of every host's page, in cursor order.
    ``owner_of``: the host a sandbox's record names (None: unknown)."""
    owner = (owner_of.get if isinstance(owner_of, Mapping)
             else owner_of or (lambda _: None))
    chosen: dict[str, tuple[tuple[float, str], str, dict[str, Any]]] = {}
    more = False
    for page in pages:
        more = more or page.more
        for item in page.sandboxes:
            pos = _position(item)
            seen = chosen.get(pos[1])
            if seen is None or (owner(pos[1]) == page.host and seen[1] != page.host):
                chosen[pos[1]] = (pos, page.host, item)
    ordered = sorted(chosen.values(), key=lambda c: c[0])
    first = ordered[:limit]
    next_cursor = None
    if first and (len(ordered) > limit or more):
        next_cursor = cursor_at(*first[-1][0])
    return FleetPage([item for _, _, item in first], next_cursor, sorted(set(missing)))
