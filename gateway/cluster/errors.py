"""One family for everything that can go wrong talking to etcd or holding cluster state.

Foreign exceptions (aiohttp, asyncio timeouts, bad JSON) are mapped into these at the edge
(``gateway.cluster.etcd``) and raised ``from`` the original. Callers catch by cause:

- ``EtcdUnavailable``: no endpoint gave an answer; nothing is known to have happened.
- ``EtcdUncertain``: a write was sent and no answer came; it may or may not have applied.
  Re-read before deciding (``gateway.cluster.ownership`` does).
- ``EtcdRequestError``: etcd answered with an error (gRPC status ``grpc_code``).
- ``ProtocolError``: an answer we cannot use (too big, not JSON, wrong shape).
- ``Compacted``: a watch asked for history etcd no longer keeps.
- ``OwnershipConflict``: a compare-and-set lost (a stale generation, or the record moved).
- ``Fenced``: this host's lease is gone; it must not act as an owner any more.
- ``NoCapacity``: placement found no live host with room.

None of these reach an HTTP client yet (the cluster is not in the request path), so they
carry no API error ``code``; they will get one when routing maps them.
"""

from __future__ import annotations

from typing import Any


class ClusterError(Exception):
    """Root of the family."""


class EtcdUnavailable(ClusterError):
    """No endpoint answered within the call's deadline (or every one refused)."""


class EtcdUncertain(EtcdUnavailable):
    """A non-idempotent request was sent but its answer never came: outcome unknown."""


class EtcdRequestError(ClusterError):
    """etcd answered with an error status."""

    def __init__(self, message: str, grpc_code: int = 2, http_status: int = 0) -> None:
        super().__init__(message)
        self.grpc_code = grpc_code
        self.http_status = http_status


class LeaseNotFound(EtcdRequestError):
    """The lease expired or was revoked (gRPC NOT_FOUND on a lease call or a put)."""


class ProtocolError(ClusterError):
    """A response we refuse: over the size bound, not JSON, or not the expected shape."""


class Compacted(ClusterError):
    """A watch's start revision was compacted away; re-list at ``compact_revision``."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted; oldest available is {compact_revision}")
        self.compact_revision = compact_revision


class OwnershipConflict(ClusterError):
    """A compare-and-set on a sandbox record failed; ``current`` is what etcd holds now
    (a ``gateway.cluster.ownership.Versioned``, or None when the record is gone)."""

    def __init__(self, message: str, current: Any = None) -> None:
        super().__init__(message)
        self.current = current


class Fenced(ClusterError):
    """This host lost its lease: it stops acting as an owner until it rejoins."""


class NoCapacity(ClusterError):
    """No live host can take the sandbox; ``reasons`` says why each host was passed over."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reasons = dict(reasons or {})
