"""gateway.sandbox.listing: filters, and cursor pages that are exact and stable."""

from __future__ import annotations

import base64

import pytest
from multidict import MultiDict

from gateway.sandbox import listing
from gateway.errors import BadRequest
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord


def rec(sid: str, created: float, state=State.RUNNING, template="python", **meta):
    return SandboxRecord(id=sid, tenant="t", template=template, state=state, slot=0, root="/x",
                         golden="/g", idle_timeout=0, host="h", created_at=created,
                         updated_at=created, last_activity=created, metadata=meta)


RECS = [rec("c", 3.0, user="alice", n=1), rec("a", 1.0, user="bob"),
        rec("b", 3.0, State.SUSPENDED, user="alice"), rec("d", 4.0, template="py2", user="alice")]


def ids(query: dict[str, str], recs=RECS) -> list[str]:
    page, _ = listing.select(recs, listing.parse_query(MultiDict(query)))
    return [r.id for r in page]


def test_filters_combine():
    assert ids({}) == ["a", "b", "c", "d"]  # created_at, then id (b and c tie on time)
    assert ids({"metadata.user": "alice"}) == ["b", "c", "d"]
    assert ids({"metadata.user": "alice", "state": "running"}) == ["c", "d"]
    assert ids({"state": "suspended,running", "template": "python"}) == ["a", "b", "c"]
    assert ids({"metadata.n": "1"}) == ["c"]  # a non-string value matches its JSON text
    assert ids({"metadata.n": "2"}) == []
    assert ids({"metadata.missing": ""}) == []  # a key it lacks never matches


def test_pages_walk_every_match_once_in_order_while_sandboxes_come_and_go():
    recs = list(RECS)
    seen, cursor = [], None
    while True:
        query = {"limit": "1", "metadata.user": "alice"} | ({"cursor": cursor} if cursor else {})
        page, cursor = listing.select(recs, listing.parse_query(MultiDict(query)))
        seen += [r.id for r in page]
        if len(seen) == 1:  # one created before the cursor and one removed after it
            recs = [*recs, rec("0", 0.5, user="alice")]
            recs = [r for r in recs if r.id != "c"]
        if cursor is None:
            break
    assert seen == ["b", "d"]
    page, cursor = listing.select(RECS, listing.parse_query(MultiDict({"limit": "4"})))
    assert len(page) == 4 and cursor is None  # exactly a full last page: no empty next page


def test_cursor_round_trip_and_refusals():
    r = RECS[0]
    assert listing.decode_cursor(listing.encode_cursor(r)) == (r.created_at, r.id)
    junk = base64.urlsafe_b64encode(b'{"a": 1}').decode()
    for bad in ("x", "!!!", junk, "A" * 600, base64.urlsafe_b64encode(b"[true, 1]").decode()):
        with pytest.raises(BadRequest):
            listing.decode_cursor(bad)
    for query in ({"limit": "0"}, {"limit": "1001"}, {"limit": "-1"}, {"state": "asleep"},
                  {"colour": "red"}, {f"metadata.k{i}": "v" for i in range(33)}):
        with pytest.raises(BadRequest):
            listing.parse_query(MultiDict(query))
    assert listing.parse_query(MultiDict({})).limit == listing.DEFAULT_LIMIT
