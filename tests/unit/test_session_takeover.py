"""A session follows its sandbox to another host (docs/cluster.md, "A session follows its
sandbox"): the takeover decision (no I/O), the record's new fields, the compare-and-set
move of the record's host, the session service inserting the row from it (the start
command never sent again), and the old host dropping its stale row at start-up."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.cluster.errors import ProtocolError
from gateway.cluster.records import SessionRecord
from gateway.cluster.session_names import SessionNames
from gateway.cluster.session_takeover import decide_takeover, row_of
from gateway.errors import OwnerUnavailable
from gateway.preview import sessions
from gateway.sandbox.states import State
from gateway.store.registry import Registry
from tests.unit.test_cluster_sessions import KEYS, FakeEtcd, FakeService

MOVED = SessionRecord("app", "key1", "host-a", "sbx1", 9000, "python3 app.py", "started", 42)


# -- the decision --------------------------------------------------------------------------

def test_the_new_owner_of_the_sandbox_takes_the_session() -> None:
    assert decide_takeover(MOVED, "key1", "key1", "host-b") == "take"
    assert decide_takeover(MOVED, None, "key1", "host-b") == "take"  # a session host


def test_while_the_sandbox_is_still_arriving_the_answer_is_wait_not_absent() -> None:
    assert decide_takeover(MOVED, "key1", None, "host-b") == "wait"


@pytest.mark.parametrize(("record", "tenant", "sandbox_tenant"), [
    (None, "key1", "key1"),                                     # unknown to the fleet
    (MOVED, "key2", "key1"),                                    # another tenant asks
    (MOVED, "key1", "key2"),                                    # the sandbox is not theirs
    (SessionRecord("app", "key1", "host-b", "sbx1"), "key1", "key1"),  # ours: row deleted
    (SessionRecord("app", "key1", "host-a"), "key1", None),     # no sandbox yet
])
def test_nothing_to_take(record: SessionRecord | None, tenant: str,
                         sandbox_tenant: str | None) -> None:
    assert decide_takeover(record, tenant, sandbox_tenant, "host-b") == "absent"


def test_the_row_carries_the_port_and_the_starts_recorded_state() -> None:
    row = row_of(MOVED, 5.0)
    assert (row["port"], row["start"], row["start_state"], row["start_pid"]) == \
        (9000, "python3 app.py", "started", 42)


# -- the record ----------------------------------------------------------------------------

def test_the_record_carries_what_the_row_needs_and_old_records_parse() -> None:
    assert SessionRecord.decode(MOVED.encode()) == MOVED
    old = SessionRecord.decode(b'{"name": "x", "tenant": "t", "host": "h", "sandbox_id": "s"}')
    assert (old.port, old.start, old.start_state, old.start_pid) == (8000, None, "none", None)
    base = b'{"name": "x", "tenant": "t", "host": "h", '
    for bad in (b'"port": 0}', b'"port": "80"}', b'"port": true}', b'"start_state": "ran"}',
                b'"start_pid": -1}', b'"start": 5}', b'"start": "' + b"x" * 9000 + b'"}'):
        with pytest.raises(ProtocolError):
            SessionRecord.decode(base + bad)


# -- the move in etcd ----------------------------------------------------------------------

async def _held(etcd: FakeEtcd, name: str = "app") -> SessionRecord:
    return SessionRecord.decode((await etcd.get(KEYS.session(name))).value)


async def test_take_over_moves_the_records_host_by_compare_and_set() -> None:
    etcd = FakeEtcd()
    a, b = (SessionNames(etcd, KEYS, h) for h in ("host-a", "host-b"))  # type: ignore[arg-type]
    assert await a.reserve("app", "key1") is None
    await a.bind("app", "sbx1", port=9000, start="python3 app.py", start_state="started",
                 start_pid=42)
    here = {"sbx1": "key1"}
    assert await b.take_over("app", "key2", here.get) is None  # another tenant's
    with pytest.raises(OwnerUnavailable) as wait:
        await b.take_over("app", "key1", {}.get)  # not arrived yet
    assert wait.value.status == 503 and wait.value.headers["Retry-After"]
    assert await b.take_over("app", "key1", {}.get, wait=False) is None
    row = await b.take_over("app", "key1", here.get)
    assert row is not None and row["start_state"] == "started" and row["port"] == 9000
    assert await _held(etcd) == SessionRecord("app", "key1", "host-b", "sbx1", 9000,
                                              "python3 app.py", "started", 42)
    assert await b.take_over("app", "key1", here.get) is None  # already b's
    await a.bind("app", "sbx9")  # the old host can no longer change it
    assert (await _held(etcd)).sandbox_id == "sbx1"
    etcd.down = True
    with pytest.raises(OwnerUnavailable):
        await SessionNames(etcd, KEYS, "host-c").take_over(  # type: ignore[arg-type]
            "app", "key1", here.get)


async def test_a_record_changed_between_read_and_write_is_read_again() -> None:
    etcd = FakeEtcd()
    a, b = (SessionNames(etcd, KEYS, h) for h in ("host-a", "host-b"))  # type: ignore[arg-type]
    assert await a.reserve("app", "key1") is None
    await a.bind("app", "sbx1")
    real_txn, raced = etcd.txn, []

    async def racing_txn(*args: Any, **kw: Any) -> Any:
        if not raced:  # the old host writes in between: the compare fails once
            raced.append(1)
            await a.bind("app", "sbx1", start_state="started", start_pid=7)
        return await real_txn(*args, **kw)

    etcd.txn = racing_txn  # type: ignore[method-assign]
    row = await b.take_over("app", "key1", {"sbx1": "key1"}.get)
    assert row is not None and row["start_state"] == "started" and row["start_pid"] == 7
    assert (await _held(etcd)).host == "host-b"


# -- the session service -------------------------------------------------------------------

def _service(tmp_path: Any, names: SessionNames, made: list[str]) -> sessions.SessionService:
    fake = FakeService()
    fake.made = made
    registry = Registry(tmp_path / f"{names.host}.sqlite")
    registry.get = lambda sid: (SimpleNamespace(state=State.RUNNING, tenant="key1")  # type: ignore
                                if sid in fake.made else None)
    service = sessions.SessionService(fake, registry)  # type: ignore[arg-type]
    service.fleet = names
    return service


async def test_the_new_owner_serves_the_session_and_never_starts_it_again(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    etcd = FakeEtcd()
    started: list[str] = []

    async def start_command(machine: Any, req: Any) -> Any:
        started.append(req.command)
        return SimpleNamespace(pid=42)

    class Use:
        async def __aenter__(self) -> None: ...
        async def __aexit__(self, *exc: Any) -> None: ...

    monkeypatch.setattr(sessions.guest, "start_command", start_command)
    a = _service(tmp_path, SessionNames(etcd, KEYS, "host-a"), [])  # type: ignore[arg-type]
    a.service.use = lambda *_: Use()  # type: ignore[attr-defined]
    session, _ = await a.ensure("key1", "app", sessions.SessionSpec(port=9000, start="run"))
    assert started == ["run"] and session.start_state == "started"
    assert (await _held(etcd)).start_state == "started"

    on_b: list[str] = []  # the sandbox is not on b yet: 503, not session_not_found
    b = _service(tmp_path, SessionNames(etcd, KEYS, "host-b"), on_b)  # type: ignore[arg-type]
    with pytest.raises(OwnerUnavailable):
        await b.find("key1", "app")
    on_b.append(session.sandbox_id)  # adopted / migrated here
    with pytest.raises(sessions.SessionNotFound):
        await b.find("key2", "app")
    got = await b.find("key1", "app")
    assert (got.sandbox_id, got.port, got.start_state, got.start_pid) == \
        (session.sandbox_id, 9000, "started", 42)
    assert (await b.ensure("key1", "app", sessions.SessionSpec(start="run")))[1] is False
    assert started == ["run"] and (await _held(etcd)).host == "host-b"

    # The old host comes back: its row is dropped, never republished over b's record.
    stale = await a.fleet.publish(a.registry.list_sessions(None))  # type: ignore[union-attr]
    assert stale == ["app"] and (await _held(etcd)).host == "host-b"


async def test_a_put_on_the_new_owner_takes_the_session_over(tmp_path: Any) -> None:
    etcd = FakeEtcd()
    a = _service(tmp_path, SessionNames(etcd, KEYS, "host-a"), [])  # type: ignore[arg-type]
    session, _ = await a.ensure("key1", "app", sessions.SessionSpec())
    b = _service(tmp_path, SessionNames(etcd, KEYS, "host-b"),  # type: ignore[arg-type]
                 [session.sandbox_id])
    got, created = await b.ensure("key1", "app", sessions.SessionSpec())
    assert not created and got.sandbox_id == session.sandbox_id
    await b.delete("key1", "app")  # the new holder can free the name
    assert await etcd.get(KEYS.session("app")) is None


# -- the periodic pass ---------------------------------------------------------------------

def test_the_sweep_takes_arrived_sessions_and_drops_stale_rows() -> None:
    records = [MOVED,                                               # its sandbox is here
               SessionRecord("away", "key1", "host-a", "sbx2"),     # not arrived: wait
               SessionRecord("left", "key1", "host-c", "sbx3"),     # left here, taken by c
               SessionRecord("mine", "key1", "host-b", "sbx4"),     # ours
               SessionRecord("alike", "key1", "host-c", "sbx5"),    # another sandbox
               SessionRecord("other", "key2", "host-a", "sbx6")]    # sandbox not theirs
    rows = {"left": ("key1", "sbx3"), "mine": ("key1", "sbx4"), "alike": ("key1", "sbx9")}
    here = {"sbx1": "key1", "sbx4": "key1", "sbx6": "key1"}
    assert decide_takeover(records[-1], None, "key1", "host-b") == "absent"
    take, drop = SessionNames(FakeEtcd(), KEYS, "host-b",  # type: ignore[arg-type]
                              lambda: records).sweep(rows, here.get)
    assert (take, drop) == (["app"], ["left"])
    here["sbx3"] = "key1"  # the sandbox has not left yet: the row stays
    assert SessionNames(FakeEtcd(), KEYS, "host-b",  # type: ignore[arg-type]
                        lambda: records).sweep(rows, here.get)[1] == []


async def test_follow_once_takes_over_and_drops_without_a_request(tmp_path: Any) -> None:
    etcd = FakeEtcd()
    cache: list[SessionRecord] = []
    a = _service(tmp_path, SessionNames(etcd, KEYS, "host-a",  # type: ignore[arg-type]
                                        lambda: cache), [])
    session, _ = await a.ensure("key1", "app", sessions.SessionSpec(port=9000))
    moved: list[str] = []
    b = _service(tmp_path, SessionNames(etcd, KEYS, "host-b",  # type: ignore[arg-type]
                                        lambda: cache), moved)
    cache[:] = [await _held(etcd)]
    await b.follow_once()
    assert b.registry.get_session("app") is None  # not arrived yet
    moved.append(session.sandbox_id)
    a.service.made.remove(session.sandbox_id)  # type: ignore[attr-defined]
    await b.follow_once()
    assert b.registry.get_session("app")["port"] == 9000  # type: ignore[index]
    cache[:] = [await _held(etcd)]
    assert cache[0].host == "host-b"
    await a.follow_once()
    assert a.registry.get_session("app") is None and (await _held(etcd)).host == "host-b"
