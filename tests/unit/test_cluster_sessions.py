"""Session names across the fleet (docs/cluster.md, "Sessions across the fleet"): the
record, the routing decision (no I/O), the reservation against an in-process fake of
etcd's txn, and the session service's use of it (taken, held elsewhere, etcd down)."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.cluster import routing, wire
from gateway.cluster.errors import EtcdUnavailable, ProtocolError
from gateway.cluster.keys import Keys
from gateway.cluster.records import SandboxRecord, SessionRecord
from gateway.cluster.routes import Route, RouteTable
from gateway.cluster.session_names import SessionNames
from gateway.errors import SandboxNotFound, Unavailable
from gateway.preview import sessions
from gateway.sandbox.states import State
from gateway.store.registry import Registry

KEYS = Keys("/t")


# -- the record ----------------------------------------------------------------------------

def test_a_session_record_round_trips_and_is_parsed_strictly() -> None:
    record = SessionRecord("my-app", "key1", "host-a", "sbx1")
    assert SessionRecord.decode(record.encode()) == record
    assert SessionRecord.decode(b'{"name": "x", "tenant": "t", "host": "h"}').sandbox_id == ""
    for bad in (b'{"name": "Bad_Name", "tenant": "t", "host": "h"}',
                b'{"name": "x", "tenant": "", "host": "h"}',
                b'{"name": "x", "tenant": "t", "host": "h", "sandbox_id": "../x"}',
                b'{"name": "x", "tenant": "t", "host": "h", "extra": 1}',
                b'[1]', b'{', b'{"name": "x", "tenant": "t", "host": "h", "sandbox_id": 3}',
                b'{"name": "x", "tenant": "' + b"t" * 20000 + b'", "host": "h"}'):
        with pytest.raises(ProtocolError):
            SessionRecord.decode(bad)


def test_session_keys_are_spelled_in_keys_and_checked() -> None:
    assert KEYS.session("my-app") == "/t/sessions/my-app"
    with pytest.raises(ValueError):
        KEYS.session("../hosts/x")


def test_the_route_table_keeps_session_records_and_skips_bad_ones() -> None:
    table = RouteTable(KEYS)
    good = SessionRecord("app", "key1", "host-a")
    kv = wire.KeyValue(KEYS.session("app").encode(), good.encode(), 5, 5, 1, 0)
    bad = wire.KeyValue(KEYS.session("bad").encode(), b"{", 6, 6, 1, 0)
    table.load(6, [kv, bad])
    assert table.sessions == {"app": good} and table.skipped == 1
    table.apply((wire.Event(wire.EventType.DELETE,
                            wire.KeyValue(KEYS.session("app").encode(), b"", 0, 7, 0, 0)),))
    assert table.sessions == {}


# -- the decision --------------------------------------------------------------------------

def _route(host: str, address: str | None = "10.0.0.2:8080") -> Route:
    return Route("sbx1", host, 2, address, SandboxRecord("sbx1", host, State.RUNNING, gen=2))


ADDRESSES = {"host-a": "10.0.0.1:8080", "host-b": "10.0.0.2:8080"}


def _decide(record: SessionRecord | None, route: Route | None, *, me: str = "host-a",
            hop: str | None = None, fenced: str | None = None, put: bool = False
            ) -> routing.Decision:
    return routing.decide_session("app", record, route, ADDRESSES.get, me, forwarded_by=hop,
                                  fenced=fenced, put=put)


def test_a_session_goes_to_its_sandboxs_owner() -> None:
    record = SessionRecord("app", "key1", "host-a", "sbx1")
    assert _decide(record, _route("host-b")) == routing.Forward("host-b", "10.0.0.2:8080", 2)
    assert _decide(record, _route("host-a")) == routing.ServeHere()
    assert _decide(record, _route("host-b", None)).code == "owner_unavailable"  # type: ignore
    assert _decide(record, _route("host-b"), hop="host-c").code == "forward_loop"  # type: ignore


def test_without_a_known_sandbox_a_session_goes_to_the_host_holding_its_name() -> None:
    making = SessionRecord("app", "key1", "host-b")
    assert _decide(making, None) == routing.Forward("host-b", "10.0.0.2:8080", 0)
    gone = SessionRecord("app", "key1", "host-b", "sbx-gone")
    assert _decide(gone, None) == routing.Forward("host-b", "10.0.0.2:8080", 0)
    assert _decide(making, None, me="host-b") == routing.ServeHere()
    dead = SessionRecord("app", "key1", "host-z")
    assert _decide(dead, None).code == "owner_unavailable"  # type: ignore[union-attr]
    assert _decide(making, None, hop="host-c").code == "forward_loop"  # type: ignore


def test_an_unknown_session_is_served_here_and_a_fenced_host_refuses() -> None:
    assert _decide(None, None) == routing.ServeHere()
    assert _decide(None, None, fenced="lease lost").code == "host_fenced"  # type: ignore
    mine = SessionRecord("app", "key1", "host-a")
    assert _decide(mine, None, fenced="lease lost").code == "host_fenced"  # type: ignore


def test_a_put_placed_here_is_served_here_even_when_another_host_holds_the_name() -> None:
    """Its reservation says who holds the name and forwards it there (SessionElsewhere)."""
    other = SessionRecord("app", "key1", "host-b")
    assert _decide(other, None, hop="host-c", put=True) == routing.ServeHere()
    assert _decide(other, None, hop="host-c").code == "forward_loop"  # type: ignore


@pytest.mark.parametrize(("path", "name"), [
    ("/v1/sessions/app", "app"), ("/v1/sessions/app/proxy/x/y", "app"),
    ("/v1/sessions", None), ("/v1/sessions/Bad", None), ("/v1/sessions/-x", None),
    ("/v1/sandboxes/app", None)])
def test_which_session_a_path_is_for(path: str, name: str | None) -> None:
    assert routing.session_in_path(path) == name


# -- the reservation (an in-process fake of etcd's kv and txn) -------------------------------

class FakeEtcd:
    """Enough of etcd's kv for SessionNames: compares on create/mod revision, put, delete,
    get; each txn yields once first, so racing reservations interleave."""

    def __init__(self) -> None:
        self.kvs: dict[bytes, wire.KeyValue] = {}
        self.rev = itertools.count(2)
        self.down = False

    async def get(self, key: str) -> wire.KeyValue | None:
        self._up()
        return self.kvs.get(key.encode() if isinstance(key, str) else key)

    async def txn(self, compares: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None) -> wire.TxnResult:
        await asyncio.sleep(0)
        self._up()
        ok = all(self._holds(c) for c in compares)
        rev = next(self.rev)
        out = [self._op(op, rev) for op in (success if ok else failure or [])]
        return wire.TxnResult(rev, ok, tuple(out))

    def _up(self) -> None:
        if self.down:
            raise EtcdUnavailable("no member answered")

    def _holds(self, compare: dict[str, Any]) -> bool:
        kv = self.kvs.get(wire.unb64(compare["key"]))
        field = compare["target"].lower()
        have = 0 if kv is None else (kv.create_revision if field == "create" else
                                     kv.mod_revision)
        want = int(compare["create_revision" if field == "create" else "mod_revision"])
        return have == want

    def _op(self, op: dict[str, Any], rev: int) -> Any:
        if "request_put" in op:
            key, value = (wire.unb64(op["request_put"][f]) for f in ("key", "value"))
            old = self.kvs.get(key)
            self.kvs[key] = wire.KeyValue(key, value, old.create_revision if old else rev, rev,
                                          1, 0)
            return {}
        if "request_delete_range" in op:
            self.kvs.pop(wire.unb64(op["request_delete_range"]["key"]), None)
            return {}
        kv = self.kvs.get(wire.unb64(op["request_range"]["key"]))
        return wire.RangeResult(rev, (kv,) if kv else (), 1 if kv else 0, False)


async def test_two_hosts_racing_for_one_name_cannot_both_win() -> None:
    etcd = FakeEtcd()
    a, b = (SessionNames(etcd, KEYS, h) for h in ("host-a", "host-b"))  # type: ignore[arg-type]
    for i in range(10):
        got = await asyncio.gather(a.reserve(f"n{i}", "key1"), b.reserve(f"n{i}", "key1"))
        assert sorted(got, key=str) == sorted([None, ("key1", "host-a" if got[0] is None
                                                      else "host-b")], key=str)
    got = await asyncio.gather(a.reserve("x", "key1"), b.reserve("x", "key2"))
    assert got.count(None) == 1
    assert await a.reserve("n0", "key1") in (None, ("key1", "host-b"))  # idempotent


async def test_release_and_bind_change_only_this_hosts_record() -> None:
    etcd = FakeEtcd()
    a, b = (SessionNames(etcd, KEYS, h) for h in ("host-a", "host-b"))  # type: ignore[arg-type]
    assert await a.reserve("app", "key1") is None
    await a.bind("app", "sbx1")
    assert SessionRecord.decode((await etcd.get(KEYS.session("app"))).value).sandbox_id == "sbx1"
    await b.release("app", "key1")  # not b's: left alone
    assert await etcd.get(KEYS.session("app")) is not None
    await a.release("app", "key1")
    assert await etcd.get(KEYS.session("app")) is None
    assert await b.reserve("app", "key2") is None  # free again


async def test_an_unreachable_etcd_is_503_never_a_local_reservation() -> None:
    etcd = FakeEtcd()
    a = SessionNames(etcd, KEYS, "host-a")  # type: ignore[arg-type]
    etcd.down = True
    with pytest.raises(Unavailable) as err:
        await a.reserve("app", "key1")
    assert err.value.status == 503 and err.value.headers["Retry-After"]


async def test_publish_writes_only_absent_names() -> None:
    etcd = FakeEtcd()
    a, b = (SessionNames(etcd, KEYS, h) for h in ("host-a", "host-b"))  # type: ignore[arg-type]
    assert await b.reserve("taken", "key9") is None
    await a.publish([_row("mine", "key1", "sbx1"), _row("taken", "key1", "sbx2")])
    held = {k: SessionRecord.decode(v.value) for k, v in etcd.kvs.items()}
    assert held[KEYS.session("mine").encode()] == SessionRecord("mine", "key1", "host-a", "sbx1")
    assert held[KEYS.session("taken").encode()].host == "host-b"


def _row(name: str, tenant: str, sandbox_id: str) -> dict[str, Any]:
    return {"name": name, "tenant": tenant, "sandbox_id": sandbox_id, "port": 8000,
            "start": None, "start_state": "none", "start_pid": None}


# -- the session service with fleet names --------------------------------------------------

class FakeService:
    def __init__(self) -> None:
        self.config = SimpleNamespace(server=SimpleNamespace(preview_domain="p.test",
                                                             session_domain="s.test"))
        self.made: list[str] = []

    def spawn(self, coro: Any, name: str) -> asyncio.Task:
        return asyncio.create_task(coro, name=name)

    async def create(self, tenant: str, *_: Any) -> Any:
        await asyncio.sleep(0.01)
        self.made.append(f"sbx{len(self.made)}")
        return SimpleNamespace(id=self.made[-1])

    async def destroy(self, tenant: str, sandbox_id: str) -> None:
        if sandbox_id not in self.made:
            raise SandboxNotFound(sandbox_id)
        self.made.remove(sandbox_id)


def _service(tmp_path: Any, names: SessionNames) -> tuple[sessions.SessionService, FakeService]:
    fake = FakeService()
    registry = Registry(tmp_path / f"{names.host}.sqlite")
    registry.get = lambda sid: (SimpleNamespace(state=State.RUNNING)  # type: ignore
                                if sid in fake.made else None)
    service = sessions.SessionService(fake, registry)  # type: ignore[arg-type]
    service.fleet = names
    return service, fake


async def test_the_session_service_reserves_before_it_inserts(tmp_path: Any) -> None:
    etcd = FakeEtcd()
    a, fake_a = _service(tmp_path, SessionNames(etcd, KEYS, "host-a"))  # type: ignore
    b, fake_b = _service(tmp_path, SessionNames(etcd, KEYS, "host-b"))  # type: ignore
    session, created = await a.ensure("key1", "app", sessions.SessionSpec())
    assert created and session.sandbox_id == "sbx0"
    assert SessionRecord.decode((await etcd.get(KEYS.session("app"))).value) == \
        SessionRecord("app", "key1", "host-a", "sbx0", 8000, None, "none", None)
    assert (await a.ensure("key1", "app", sessions.SessionSpec()))[1] is False
    with pytest.raises(sessions.SessionNameTaken):
        await b.ensure("key2", "app", sessions.SessionSpec())
    with pytest.raises(sessions.SessionElsewhere) as where:
        await b.ensure("key1", "app", sessions.SessionSpec())
    assert where.value.host == "host-a" and fake_b.made == []
    assert b.registry.get_session("app") is None
    etcd.down = True
    with pytest.raises(Unavailable):
        await b.ensure("key1", "other", sessions.SessionSpec())
    assert b.registry.get_session("other") is None  # never reserved locally alone
    with pytest.raises(Unavailable):
        await a.delete("key1", "app")
    assert a.registry.get_session("app") is not None  # kept, so the DELETE can be retried
    etcd.down = False
    await a.delete("key1", "app")
    assert await etcd.get(KEYS.session("app")) is None and a.registry.get_session("app") is None


def test_with_cluster_off_the_session_names_module_is_never_imported() -> None:
    import subprocess
    import sys

    probe = ("import sys; from gateway.config import load; from gateway.http.app import "
             "build_app; build_app(load(None)); import gateway.preview.sessions; "
             "print([m for m in sys.modules if m in ('gateway.cluster.session_names', "
             "'gateway.cluster.routing', 'gateway.http.cluster_forward')])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
