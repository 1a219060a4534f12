"""Daemon configuration: TOML file -> frozen dataclasses, validated at start-up.

A bad value fails start-up with the offending key in the message. Command-line
flags (``--listen``, ``--data-dir``) override the file.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.cluster.config import ClusterConfig
from gateway.tenancy.quotas import TenancyConfig
from gateway.sandbox.resources import ResourcesConfig
from vmctl.backend import FirecrackerConfig, VMConfig
from vmctl.confine import ConfineConfig
from vmctl.network import NetworkConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "agentbox.toml"


_DOMAIN = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    data_dir: Path = Path("/var/lib/agentbox")
    images_dir: Path = Path("/var/lib/agentbox/images")
    max_upload_bytes: int = 1 << 30
    max_json_bytes: int = 4 << 20
    # Preview and session URLs (gateway/preview/hosts.py, docs/preview.md).
    preview_domain: str = "localhost"  # {port}-{sandbox_id}.{preview_domain}
    session_domain: str = "sessions.localhost"  # {name}.{session_domain}
    public_scheme: str = "http"  # scheme of the URLs we hand out (https behind a TLS proxy)
    public_port: int = 0  # port in the URLs we hand out; 0 = the listen port
    preview_rewrite_host: bool = False  # send Host: localhost:{port} upstream (dev servers)
    proxy_connect_timeout: float = 5.0
    proxy_read_timeout: float = 300.0  # seconds between bytes from a guest app (then 504)
    # Untrusted-input bounds (issue 10): every WebSocket message either way, and the time a
    # client has to send its request headers (also how long an idle keep-alive connection lives).
    max_ws_message_bytes: int = 16 << 20
    header_read_timeout: float = 15.0
    # Simple preview requests skip aiohttp (gateway.preview.fastlane); off: every request takes it.
    fast_lane: bool = True

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT, not {self.listen!r}")
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        object.__setattr__(self, "images_dir", Path(self.images_dir))
        if self.max_upload_bytes <= 0 or self.max_json_bytes <= 0:
            raise ValueError("size limits must be positive")
        for name in ("preview_domain", "session_domain"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _DOMAIN.fullmatch(value):
                raise ValueError(f"{name} must be a lowercase DNS name, not {value!r}")
        if self.public_scheme not in ("http", "https") or not 0 <= self.public_port < 65536:
            raise ValueError("public_scheme must be http or https; public_port 0-65535")
        if self.proxy_connect_timeout <= 0 or self.proxy_read_timeout <= 0:
            raise ValueError("proxy timeouts must be positive")
        if not isinstance(self.max_ws_message_bytes, int) or self.max_ws_message_bytes < 1024:
            raise ValueError("max_ws_message_bytes must be an integer >= 1024")
        if self.header_read_timeout <= 0:
            raise ValueError("header_read_timeout must be positive")

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


@dataclass(frozen=True)
class SandboxConfig:
    templates: tuple[str, ...] = ("python",)
    default_template: str = "python"
    idle_timeout: float = 60.0
    max_sandboxes: int = 256
    # Pause before snapshot (sandbox.pause_policy): seconds an idle sandbox stays PAUSED (VMM alive,
    # RAM held) before its snapshot; 0 = snapshot at once. Paused ones are snapshotted
    # earlier when MemAvailable drops below pause_min_available_mib or more than max_paused
    # are paused (0 = no such limit).
    suspend_after_pause: float = 300.0
    max_paused: int = 32
    pause_min_available_mib: int = 2048
    # Lifetimes (gateway.sandbox.expiry): defaults for sandboxes created without them; 0 = never.
    ttl: float = 0.0  # destroy this many seconds after create
    auto_delete_after: float = 0.0  # destroy after this many seconds suspended (or failed)
    max_ttl: float = 0.0  # the longest ttl a request may ask for; 0 = no limit

    def __post_init__(self) -> None:
        object.__setattr__(self, "templates", tuple(self.templates))
        if self.suspend_after_pause < 0 or self.max_paused < 0 \
                or self.pause_min_available_mib < 0:
            raise ValueError("suspend_after_pause, max_paused and pause_min_available_mib "
                             "must be >= 0")
        if min(self.ttl, self.auto_delete_after, self.max_ttl) < 0:
            raise ValueError("ttl, auto_delete_after and max_ttl must be >= 0 (0 = never)")
        if self.max_ttl and self.ttl > self.max_ttl:
            raise ValueError("ttl must not exceed max_ttl")
        if self.default_template not in self.templates:
            raise ValueError(f"default_template {self.default_template!r} is not in templates")
        if self.idle_timeout < 0:
            raise ValueError("idle_timeout must be >= 0 (0 = never suspend)")
        if self.max_sandboxes < 1:
            raise ValueError("max_sandboxes must be >= 1")


@dataclass(frozen=True)
class PoolConfig:
    """The warm pool (sandbox.warm_pool): sandboxes per template kept restored and paused."""

    size: int = -1  # -1: sized to the host (gateway.sandbox.warm_pool.auto_size); 0: no pool

    def __post_init__(self) -> None:
        if self.size < -1 or self.size > 64:
            raise ValueError("size must be -1 (auto), 0 (off) or up to 64")


@dataclass(frozen=True)
class BuildConfig:
    """Templates built from a Dockerfile (gateway.builds.service, docs/templates.md)."""

    # The only hosts a builder VM's proxy connects to (HTTP CONNECT to :443, plain HTTP to :80).
    registry_hosts: tuple[str, ...] = ("deb.debian.org", "security.debian.org", "pypi.org",
                                       "files.pythonhosted.org", "registry.npmjs.org")
    # CA bundle builder VMs trust for HTTPS (the host's: the host is what reaches the
    # registries, through whatever TLS proxy it trusts); "" = the guest's own.
    ca_bundle: str = "/etc/ssl/certs/ca-certificates.crt"
    max_context_bytes: int = 64 * 1024 * 1024  # build context upload (a tar)
    step_timeout: float = 1800.0  # seconds per RUN step
    build_timeout: float = 3600.0  # seconds per build
    background_builtins: bool = True  # build missing served templates after start-up
    # The layer cache's bound (gateway.builds.layer_cache: least recently used first); 0 = none.
    cache_max_mib: int = 20480

    def __post_init__(self) -> None:
        object.__setattr__(self, "registry_hosts", tuple(self.registry_hosts))
        if self.max_context_bytes < 1024:
            raise ValueError("max_context_bytes must be >= 1024")
        if self.cache_max_mib < 0:
            raise ValueError("cache_max_mib must be >= 0 (0 = no bound)")
        if not 0 < self.step_timeout <= self.build_timeout:
            raise ValueError("step_timeout must be > 0 and <= build_timeout")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    vm: VMConfig = field(default_factory=VMConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)  # gateway.tenancy.quotas
    pool: PoolConfig = field(default_factory=PoolConfig)  # gateway.sandbox.warm_pool
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)  # gateway.sandbox.resources
    build: BuildConfig = field(default_factory=BuildConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # gateway.cluster, off


def _section(cls: type, data: dict[str, Any], name: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {', '.join(sorted(unknown))}")
    try:
        return cls(**data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"[{name}]: {exc}") from exc


def load(path: Path | None = None, **overrides: Any) -> Config:
    """Read ``path`` (default: the repo's config/agentbox.toml) and apply overrides
    (``listen``, ``data_dir``, ``images_dir``) given on the command line."""
    path = path or DEFAULT_CONFIG
    try:
        raw = tomllib.loads(path.read_text()) if path.exists() else {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    unknown = set(raw) - {"server", "sandbox", "vm", "network", "firecracker", "confine",
                          "tenancy", "pool", "resources", "build", "cluster"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}")
    server_raw = dict(raw.get("server", {}))
    server_raw.update({k: v for k, v in overrides.items() if v is not None})
    if "data_dir" in overrides and overrides["data_dir"] and "images_dir" not in server_raw:
        server_raw["images_dir"] = Path(overrides["data_dir"]) / "images"
    net = _section(NetworkConfig, raw.get("network", {}), "network")
    fc = _section(FirecrackerConfig, raw.get("firecracker", {}), "firecracker")
    confine = _section(ConfineConfig, raw.get("confine", {}), "confine")
    vm = _section(VMConfig, {**raw.get("vm", {}), "network": net, "firecracker": fc,
                             "confine": confine}, "vm")
    return Config(server=_section(ServerConfig, server_raw, "server"),
                  sandbox=_section(SandboxConfig, raw.get("sandbox", {}), "sandbox"), vm=vm,
                  tenancy=_section(TenancyConfig, raw.get("tenancy", {}), "tenancy"),
                  pool=_section(PoolConfig, raw.get("pool", {}), "pool"),
                  resources=_section(ResourcesConfig, raw.get("resources", {}), "resources"),
                  build=_section(BuildConfig, raw.get("build", {}), "build"),
                  cluster=_section(ClusterConfig, raw.get("cluster", {}), "cluster"))
