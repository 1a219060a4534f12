"""``[cluster]`` in agentbox.toml: off by default, so one host runs exactly as before.

On, it names the etcd cluster (``endpoints``), this host (``host``, a DNS label unique in
the fleet) and where other hosts reach this host's gateway (``advertise``). Every bad value
fails start-up with the field's name (gateway.config wraps it as ``[cluster]: ...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.cluster.keys import Keys, check_host_name

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HOSTPORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})")


def _check_endpoint(url: object) -> str:
    if not isinstance(url, str):
        raise ValueError(f"endpoints: {url!r} is not a string")
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"endpoints: {url!r} must be http://HOST:PORT (TLS to etcd is not "
                         "supported yet)")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"endpoints: {url!r} has a bad port") from exc
    if not parts.hostname or port is None or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"endpoints: {url!r} must be http://HOST:PORT and nothing more")
    return url.rstrip("/")


@dataclass(frozen=True)
class ClusterConfig:
    enabled: bool = False
    endpoints: tuple[str, ...] = ()  # etcd client URLs, e.g. "http://10.0.0.1:2379"
    host: str = ""  # this host's name in the fleet (a DNS label)
    advertise: str = ""  # HOST:PORT where other hosts reach this gateway
    lease_ttl: int = 5  # seconds without a renewal before the host counts as dead
    timeout: float = 5.0  # seconds for one etcd call, across every endpoint it tries
    key_prefix: str = "/agentbox"  # every key lives under it (fleets sharing one etcd)
    placement_choices: int = 2  # best-of-K (gateway.cluster.placement)
    # The shared object store (S3 API) for suspended sandboxes' snapshots; endpoint ""
    # means none: nothing is uploaded and a dead host's sandboxes cannot be re-homed.
    objstore_endpoint: str = ""  # http(s)://HOST:PORT
    objstore_bucket: str = ""
    objstore_access_key: str = ""
    objstore_secret_key: str = field(default="", repr=False)
    objstore_region: str = "us-east-1"
    upload_concurrency: int = 2  # files of one snapshot in flight at once
    # Seconds a host must have been without a record before the reaper takes its
    # sandboxes: a daemon restarting (its lease revoked on a clean stop) must come back
    # within it, or its running sandboxes are marked FAILED and its suspended ones moved.
    reap_after: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError("enabled must be true or false")
        if isinstance(self.endpoints, str) or not isinstance(self.endpoints, (list, tuple)):
            raise ValueError("endpoints must be a list of http://HOST:PORT strings")
        object.__setattr__(self, "endpoints",
                           tuple(_check_endpoint(e) for e in self.endpoints))
        if not isinstance(self.lease_ttl, int) or isinstance(self.lease_ttl, bool) \
                or not 2 <= self.lease_ttl <= 300:
            raise ValueError(f"lease_ttl must be an integer from 2 to 300, not "
                             f"{self.lease_ttl!r}")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout <= 60:
            raise ValueError(f"timeout must be > 0 and <= 60 seconds, not {self.timeout!r}")
        if not isinstance(self.placement_choices, int) or self.placement_choices < 1:
            raise ValueError("placement_choices must be an integer >= 1")
        if not isinstance(self.reap_after, (int, float)) or isinstance(self.reap_after, bool) \
                or not 0 <= self.reap_after <= 86400:
            raise ValueError(f"reap_after must be 0 to 86400 seconds, not {self.reap_after!r}")
        try:
            Keys(self.key_prefix)
        except ValueError as exc:
            raise ValueError(f"key_prefix: {exc}") from exc
        if self.objstore_endpoint:
            self._check_objstore()
        if self.enabled:
            self._check_enabled()

    def _check_objstore(self) -> None:
        parts = urlsplit(self.objstore_endpoint) if isinstance(self.objstore_endpoint,
                                                                str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
                or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"objstore_endpoint must be http(s)://HOST[:PORT], not "
                             f"{self.objstore_endpoint!r}")
        if not isinstance(self.objstore_bucket, str) or not _BUCKET.fullmatch(
                self.objstore_bucket):
            raise ValueError(f"objstore_bucket must be an S3 bucket name (3-63 of a-z 0-9 . -),"
                             f" not {self.objstore_bucket!r}")
        for name in ("objstore_access_key", "objstore_secret_key", "objstore_region"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 256:
                raise ValueError(f"{name} must be a non-empty string when "
                                 "objstore_endpoint is set")
        if not isinstance(self.upload_concurrency, int) or not 1 <= self.upload_concurrency <= 16:
            raise ValueError("upload_concurrency must be an integer from 1 to 16")

    def _check_enabled(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints must list at least one etcd member when enabled")
        try:
            check_host_name(self.host)
        except ValueError as exc:
            raise ValueError(f"host: {exc}") from exc
        match = _HOSTPORT.fullmatch(self.advertise) if isinstance(self.advertise, str) else None
        if not match or not 0 < int(match.group(2)) < 65536:
            raise ValueError(f"advertise must be HOST:PORT, not {self.advertise!r}")

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)
