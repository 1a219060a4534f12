"""SQLite registry: API keys, sandboxes, and every state transition.

Synchronous sqlite3 on the event loop thread: each statement touches a handful
of rows in a WAL-mode database and takes well under a millisecond, which is
cheaper than a thread hop. ``transition`` writes the new state and the
transition log row in one transaction, before the caller acts on it.

The ``Registry`` class is the seam for moving to PostgreSQL when sandboxes are
spread over several hosts (each row already carries its ``host``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
import socket
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.store import at_rest
from gateway.store.feed import Transition
from gateway.sandbox.states import Event, State, next_state

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
  id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT NOT NULL UNIQUE,
  admin INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
  limits TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, template TEXT NOT NULL, state TEXT NOT NULL,
  metadata TEXT NOT NULL DEFAULT '{}', slot INTEGER NOT NULL, root TEXT NOT NULL,
  golden TEXT NOT NULL, vmm TEXT, idle_timeout REAL NOT NULL, host TEXT NOT NULL,
  created_at REAL NOT NULL, updated_at REAL NOT NULL, last_activity REAL NOT NULL,
  suspend_count INTEGER NOT NULL DEFAULT 0, restore_count INTEGER NOT NULL DEFAULT 0,
  last_suspend_ms REAL, last_restore_ms REAL, failure TEXT);
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes(tenant, state);
CREATE TABLE IF NOT EXISTS transitions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT NULL, from_state TEXT,
  to_state TEXT NOT NULL, event TEXT NOT NULL, cause TEXT NOT NULL DEFAULT '', at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS transitions_sandbox ON transitions(sandbox_id, seq);
CREATE TABLE IF NOT EXISTS sandbox_preview (
  sandbox_id TEXT PRIMARY KEY, token TEXT NOT NULL, public_ports TEXT NOT NULL DEFAULT '[]',
  updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
  name TEXT PRIMARY KEY, tenant TEXT NOT NULL, sandbox_id TEXT, port INTEGER NOT NULL,
  start TEXT, start_state TEXT NOT NULL DEFAULT 'none', start_pid INTEGER, start_error TEXT,
  metadata TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_tenant ON sessions(tenant, name);
CREATE TABLE IF NOT EXISTS templates (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, golden_dir TEXT NOT NULL,
  source TEXT NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL,
  parent TEXT, base TEXT, size_bytes INTEGER NOT NULL DEFAULT 0, meta TEXT NOT NULL DEFAULT '{}');
CREATE INDEX IF NOT EXISTS templates_tenant ON templates(tenant, name);
CREATE TABLE IF NOT EXISTS published (
  sandbox_id TEXT NOT NULL, key_prefix TEXT NOT NULL, at REAL NOT NULL,
  epoch TEXT NOT NULL DEFAULT '', revision INTEGER NOT NULL DEFAULT 0,
  term INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (sandbox_id, key_prefix));
CREATE TABLE IF NOT EXISTS daemon_runs (
  id INTEGER PRIMARY KEY AUTOINCREMENT, started_at REAL NOT NULL, heartbeat REAL NOT NULL);
"""
_ASLEEP = (State.SUSPENDED, State.FAILED)


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    admin: bool
    created_at: float
    # Per-key overrides of the [tenancy] defaults (gateway.tenancy.quotas.Limits field -> value).
    limits: dict[str, Any] = field(default_factory=dict, hash=False)
    revoked: bool = False


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    tenant: str
    template: str
    state: State
    slot: int
    root: str
    golden: str
    idle_timeout: float
    host: str
    created_at: float
    updated_at: float
    last_activity: float
    metadata: dict[str, Any] = field(default_factory=dict)
    vmm: dict[str, Any] | None = None
    suspend_count: int = 0
    restore_count: int = 0
    last_suspend_ms: float | None = None
    last_restore_ms: float | None = None
    failure: str | None = None
    # Lifetimes (gateway.sandbox.expiry): absolute TTL deadline, seconds asleep before deletion
    # (0 = never), and the bytes of the last snapshot on disk (gateway.tenancy.usage).
    expires_at: float | None = None
    auto_delete_after: float = 0.0
    snapshot_bytes: int = 0
    asleep_since: float | None = None  # when it last went SUSPENDED or FAILED from awake
    egress: dict[str, Any] | None = None  # sandbox.egress_policy's stored form; None: host default
    # The shape (gateway.sandbox.resources); 0 in rows made before shapes: the golden's.
    vcpus: int = 0
    memory_mib: int = 0
    disk_mib: int = 0


