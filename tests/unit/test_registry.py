import time

import pytest

from gateway.sandbox.states import Event, IllegalTransition, State
from gateway.store.registry import Registry, SandboxRecord


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "r.sqlite")
    yield r
    r.close()


def _rec(i="abc", tenant="t1", slot=0):
    now = time.time()
    return SandboxRecord(id=i, tenant=tenant, template="python", state=State.CREATING, slot=slot,
                         root="/x", golden="/g", idle_timeout=60, host="h", created_at=now,
                         updated_at=now, last_activity=now, metadata={"a": 1})


def test_keys_are_stored_hashed_and_looked_up(reg, tmp_path):
    key, secret = reg.create_key("k1")
    assert reg.lookup_key(secret).id == key.id
    assert reg.lookup_key(secret + "x") is None
    assert secret.encode() not in (tmp_path / "r.sqlite").read_bytes()
    assert reg.revoke_key(key.id) and reg.lookup_key(secret) is None


def test_transitions_are_logged_and_validated(reg):
    reg.insert_sandbox(_rec())
    rec = reg.transition("abc", Event.CREATED, "ok", vmm={"pid": 1})
    assert rec.state is State.RUNNING and rec.vmm == {"pid": 1} and rec.metadata == {"a": 1}
    with pytest.raises(IllegalTransition):
        reg.transition("abc", Event.RESTORED)
    assert reg.get("abc").state is State.RUNNING  # the failed transition changed nothing
    log = reg.transitions("abc")
    assert [(t["from_state"], t["to_state"]) for t in log] == [(None, "creating"),
                                                               ("creating", "running")]


def test_list_is_tenant_scoped_and_hides_destroyed(reg):
    reg.insert_sandbox(_rec("a", "t1", 0))
    reg.insert_sandbox(_rec("b", "t2", 1))
    assert [r.id for r in reg.list("t1")] == ["a"]
    reg.transition("a", Event.DESTROY)
    assert reg.list("t1") == [] and reg.used_slots() == {1}
