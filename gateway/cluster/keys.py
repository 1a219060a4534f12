"""Where everything lives in etcd: the one place that spells a key.

    {prefix}/hosts/{host}            HostRecord JSON, on the host's lease (gone when it dies)
    {prefix}/sandboxes/{sandbox_id}  SandboxRecord JSON {host, state, snapshot, gen}
    {prefix}/elections/{name}        etcd election keys (the reaper, later)
    {prefix}/apikeys/{key_id}        KeyRecord JSON (gateway.cluster.keyring): the hash, never
                                     the secret
    {prefix}/usage/{key_id}/{host}   a tenant's sandboxes on one host (gateway.cluster.quota)
    {prefix}/epoch                   the fleet's epoch: a random token written when etcd has
                                     none, renewed when etcd went back in time (restored from
                                     a backup): gateway.cluster.publisher never destroys a copy
                                     it published under another epoch
    {prefix}/sessions/{name}         SessionRecord JSON (gateway.cluster.session_names): who
                                     holds a session name fleet-wide

``prefix`` defaults to ``/agentbox``; tests and fleets sharing one etcd give each their own.
Names are checked here so a key can never be made to escape its directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.cluster.wire import prefix_end

_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_PREFIX = re.compile(r"(/[A-Za-z0-9._-]+)+")


def check_host_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"host name must be a DNS label ([a-z0-9-], 1-63), not {name!r}")
    return name


def check_sandbox_id(sandbox_id: str) -> str:
    if not isinstance(sandbox_id, str) or not _SANDBOX_ID.fullmatch(sandbox_id):
        raise ValueError(f"bad sandbox id {sandbox_id!r}")
    return sandbox_id


@dataclass(frozen=True)
class Keys:
    prefix: str = "/agentbox"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(f"key prefix must look like /name[/name...], not {self.prefix!r}")

    @property
    def hosts(self) -> str:
        return f"{self.prefix}/hosts/"

    def host(self, name: str) -> str:
        return self.hosts + check_host_name(name)

    @property
    def sandboxes(self) -> str:
        return f"{self.prefix}/sandboxes/"

    def sandbox(self, sandbox_id: str) -> str:
        return self.sandboxes + check_sandbox_id(sandbox_id)

    @property
    def api_keys(self) -> str:
        return f"{self.prefix}/apikeys/"

    def api_key(self, key_id: str) -> str:
        return self.api_keys + check_sandbox_id(key_id)  # key ids: the same alphabet

    @property
    def usage_root(self) -> str:
        return f"{self.prefix}/usage/"

    def usage_of(self, tenant: str) -> str:
        return f"{self.usage_root}{check_sandbox_id(tenant)}/"

    def usage(self, tenant: str, host: str) -> str:
        return self.usage_of(tenant) + check_host_name(host)

    @property
    def draining(self) -> str:
        return f"{self.prefix}/draining/"

    def drain(self, host: str) -> str:
        """Present while ``host`` is being drained (``agentbox-server drain``): placement
        skips it and the host moves its sandboxes away (gateway/cluster/drain.py)."""
        return self.draining + check_host_name(host)

    @property
    def epoch(self) -> str:
        return f"{self.prefix}/epoch"

    @property
    def sessions(self) -> str:
        return f"{self.prefix}/sessions/"

    def session(self, name: str) -> str:
        return self.sessions + check_host_name(name)  # session names are DNS labels too

    def election(self, name: str) -> str:
        return f"{self.prefix}/elections/{check_host_name(name)}"

    @staticmethod
    def range_end(directory: str) -> bytes:
        return prefix_end(directory)

    def name_in(self, directory: str, key: bytes) -> str:
        """The last component of ``key`` under ``directory`` (``hosts`` or ``sandboxes``)."""
        text = key.decode()
        if not text.startswith(directory):
            raise ValueError(f"{text!r} is not under {directory!r}")
        return text[len(directory):]
