"""Session names and specs (pure validation) and the registry rows behind sessions."""

from __future__ import annotations

import pytest

from gateway.errors import BadRequest
from gateway.store.registry import Registry
from gateway.preview.sessions import SessionSpec, validate_name, validate_spec


@pytest.mark.parametrize("name", ["a", "alice", "a-b", "a1", "1a", "x" * 63, "8000-abc"])
def test_good_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "A", "-a", "a-", "a_b", "a.b", "x" * 64, "é"])
def test_bad_names(name):
    with pytest.raises(BadRequest):
        validate_name(name)


def test_preview_like_names_are_reserved_when_the_domains_are_equal():
    with pytest.raises(BadRequest):
        validate_name("8000-abc", reserve_preview_labels=True)
    assert validate_name("demo-1", reserve_preview_labels=True) == "demo-1"


def test_spec_defaults_and_validation():
    assert validate_spec({}) == SessionSpec()
    spec = validate_spec({"template": "python", "port": 3000, "idle_timeout": 30,
                          "start": "npm start", "metadata": {"a": 1}})
    assert (spec.port, spec.idle_timeout, spec.start, spec.metadata) == (3000, 30.0,
                                                                         "npm start", {"a": 1})
    for bad in ({"port": 0}, {"port": 65536}, {"port": "80"}, {"port": True}, {"start": " "},
                {"start": 1}, {"template": ""}, {"idle_timeout": -1}, {"metadata": []},
                {"unknown": 1}, []):
        with pytest.raises(BadRequest):
            validate_spec(bad)


def test_registry_session_rows(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    row = {"name": "alice", "tenant": "t1", "port": 8000, "start": "x", "metadata": {"k": 1},
           "created_at": 1.0, "updated_at": 1.0}
    assert reg.insert_session(row)
    assert not reg.insert_session({**row, "tenant": "t2"})  # names are global
    reg.update_session("alice", sandbox_id="sb1", start_state="started", start_pid=7)
    got = reg.get_session("alice")
    assert (got["sandbox_id"], got["start_state"], got["start_pid"], got["metadata"]) == \
        ("sb1", "started", 7, {"k": 1})
    assert [s["name"] for s in reg.list_sessions("t1")] == ["alice"]
    assert reg.list_sessions("t2") == []
    reg.delete_session("alice")
    assert reg.get_session("alice") is None
    reg.close()
    # The tables are created on an existing database too (CREATE TABLE IF NOT EXISTS).
    again = Registry(tmp_path / "r.sqlite")
    assert again.preview_access("nope") is None
    again.close()
