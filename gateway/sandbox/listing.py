"""``GET /v1/sandboxes`` filters and cursor pagination (no I/O).

Filters: ``state`` (one or a comma-separated list), ``template``, and any number of
``metadata.KEY=VALUE`` (every one must match; a non-string value matches its JSON text).
Order: ``created_at`` then ``id``, which never changes for a sandbox, so paging is stable
while sandboxes come and go: the cursor is the (created_at, id) of the last one returned,
base64url-encoded JSON; a page starts strictly after it. ``limit`` is bounded.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_FILTERS = 32
MAX_CURSOR = 512
META = "metadata."
KNOWN = {"state", "template", "limit", "cursor", "tenant"}


@dataclass(frozen=True)
class ListQuery:
    states: frozenset[State] = frozenset()
    template: str | None = None
    metadata: dict[str, str] = field(default_factory=dict, hash=False)
    limit: int = DEFAULT_LIMIT
    after: tuple[float, str] | None = None


def encode_cursor(rec: SandboxRecord) -> str:
    return cursor_at(rec.created_at, rec.id)


def cursor_at(created_at: float, sandbox_id: str) -> str:
    """The cursor of a page ending at the sandbox (created_at, sandbox_id)."""
    raw = json.dumps([created_at, sandbox_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        if len(cursor) > MAX_CURSOR:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, sid = json.loads(raw)
        if isinstance(created, bool) or not isinstance(created, (int, float)) \
                or not isinstance(sid, str):
            raise ValueError("bad fields")
    except (ValueError, TypeError, binascii.Error) as exc:
        raise BadRequest("'cursor' is not a cursor this server handed out") from exc
    return float(created), sid


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise BadRequest(f"'limit' must be an integer from 1 to {MAX_LIMIT}")
    return int(value)


def _states(value: str | None) -> frozenset[State]:
    if not value:
        return frozenset()
    try:
        return frozenset(State(s.strip()) for s in value.split(","))
    except ValueError as exc:
        raise BadRequest(f"'state' must be one or more of "
                         f"{', '.join(s.value for s in State)} (comma-separated)") from exc


def parse_query(query: Mapping[str, str]) -> ListQuery:
    """The filters of a request's query string (``request.query``: a MultiDict)."""
    meta: dict[str, str] = {}
    for name, value in query.items():
        if name.startswith(META) and len(name) > len(META):
            meta[name[len(META):]] = value
        elif name not in KNOWN:
            raise BadRequest(f"unknown query parameter {name!r} (filters: state, template, "
                             "metadata.KEY)")
    if len(meta) > MAX_FILTERS:
        raise BadRequest(f"at most {MAX_FILTERS} metadata filters")
    cursor = query.get("cursor")
    return ListQuery(states=_states(query.get("state")), template=query.get("template") or None,
                     metadata=meta, limit=_limit(query.get("limit")),
                     after=decode_cursor(cursor) if cursor else None)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def matches(rec: SandboxRecord, q: ListQuery) -> bool:
    if q.states and rec.state not in q.states:
        return False
    if q.template is not None and rec.template != q.template:
        return False
    return all(k in rec.metadata and _text(rec.metadata[k]) == v for k, v in q.metadata.items())


def select(recs: Iterable[SandboxRecord],
           q: ListQuery) -> tuple[list[SandboxRecord], str | None]:
    """One page of the matching records, and the cursor of the next page (None: last)."""
    ordered = sorted(recs, key=lambda r: (r.created_at, r.id))
    if q.after is not None:
        ordered = [r for r in ordered if (r.created_at, r.id) > q.after]
    page: list[SandboxRecord] = []
    for rec in ordered:
        if not matches(rec, q):
            continue
        if len(page) == q.limit:
            return page, encode_cursor(page[-1])
        page.append(rec)
    return page, None
