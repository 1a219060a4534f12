"""Whether this host takes a session over (no I/O): its sandbox moved here.

A session's row lives in the registry of the host that made it; its fleet record
(``{prefix}/sessions/{name}``, records.SessionRecord) names the sandbox and carries what the
row needs (port, start command and the start's recorded state). When the sandbox moves
(the reaper's adoption, a drain's migration or hand-over), routing follows the sandbox to
its new owner, which has no row. On the first request there for the session, that host
reads the record and decides here:

- ``take``: the record's sandbox is registered here for the record's tenant and the record
  names another host: insert the row from the record and move the record's ``host`` here
  (compare-and-set on the revision read). The start command is never sent again: its
  recorded state comes with the row (a started process lives on in the VM's memory; after
  a cold boot from disk it is not re-run either, as on one host, where a session's start
  runs once in its sandbox's life).
- ``wait``: the record names another host and its sandbox is not (yet) registered here:
  the sandbox is still being adopted or migrated here (routing sent the request to its new
  owner): 503 ``owner_unavailable`` with Retry-After, never ``session_not_found``.
- ``absent``: nothing to take (no record, another tenant's, or the record is this host's:
  the row was deleted here): ``session_not_found``, as on one host.

Besides the first request, a periodic pass (``sweep``, every few seconds, over the route
cache's session records) takes over sessions whose sandbox arrived here, and drops the rows
of sessions another host took over with their sandbox (the drained host's, which stays
up); a host coming back drops its stale rows at start-up (SessionNames.publish).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from gateway.cluster.records import SessionRecord

Takeover = Literal["take", "wait", "absent"]


def decide_takeover(record: SessionRecord | None, tenant: str | None,
                    sandbox_tenant: str | None, self_host: str) -> Takeover:
    """``tenant``: the asker's (None: any, e.g. a session host, checked later);
    ``sandbox_tenant``: the tenant of the record's sandbox in this host's registry (None:
    not registered here)."""
    if record is None or record.host == self_host or not record.sandbox_id:
        return "absent"
    if tenant is not None and record.tenant != tenant:
        return "absent"
    if sandbox_tenant is None:
        return "wait"
    return "take" if sandbox_tenant == record.tenant else "absent"


def taken(record: SessionRecord, self_host: str) -> SessionRecord:
    """The record once this host holds the session."""
    from dataclasses import replace

    return replace(record, host=self_host)


def row_of(record: SessionRecord, now: float) -> dict[str, object]:
    """The registry row a host inserts when it takes the session over."""
    return {"name": record.name, "tenant": record.tenant, "sandbox_id": record.sandbox_id,
            "port": record.port, "start": record.start, "start_state": record.start_state,
            "start_pid": record.start_pid, "created_at": now, "updated_at": now}


def sweep(records: Iterable[SessionRecord], rows: Mapping[str, tuple[str, str | None]],
          tenant_of: Callable[[str], str | None], self_host: str
          ) -> tuple[list[str], list[str]]:
    """The periodic pass (without waiting for a request): (names to take over: their
    sandbox arrived here, no row here; names whose row here is stale: another host holds
    the session and its sandbox, which left this host). ``records``: the fleet's session
    records (the route cache's), ``rows``: this host's rows, name -> (tenant, sandbox)."""
    take, drop = [], []
    for record in records:
        if record.host == self_host or not record.sandbox_id:
            continue
        row = rows.get(record.name)
        here = tenant_of(record.sandbox_id)
        if row is None:
            if decide_takeover(record, None, here, self_host) == "take":
                take.append(record.name)
        elif row == (record.tenant, record.sandbox_id) and here is None:
            drop.append(record.name)
    return take, drop
