"""Key layout and the records stored under it."""

from __future__ import annotations

import pytest

from gateway.cluster.errors import ProtocolError
from gateway.cluster.keys import Keys
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.sandbox.states import State


def test_key_layout() -> None:
    keys = Keys("/fleet1")
    assert keys.host("host-a") == "/fleet1/hosts/host-a"
    assert keys.sandbox("sb_123") == "/fleet1/sandboxes/sb_123"
    assert keys.election("reaper") == "/fleet1/elections/reaper"
    assert keys.name_in(keys.hosts, b"/fleet1/hosts/host-a") == "host-a"
    assert Keys().hosts == "/agentbox/hosts/"


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "A", "-a", "a" * 64])
def test_names_cannot_escape_their_directory(bad: str) -> None:
    with pytest.raises(ValueError):
        Keys().host(bad)


@pytest.mark.parametrize("bad", ["a/b", "", "../x", "x" * 129, "a b"])
def test_sandbox_ids_are_checked(bad: str) -> None:
    with pytest.raises(ValueError):
        Keys().sandbox(bad)


def test_records_round_trip() -> None:
    host = HostRecord("host-a", "10.0.0.1:8080", 8192, 4096, 4, 2, 3)
    assert HostRecord.decode(host.encode()) == host
    sandbox = SandboxRecord("sb1", "host-a", State.SUSPENDED, gen=4, snapshot="s3://b/sb1")
    assert SandboxRecord.decode(sandbox.encode()) == sandbox
    moved = sandbox.moved_to("host-b", State.RESTORING)
    assert (moved.host, moved.gen, moved.state, moved.snapshot) == (
        "host-b", 5, State.RESTORING, "s3://b/sb1")


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b'{"id": "sb1"}',
    b'{"id": "sb1", "host": "h", "state": "bogus", "gen": 1}',
    b'{"id": "sb1", "host": "h", "state": "running", "gen": 0}',
    b'{"id": "sb1", "host": "h", "state": "running", "gen": 1, "extra": 1}',
    b'{"id": "sb1", "host": "h", "state": "running", "snapshot": "' + b"x" * 20000 + b'"}',
])
def test_bad_sandbox_records_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        SandboxRecord.decode(raw)


def test_bad_host_records_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        HostRecord.decode(b'{"name": "h", "address": "a:1", "free_mib": -1}')
    with pytest.raises(ProtocolError):
        HostRecord.decode(b'{"name": "h", "address": "a:1", "awake": true}')
