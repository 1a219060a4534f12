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


def test_a_rebuild_over_what_a_crashed_one_left_is_exact(tmp_path: Path) -> None:
    """The wake's two steps: ``prepare`` empties whatever is at the final path (a rebuild
    that died half-way), so the next rebuild gives the same bytes; zero pages stay holes."""
    rng = random.Random(3)
    size = 16 * MIB
    golden, memory = tmp_path / "golden", tmp_path / "memory"
    _sparse(golden, size, {0: rng.randbytes(2 * MIB) + bytes(MIB) + rng.randbytes(MIB)})
    _sparse(memory, size, {0: golden.read_bytes()[:4 * MIB], 9 * MIB: b"guest wrote this"})
    memdiff.compact(memory, golden, tmp_path / "diff")
    out = tmp_path / "out"
    out.write_bytes(rng.randbytes(size + 12345))  # junk, and too long
    os.chmod(out, 0o644)
    cloned = memdiff.prepare(golden, out)
    assert out.stat().st_size == size and out.stat().st_mode & 0o777 == 0o600
    if not cloned:
        assert out.stat().st_blocks == 0  # emptied: nothing of the junk is left
    memdiff.rebuild(tmp_path / "diff", golden, out, cloned)
    assert _digest(out) == _digest(memory)
    if not cloned:  # the golden's zero MiB was not copied
        assert out.stat().st_blocks * 512 <= 4 * MIB


def test_golden_runs_are_its_non_zero_pages(tmp_path: Path) -> None:
    page = memdiff.PAGE
    data = b"a" * page + bytes(page) + b"b" * 2 * page + bytes(3 * page) + b"c" * 10
    _sparse(tmp_path / "g", 8 * MIB, {MIB: data})
    assert memdiff.golden_runs(tmp_path / "g") == [
        (MIB, MIB + page), (MIB + 2 * page, MIB + 4 * page),
        (MIB + 7 * page, MIB + 8 * page)]  # the whole page its 10 bytes are in


def test_a_rebuild_refuses_a_file_of_the_wrong_size(tmp_path: Path) -> None:
    _sparse(tmp_path / "g", 4 * MIB, {0: b"a" * 8192})
    _sparse(tmp_path / "m", 4 * MIB, {0: b"b" * 8192})
    memdiff.compact(tmp_path / "m", tmp_path / "g", tmp_path / "d")
    (tmp_path / "o").write_bytes(b"short")
    with pytest.raises(memdiff.DiffError, match="not 4194304"):
        memdiff.rebuild(tmp_path / "d", tmp_path / "g", tmp_path / "o")


def test_punching_zero_pages_keeps_the_bytes_and_frees_their_blocks(tmp_path: Path) -> None:
    page, path = memdiff.PAGE, tmp_path / "g"
    rng = random.Random(3)
    pages = [bytes(page) if rng.random() < 0.6 else rng.randbytes(page) for _ in range(1024)]
    pages[-1] = bytes(page - 1) + b"x"  # a non-zero last byte keeps its page
    with open(path, "wb") as f:  # every page written: zero ones too, as a zeroing guest does
        f.write(b"".join(pages))
        f.truncate(6 * MIB)  # and a hole after them
    before, digest = path.stat().st_blocks * 512, _digest(path)
    freed = memdiff.punch_zero_pages(path)
    assert _digest(path) == digest and path.stat().st_size == 6 * MIB
    # Every zero page is a hole and every other page data (st_blocks also counts the
    # extent tree the holes cost, so the freed bytes are compared loosely).
    fd = os.open(path, os.O_RDONLY)
    try:
        assert memdiff._data_ranges(fd, 6 * MIB) == memdiff.golden_runs(path)
    finally:
        os.close(fd)
    zero = sum(p == bytes(page) for p in pages)
    assert zero * page - 64 * 1024 <= freed == before - path.stat().st_blocks * 512
    assert memdiff.golden_runs(path)[-1][1] == 1024 * page  # its one non-zero byte kept it
    assert memdiff.punch_zero_pages(path) <= 0  # nothing left to give back
