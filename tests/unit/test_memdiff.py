"""vmctl.memdiff: a compacted RAM file expands back byte for byte."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from vmctl import memdiff

MIB = 1 << 20


def _sparse(path: Path, size: int, chunks: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_expand_restores_the_ram_file_byte_for_byte(tmp_path: Path) -> None:
    rng = random.Random(7)
    size = 64 * MIB
    golden, memory = tmp_path / "golden", tmp_path / "memory"
    base = {off: rng.randbytes(3 * MIB) for off in (0, 10 * MIB, 40 * MIB)}
    _sparse(golden, size, base)
    _sparse(memory, size, base)
    with open(memory, "r+b") as f:
        for page in (5, 6, 7, 2600, 2601):  # inside the golden's data
            f.seek(page * memdiff.PAGE)
            f.write(rng.randbytes(memdiff.PAGE))
        f.seek(20 * MIB + 123)  # where the golden has a hole
        f.write(b"new data in a hole")
        f.seek(11 * MIB)  # the guest zeroed a page the golden has data in
        f.write(bytes(memdiff.PAGE))
    stats = memdiff.compact(memory, golden, tmp_path / "memory.diff")
    assert stats.pages == 7
    assert stats.diff_bytes == 28 + 7 * (memdiff.PAGE + 4)  # header, pages, index
    memdiff.expand(tmp_path / "memory.diff", golden, tmp_path / "out")
    assert _digest(tmp_path / "out") == _digest(memory)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o600


def test_identical_files_compact_to_a_header(tmp_path: Path) -> None:
    _sparse(tmp_path / "g", 8 * MIB, {MIB: b"x" * MIB})
    _sparse(tmp_path / "m", 8 * MIB, {MIB: b"x" * MIB})
    assert memdiff.compact(tmp_path / "m", tmp_path / "g", tmp_path / "d").pages == 0
    memdiff.expand(tmp_path / "d", tmp_path / "g", tmp_path / "o")
    assert _digest(tmp_path / "o") == _digest(tmp_path / "m")


@pytest.mark.parametrize("damage", ["truncate", "magic", "size"])
def test_a_damaged_diff_is_refused_and_leaves_nothing(tmp_path: Path, damage: str) -> None:
    _sparse(tmp_path / "g", 4 * MIB, {0: b"a" * 8192})
    _sparse(tmp_path / "m", 4 * MIB, {0: b"b" * 8192})
    diff = tmp_path / "d"
    memdiff.compact(tmp_path / "m", tmp_path / "g", diff)
    if damage == "truncate":
        with open(diff, "r+b") as f:
            f.truncate(diff.stat().st_size - 1)
    elif damage == "magic":
        with open(diff, "r+b") as f:
            f.write(b"XXXXXXXX")
    else:
        _sparse(tmp_path / "g", 8 * MIB, {})
    with pytest.raises(memdiff.DiffError):
        memdiff.expand(diff, tmp_path / "g", tmp_path / "o")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()
