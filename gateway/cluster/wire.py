"""etcd v3's JSON gateway, encoded and decoded without I/O.

etcd serves its gRPC API as HTTP/1.1 + JSON under ``/v3/`` (the grpc-gateway; etcd 3.4 and
later). The mapping is protobuf's JSON form: ``bytes`` fields (keys, values) are base64,
64-bit integers are decimal strings, and fields at their default value (0, false, empty) are
left out, so every decoder here reads with a default. These helpers build request bodies
and turn answers into frozen dataclasses; ``gateway.cluster.etcd`` does the HTTP.
"""

from __future__ import annotations

import base64
import binascii
import enum
from dataclasses import dataclass
from typing import Any

from gateway.cluster.errors import EtcdRequestError, ProtocolError


def b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ProtocolError(f"expected base64 text, got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("bad base64 in etcd answer") from exc


def as_int(value: Any) -> int:
    """int64 fields arrive as strings (uint/int32 as numbers); absent means 0."""
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"expected an integer, got {value!r}") from exc


def prefix_end(prefix: bytes | str) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"  # every key
    raw[-1] += 1
    return bytes(raw)


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True)
class Event:
    type: EventType
    kv: KeyValue


@dataclass(frozen=True)
class RangeResult:
    revision: int  # the store's revision when the range was read
    kvs: tuple[KeyValue, ...]
    count: int
    more: bool
    raft_term: int = 0  # of the member that answered (0 inside a txn)


@dataclass(frozen=True)
class KeepAlive:
    ttl: int  # seconds left after the renewal; 0 = the lease is gone
    raft_term: int  # the term the renewal was handled in


@dataclass(frozen=True)
class TxnResult:
    revision: int
    succeeded: bool
    # One per operation of the branch that ran: RangeResult for a range, else the raw dict.
    responses: tuple[Any, ...]
    raft_term: int = 0  # the header's: only grows in one raft log (a restore starts anew)


@dataclass(frozen=True)
class WatchBatch:
    """One message of a watch stream: events, or a progress/created/canceled notice."""

    revision: int
    events: tuple[Event, ...]
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    watch_id: int = 0


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what}: expected a JSON object")
    return value


def revision_of(answer: dict[str, Any]) -> int:
    return as_int(_obj(answer.get("header", {}), "header").get("revision"))


def term_of(answer: dict[str, Any]) -> int:
    return as_int(_obj(answer.get("header", {}), "header").get("raft_term"))


def decode_kv(raw: Any) -> KeyValue:
    kv = _obj(raw, "kv")
    return KeyValue(key=unb64(kv.get("key", "")), value=unb64(kv.get("value", "")),
                    create_revision=as_int(kv.get("create_revision")),
                    mod_revision=as_int(kv.get("mod_revision")),
                    version=as_int(kv.get("version")), lease=as_int(kv.get("lease")))


def decode_range(answer: Any) -> RangeResult:
    answer = _obj(answer, "range")
    kvs = answer.get("kvs", [])
    if not isinstance(kvs, list):
        raise ProtocolError("range: kvs is not a list")
    return RangeResult(revision=revision_of(answer), kvs=tuple(decode_kv(kv) for kv in kvs),
                       count=as_int(answer.get("count")), more=bool(answer.get("more", False)),
                       raft_term=term_of(answer))


def decode_txn(answer: Any) -> TxnResult:
    answer = _obj(answer, "txn")
    out: list[Any] = []
    for item in answer.get("responses", []):
        item = _obj(item, "txn response")
        out.append(decode_range(item["response_range"]) if "response_range" in item else item)
    return TxnResult(revision=revision_of(answer), succeeded=bool(answer.get("succeeded")),
                     responses=tuple(out), raft_term=term_of(answer))


def decode_watch(message: Any) -> WatchBatch:
    """One line of ``/v3/watch``: ``{"result": {...}}`` or ``{"error": {...}}``."""
    message = _obj(message, "watch message")
    if "error" in message:
        err = message["error"]
        text = err.get("message", "watch error") if isinstance(err, dict) else str(err)
        grpc = as_int(err.get("grpc_code", err.get("code", 2))) if isinstance(err, dict) else 2
        raise EtcdRequestError(f"watch stream error: {text}", grpc)
    result = _obj(message.get("result"), "watch result")
    events = []
    for raw in result.get("events", []):
        raw = _obj(raw, "event")
        kind = EventType.DELETE if raw.get("type") == "DELETE" else EventType.PUT
        events.append(Event(type=kind, kv=decode_kv(raw.get("kv", {}))))
    return WatchBatch(revision=revision_of(result), events=tuple(events),
                      created=bool(result.get("created")), canceled=bool(result.get("canceled")),
                      compact_revision=as_int(result.get("compact_revision")),
                      watch_id=as_int(result.get("watch_id")))


# --- request bodies -------------------------------------------------------------------------

def range_body(key: bytes | str, range_end: bytes | None = None, *, limit: int = 0,
               revision: int = 0, serializable: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    if limit:
        body["limit"] = str(limit)
    if revision:
        body["revision"] = str(revision)
    if serializable:
        body["serializable"] = True
    return body


def put_body(key: bytes | str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def delete_body(key: bytes | str, range_end: bytes | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    return body


class Target(enum.Enum):
    """What a compare looks at (etcd's ``Compare.CompareTarget``)."""

    VERSION = "version"
    CREATE = "create_revision"
    MOD = "mod_revision"
    VALUE = "value"
    LEASE = "lease"


def compare(key: bytes | str, target: Target, value: int | bytes, result: str = "EQUAL"
            ) -> dict[str, Any]:
    """A txn guard: ``key``'s ``target`` compared (EQUAL, NOT_EQUAL, GREATER, LESS) to
    ``value``. A missing key has version, create and mod revision 0 and lease 0."""
    if result not in ("EQUAL", "NOT_EQUAL", "GREATER", "LESS"):
        raise ValueError(f"bad compare result {result!r}")
    encoded = b64(value) if isinstance(value, bytes) else str(value)
    return {"key": b64(key), "target": target.name, "result": result,
            target.value: encoded}


def txn_body(compares: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Ops are ``{"request_put": put_body(...)}``, ``{"request_range": range_body(...)}`` or
    ``{"request_delete_range": delete_body(...)}``."""
    return {"compare": compares, "success": success, "failure": failure or []}


def op_put(key: bytes | str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    return {"request_put": put_body(key, value, lease)}


def op_get(key: bytes | str) -> dict[str, Any]:
    return {"request_range": range_body(key)}


def op_delete(key: bytes | str) -> dict[str, Any]:
    return {"request_delete_range": delete_body(key)}


def watch_body(key: bytes | str, range_end: bytes | None, start_revision: int,
               progress_notify: bool = True) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key), "start_revision": str(start_revision)}
    if range_end is not None:
        req["range_end"] = b64(range_end)
    if progress_notify:
        req["progress_notify"] = True
    return {"create_request": req}
