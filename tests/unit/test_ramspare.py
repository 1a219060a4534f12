"""vmctl.ramspare: spare copies of a golden's memory, and a compact wake that uses one."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from vmctl import memdiff, ramspare, store

MIB = 1 << 20


def _golden(path: Path, seed: bytes = b"g") -> Path:
    with open(path, "wb") as f:
        f.truncate(8 * MIB)
        f.write(seed * MIB)
        f.seek(5 * MIB)
        f.write(os.urandom(MIB))
    return path


def test_fill_makes_durable_copies_and_take_hands_them_out(tmp_path: Path) -> None:
    golden, spares = _golden(tmp_path / "golden"), tmp_path / "sandboxes" / ".ram-spares"
    assert ramspare.fill(spares, golden, 2) == 2 and ramspare.ready(spares, golden) == 2
    assert ramspare.fill(spares, golden, 2) == 0  # already there
    dest = tmp_path / "memory"
    dest.write_bytes(b"what a crashed rebuild left")
    assert ramspare.take(spares, golden, dest)
    assert dest.read_bytes() == golden.read_bytes() and dest.stat().st_mode & 0o777 == 0o600
    assert ramspare.ready(spares, golden) == 1
    assert ramspare.take(spares, golden, tmp_path / "m2") and not ramspare.take(
        spares, golden, tmp_path / "m3")
    assert not list(spares.rglob("*.tmp"))


def test_a_changed_golden_gets_no_spare_of_its_predecessor(tmp_path: Path) -> None:
    golden, spares = _golden(tmp_path / "golden"), tmp_path / ".ram-spares"
    ramspare.fill(spares, golden, 1)
    old_key = ramspare.key(golden)
    _golden(tmp_path / "golden.new", b"h").rename(golden)  # rebuilt: another inode
    assert not ramspare.take(spares, golden, tmp_path / "m")
    ramspare.fill(spares, golden, 1)  # and the stale spares are removed
    assert not (spares / old_key).exists() and ramspare.ready(spares, golden) == 1


def test_a_cancelled_fill_leaves_nothing_half_written(tmp_path: Path) -> None:
    golden, spares = _golden(tmp_path / "golden"), tmp_path / ".ram-spares"
    cancel = threading.Event()
    cancel.set()
    assert ramspare.fill(spares, golden, 1, cancel) == 0
    assert ramspare.ready(spares, golden) == 0 and not list(spares.rglob("*.tmp"))


def test_a_compact_wake_takes_a_spare_and_writes_only_the_diff(tmp_path: Path,
                                                             monkeypatch) -> None:
    from tests.unit.test_store import _compact_snapshot
    d, mem, want = _compact_snapshot(tmp_path)
    golden, spares = tmp_path / "golden", tmp_path / ".ram-spares"
    ramspare.fill(spares, golden, 1)
    copies: list[int] = []
    real = memdiff._copy_golden_into
    monkeypatch.setattr(memdiff, "_copy_golden_into",
                        lambda *a, **k: copies.append(1) or real(*a, **k))
    prepared = store.prepare_memory(d, spares)
    assert prepared is not None and prepared.cloned and ramspare.ready(spares, golden) == 0
    assert store.expand_memory(d, prepared)
    assert mem.read_bytes() == want and copies == []  # the golden's pages came with the spare
    store.load(d)


@pytest.mark.parametrize("spare", [True, False])
def test_without_a_spare_the_wake_rebuilds_it_all(tmp_path: Path, spare: bool) -> None:
    from tests.unit.test_store import _compact_snapshot
    d, mem, want = _compact_snapshot(tmp_path)
    spares = tmp_path / ".ram-spares"
    if spare:  # a spare of another golden is no use
        ramspare.fill(spares, _golden(tmp_path / "other"), 1)
    prepared = store.prepare_memory(d, spares)
    assert prepared is not None
    assert store.expand_memory(d, prepared) and mem.read_bytes() == want