def hash_key(key: str) -> str:
    # Keys are 256-bit random tokens, so a fast hash is enough (no dictionary to attack).
    return hashlib.sha256(key.encode()).hexdigest()


class Registry:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.host = socket.gethostname()
        at_rest.private_file(Path(path))  # 0600 before SQLite opens it (its -wal/-shm follow)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._migrate()
        # Called with each committed insert and transition, after the commit (the live feed,
        # gateway.store.feed.Feed.publish; with [cluster] on, the record publisher,
        # gateway.cluster.publisher): must not block; an exception is logged, never raised
        # into the caller, and undoes nothing.
        self.listeners: list[Callable[[Transition], None]] = []
        # Called with a key's id after it is minted, its limits change or it is revoked
        # here (with [cluster] on: gateway.cluster.keyring, which replicates keys); same
        # rules as ``listeners``. ``store_key`` (a change heard from the fleet) calls none.
        self.key_listeners: list[Callable[[str], None]] = []

    def _migrate(self) -> None:
        """Bring a database made by an older daemon up to SCHEMA (columns added since)."""
        cols = {r["name"] for r in self._db.execute("PRAGMA table_info(api_keys)")}
        if "limits" not in cols:
            self._db.execute("ALTER TABLE api_keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}'")
        cols = {r["name"] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        for name, decl in (("expires_at", "REAL"),
                           ("auto_delete_after", "REAL NOT NULL DEFAULT 0"),
                           ("snapshot_bytes", "INTEGER NOT NULL DEFAULT 0"),
                           ("asleep_since", "REAL")):
            if name not in cols:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")
        if "egress" not in cols:
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN egress TEXT")
        for col in ("vcpus", "memory_mib", "disk_mib"):  # per-sandbox shape
            if col not in cols:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {col} INTEGER NOT NULL "
                                 "DEFAULT 0")
        cols = {r["name"] for r in self._db.execute("PRAGMA table_info(published)")}
        for name, decl in (("epoch", "TEXT NOT NULL DEFAULT ''"),  # '': marked before epochs
                           ("revision", "INTEGER NOT NULL DEFAULT 0"),
                           ("term", "INTEGER NOT NULL DEFAULT 0")):
            if name not in cols:
                self._db.execute(f"ALTER TABLE published ADD COLUMN {name} {decl}")

    def close(self) -> None:
        self._db.close()

    # -- API keys ----------------------------------------------------------------

    def create_key(self, name: str, admin: bool = False,
                   limits: dict[str, Any] | None = None) -> tuple[ApiKey, str]:
        """Mint a key; returns its record and the secret (shown once, stored hashed)."""
        secret = "ab_" + secrets.token_urlsafe(32)
        key = ApiKey(id="key_" + secrets.token_hex(6), name=name, admin=admin,
                     created_at=time.time(), limits=dict(limits or {}))
        self._db.execute("INSERT INTO api_keys (id, name, key_hash, admin, created_at, limits) "
                         "VALUES (?, ?, ?, ?, ?, ?)",
                         (key.id, name, hash_key(secret), int(admin), key.created_at,
                          json.dumps(key.limits)))
        self._key_changed(key.id)
        return key, secret

    def lookup_key(self, secret: str) -> ApiKey | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE key_hash = ? AND revoked = 0",
                               (hash_key(secret),)).fetchone()
        return _key_row(row) if row else None

    def get_key(self, key_id: str) -> ApiKey | None:
        """A key by id, revoked or not."""
        row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return _key_row(row) if row else None

    def list_keys(self, include_revoked: bool = False) -> list[ApiKey]:
        where = "" if include_revoked else " WHERE revoked = 0"
        rows = self._db.execute(f"SELECT * FROM api_keys{where} ORDER BY created_at")
        return [_key_row(r) for r in rows]

    def set_key_limits(self, key_id: str, limits: dict[str, Any]) -> bool:
        done = self._db.execute("UPDATE api_keys SET limits = ? WHERE id = ?",
                                (json.dumps(limits), key_id)).rowcount > 0
        return self._key_changed(key_id) if done else False

    def revoke_key(self, key_id: str) -> bool:
        done = self._db.execute("UPDATE api_keys SET revoked = 1 WHERE id = ?",
                                (key_id,)).rowcount > 0
        return self._key_changed(key_id) if done else False

    def _key_changed(self, key_id: str) -> bool:
        for listener in list(self.key_listeners):
            try:
                listener(key_id)
            except Exception:
                log.exception("key listener failed for %s", key_id)
        return True

    def keys_with_hashes(self) -> list[tuple[ApiKey, str]]:
        """Every key (revoked too) with its stored hash: what a fleet replicates."""
        rows = self._db.execute("SELECT * FROM api_keys ORDER BY created_at")
        return [(_key_row(r), r["key_hash"]) for r in rows]

    def store_key(self, key: ApiKey, key_hash: str) -> None:
        """Insert or update a key heard from the fleet (no listeners called). Revocation
        is final: a revoked key stays revoked whatever arrives later."""
        self._db.execute(
            "INSERT INTO api_keys (id, name, key_hash, admin, created_at, revoked, limits) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET name = excluded.name, "
            "key_hash = excluded.key_hash, admin = excluded.admin, limits = excluded.limits, "
            "revoked = MAX(revoked, excluded.revoked)",
            (key.id, key.name, key_hash, int(key.admin), key.created_at, int(key.revoked),
             json.dumps(key.limits)))

    def has_admin_key(self) -> bool:
        return self._db.execute(
            "SELECT 1 FROM api_keys WHERE admin = 1 AND revoked = 0").fetchone() is not None

    # -- sandboxes ---------------------------------------------------------------

    def insert_sandbox(self, rec: SandboxRecord, event: str = "insert",
                       cause: str = "created by API", replace_destroyed: bool = False) -> None:
        """``replace_destroyed``: a DESTROYED row of the same id is replaced (a sandbox
        adopted back by a host it once left: gateway.sandbox.adoption)."""
        row = _to_row(rec)
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._tx():
            if replace_destroyed:
                self._db.execute("DELETE FROM sandboxes WHERE id = ? AND state = 'destroyed'",
                                 (rec.id,))
            self._db.execute(f"INSERT INTO sandboxes ({cols}) VALUES ({marks})", list(row.values()))
            done = self._log(rec.id, None, rec.state, event, cause, rec.tenant)
        self._emit(done)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _from_row(row) if row else None

    def list(self, tenant: str | None = None,
             include_destroyed: bool = False) -> list[SandboxRecord]:
        sql, args = "SELECT * FROM sandboxes WHERE 1=1", []
        if tenant is not None:
            sql, args = sql + " AND tenant = ?", [tenant]
        if not include_destroyed:
            sql += " AND state != 'destroyed'"
        return [_from_row(r) for r in self._db.execute(sql + " ORDER BY created_at", args)]

    def used_slots(self) -> set[int]:
        rows = self._db.execute("SELECT slot FROM sandboxes WHERE state != 'destroyed'")
        return {r["slot"] for r in rows}

    def transition(self, sandbox_id: str, event: Event, cause: str = "",
                   **updates: Any) -> SandboxRecord:
        """Apply ``event`` (validated against the table) and ``updates`` atomically."""
        with self._tx():
            rec = self.get(sandbox_id)
            if rec is None:
                raise KeyError(sandbox_id)
            new = next_state(rec.state, event)
            if new in _ASLEEP and rec.state not in _ASLEEP:  # gateway.sandbox.expiry counts from it
                updates.setdefault("asleep_since", time.time())
            self._update(sandbox_id, state=new, **updates)
            done = self._log(sandbox_id, rec.state, new, event.value, cause, rec.tenant)
        self._emit(done)
        out = self.get(sandbox_id)
        assert out is not None
        return out

    def update(self, sandbox_id: str, **updates: Any) -> None:
        with self._tx():
            self._update(sandbox_id, **updates)

    def transitions(self, sandbox_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM transitions WHERE sandbox_id = ? ORDER BY seq",
                                (sandbox_id,))
        return [dict(r) for r in rows]

    def tenant_transitions(self, tenant: str | None) -> list[dict[str, Any]]:
        """Every transition of a key's sandboxes (all keys' for None), with the tenant,
        in order per sandbox (gateway.tenancy.usage)."""
        sql = ("SELECT t.sandbox_id, t.from_state, t.to_state, t.event, t.at, s.tenant "
               "FROM transitions t JOIN sandboxes s ON s.id = t.sandbox_id")
        args: list[Any] = []
        if tenant is not None:
            sql, args = sql + " WHERE s.tenant = ?", [tenant]
        return [dict(r) for r in self._db.execute(sql + " ORDER BY t.sandbox_id, t.seq", args)]

    # -- the fleet: which sandboxes' records etcd has held naming this host -----------

    def mark_published(self, sandbox_id: str, key_prefix: str, epoch: str = "",
                       revision: int = 0, term: int = 0) -> None:
        """etcd (under ``key_prefix``, in fleet ``epoch``) has held this sandbox's record
        naming this host, at ``revision`` and raft ``term`` (gateway.cluster.publisher):
        from then on, its record's absence in that epoch (etcd not older) means its new
        owner deleted it after a move, and the local copy is destroyed, not republished.
        A later mark replaces it."""
        self._db.execute("INSERT OR REPLACE INTO published (sandbox_id, key_prefix, at, epoch, "
                         "revision, term) VALUES (?, ?, ?, ?, ?, ?)",
                         (sandbox_id, key_prefix, time.time(), epoch, revision, term))

    def was_published(self, sandbox_id: str, key_prefix: str) -> tuple[str, int, int] | None:
        """The (epoch, revision, raft term) of its mark under this prefix, or None (a fleet
        with another prefix is another fleet: its sandboxes are published there as new)."""
        row = self._db.execute("SELECT epoch, revision, term FROM published WHERE "
                               "sandbox_id = ? AND key_prefix = ?",
                               (sandbox_id, key_prefix)).fetchone()
        return None if row is None else (row["epoch"], row["revision"], row["term"])

    # -- daemon runs: when a daemon was up (gateway.tenancy.usage closes a crash's intervals) --

    def start_run(self) -> int:
        now = time.time()
        cur = self._db.execute("INSERT INTO daemon_runs (started_at, heartbeat) VALUES (?, ?)",
                               (now, now))
        assert cur.lastrowid is not None
        return cur.lastrowid

    def heartbeat(self, run_id: int) -> None:
        self._db.execute("UPDATE daemon_runs SET heartbeat = ? WHERE id = ?",
                         (time.time(), run_id))

    def downtimes(self) -> list[tuple[float, float]]:
        """(last heartbeat of a run, start of the next) for each gap between daemon runs."""
        rows = list(self._db.execute("SELECT started_at, heartbeat FROM daemon_runs ORDER BY id"))
        return [(a["heartbeat"], b["started_at"]) for a, b in zip(rows, rows[1:], strict=False)]

    # -- preview access (gateway/preview/access.py) and sessions (gateway/preview/sessions.py) --

    def preview_access(self, sandbox_id: str) -> tuple[str, list[int]] | None:
        row = self._db.execute("SELECT token, public_ports FROM sandbox_preview "
                               "WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
        return (row["token"], json.loads(row["public_ports"])) if row else None

    def set_preview_access(self, sandbox_id: str, token: str, public_ports: list[int]) -> None:
        self._db.execute("INSERT OR REPLACE INTO sandbox_preview (sandbox_id, token, "
                         "public_ports, updated_at) VALUES (?, ?, ?, ?)",
                         (sandbox_id, token, json.dumps(public_ports), time.time()))

    def insert_session(self, row: dict[str, Any]) -> bool:
        """Reserve a session name; False if it is taken (names are global: host routing)."""
        row = {k: _encode(v) for k, v in row.items()}
        try:
            self._db.execute(f"INSERT INTO sessions ({', '.join(row)}) VALUES "
                             f"({', '.join('?' for _ in row)})", list(row.values()))
        except sqlite3.IntegrityError:
            return False
        return True

    def get_session(self, name: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM sessions WHERE name = ?", (name,)).fetchone()
        return _session_row(row) if row else None

    def list_sessions(self, tenant: str | None) -> list[dict[str, Any]]:
        """``tenant``'s sessions (None: every tenant's)."""
        rows = (self._db.execute("SELECT * FROM sessions ORDER BY name") if tenant is None else
                self._db.execute("SELECT * FROM sessions WHERE tenant = ? ORDER BY name",
                                 (tenant,)))
        return [_session_row(r) for r in rows]

    def update_session(self, name: str, **updates: Any) -> None:
        updates["updated_at"] = time.time()
        row = {k: _encode(v) for k, v in updates.items()}
        self._db.execute(f"UPDATE sessions SET {', '.join(f'{k} = ?' for k in row)} "
                         "WHERE name = ?", [*row.values(), name])

    def delete_session(self, name: str) -> None:
        self._db.execute("DELETE FROM sessions WHERE name = ?", (name,))

    # -- tenant templates (gateway/templates/catalog.py decides; this stores) ---------------

    def insert_template(self, row: dict[str, Any]) -> None:
        row = {k: _encode(v) for k, v in row.items()}
        self._db.execute(f"INSERT INTO templates ({', '.join(row)}) VALUES "
                         f"({', '.join('?' for _ in row)})", list(row.values()))

    def list_templates(self, tenant: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM templates", []
        if tenant is not None:
            sql, args = sql + " WHERE tenant = ?", [tenant]
        rows = self._db.execute(sql + " ORDER BY created_at", args)
        return [dict(r) | {"meta": json.loads(r["meta"] or "{}")} for r in rows]

    def update_template(self, template_id: str, **updates: Any) -> None:
        row = {k: _encode(v) for k, v in updates.items()}
        self._db.execute(f"UPDATE templates SET {', '.join(f'{k} = ?' for k in row)} "
                         "WHERE id = ?", [*row.values(), template_id])

    def delete_template(self, template_id: str) -> None:
        self._db.execute("DELETE FROM templates WHERE id = ?", (template_id,))

    # -- internals ----------------------------------------------------------------

    def _update(self, sandbox_id: str, **updates: Any) -> None:
        updates["updated_at"] = time.time()
        row = {k: _encode(v) for k, v in updates.items()}
        sets = ", ".join(f"{k} = ?" for k in row)
        self._db.execute(f"UPDATE sandboxes SET {sets} WHERE id = ?", [*row.values(), sandbox_id])

    def _log(self, sandbox_id: str, src: State | None, dst: State, event: str, cause: str,
             tenant: str) -> Transition:
        at = time.time()
        cur = self._db.execute("INSERT INTO transitions (sandbox_id, from_state, to_state, "
                               "event, cause, at) VALUES (?, ?, ?, ?, ?, ?)",
                               (sandbox_id, src.value if src else None, dst.value, event, cause,
                                at))
        return Transition(cur.lastrowid or 0, sandbox_id, tenant, src.value if src else None,
                          dst.value, event, cause, at)

    def _emit(self, item: Transition) -> None:
        """Tell the listeners about a committed transition (a nested transaction's is told
        before the outer one commits: none is nested today)."""
        for listener in self.listeners:
            try:
                listener(item)
            except Exception:
                log.exception("transition listener %r failed", listener)

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT/ROLLBACK; nested use joins the outer transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> None:
        self.outer = not self.db.in_transaction
        if self.outer:
            self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self.outer:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _encode(value: Any) -> Any:
    if isinstance(value, State):
        return value.value
    if isinstance(value, dict):
        return json.dumps(value)
    return value


def _to_row(rec: SandboxRecord) -> dict[str, Any]:
    return {k: _encode(v) for k, v in dataclasses.asdict(rec).items()
            if not (k == "vmm" and v is None)} | {"state": rec.state.value}


def _key_row(row: sqlite3.Row) -> ApiKey:
    return ApiKey(row["id"], row["name"], bool(row["admin"]), row["created_at"],
                  json.loads(row["limits"] or "{}"), bool(row["revoked"]))


def _session_row(row: sqlite3.Row) -> dict[str, Any]:
    return dict(row) | {"metadata": json.loads(row["metadata"] or "{}")}


def _from_row(row: sqlite3.Row) -> SandboxRecord:
    data = dict(row)
    data["state"] = State(data["state"])
    data["metadata"] = json.loads(data["metadata"] or "{}")
    data["vmm"] = json.loads(data["vmm"]) if data["vmm"] else None
    data["egress"] = json.loads(data["egress"]) if data.get("egress") else None
    return SandboxRecord(**data)
