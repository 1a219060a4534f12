"""etcd's JSON gateway encoding: base64 bytes, int64 as strings, defaults left out."""

from __future__ import annotations

import pytest

from gateway.cluster import wire
from gateway.cluster.errors import EtcdRequestError, ProtocolError


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert wire.prefix_end("/a/") == b"/a0"
    assert wire.prefix_end(b"a\xff") == b"b"
    assert wire.prefix_end(b"\xff\xff") == b"\0"


def test_range_answer_with_defaults_left_out() -> None:
    answer = {"header": {"revision": "7"}, "kvs": [
        {"key": wire.b64("k"), "create_revision": "3", "mod_revision": "7", "version": "2"}],
        "count": "1"}
    result = wire.decode_range(answer)
    assert result.revision == 7 and result.count == 1 and not result.more
    assert result.kvs[0] == wire.KeyValue(b"k", b"", 3, 7, 2, 0)
    assert wire.decode_range({"header": {"revision": "1"}}).kvs == ()


def test_a_failed_txn_has_no_succeeded_field() -> None:
    answer = {"header": {"revision": "9"}, "responses": [
        {"response_range": {"header": {"revision": "9"}, "kvs": []}}, {"response_put": {}}]}
    result = wire.decode_txn(answer)
    assert not result.succeeded and result.revision == 9
    assert isinstance(result.responses[0], wire.RangeResult)
    assert result.responses[1] == {"response_put": {}}


def test_watch_messages() -> None:
    delete = {"result": {"header": {"revision": "5"}, "events": [
        {"type": "DELETE", "kv": {"key": wire.b64("k"), "mod_revision": "5"}},
        {"kv": {"key": wire.b64("j"), "value": wire.b64("v"), "mod_revision": "5"}}]}}
    batch = wire.decode_watch(delete)
    assert [e.type for e in batch.events] == [wire.EventType.DELETE, wire.EventType.PUT]
    assert batch.events[1].kv.value == b"v"
    compacted = wire.decode_watch({"result": {"header": {}, "canceled": True,
                                              "compact_revision": "4"}})
    assert compacted.canceled and compacted.compact_revision == 4
    with pytest.raises(EtcdRequestError, match="no leader") as info:
        wire.decode_watch({"error": {"grpc_code": 14, "message": "etcdserver: no leader"}})
    assert info.value.grpc_code == 14


@pytest.mark.parametrize("bad", [
    {"header": {"revision": "x"}},
    {"kvs": [{"key": "not base64!"}]},
    {"kvs": "nope"},
    {"header": []},
])
def test_malformed_answers_are_protocol_errors(bad) -> None:
    with pytest.raises(ProtocolError):
        wire.decode_range(bad)


def test_request_bodies() -> None:
    assert wire.put_body("k", b"\x00", lease=0x10) == {"key": "aw==", "value": "AA==",
                                                       "lease": "16"}
    assert wire.compare("k", wire.Target.MOD, 5) == {
        "key": "aw==", "target": "MOD", "result": "EQUAL", "mod_revision": "5"}
    assert wire.compare("k", wire.Target.VALUE, b"v", "NOT_EQUAL")["value"] == "dg=="
    assert wire.compare("k", wire.Target.LEASE, 7)["lease"] == "7"
    with pytest.raises(ValueError):
        wire.compare("k", wire.Target.MOD, 1, "ABOUT")
    body = wire.watch_body("/p/", wire.prefix_end("/p/"), 12)
    assert body["create_request"]["start_revision"] == "12"
    assert body["create_request"]["range_end"] == wire.b64("/p0")
    assert wire.range_body("k", revision=3, limit=2, serializable=True) == {
        "key": "aw==", "revision": "3", "limit": "2", "serializable": True}
