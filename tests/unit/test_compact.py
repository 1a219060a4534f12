"""vmctl.compact on small sparse files: punch what equals the golden, refill it exactly."""

from __future__ import annotations

import os

from vmctl import compact

C = compact.CHUNK


def make(tmp_path):
    golden, memory = tmp_path / "golden", tmp_path / "memory"
    base = os.urandom(8 * C)
    golden.write_bytes(base)
    mem = bytearray(base)
    mem[3 * C + 5] ^= 0xFF  # chunk 3 dirtied
    mem[6 * C:7 * C] = bytes(C)  # chunk 6 zeroed by the guest: differs, must be kept
    memory.write_bytes(bytes(mem))
    return golden, memory, bytes(mem)


def test_compact_punches_identical_chunks_and_refill_restores_every_byte(tmp_path):
    golden, memory, want = make(tmp_path)
    ranges = compact.identical_ranges(memory, golden)
    assert ranges == [(0, 3 * C), (4 * C, 6 * C), (7 * C, 8 * C)]
    rf = tmp_path / compact.RANGES_FILE
    before = os.stat(memory).st_blocks
    assert compact.compact(memory, golden, rf) == 6 * C
    assert os.stat(memory).st_blocks < before and rf.exists()
    assert memory.read_bytes() != want
    assert compact.refill(memory, rf) == 6 * C
    assert memory.read_bytes() == want and not rf.exists()
    assert compact.refill(memory, rf) == 0  # nothing listed: nothing to do


def test_refill_after_a_crash_before_any_punch_is_harmless(tmp_path):
    golden, memory, want = make(tmp_path)
    rf = tmp_path / compact.RANGES_FILE
    compact.compact(memory, golden, rf)
    compact.refill(memory, rf)
    # The list written, no hole punched yet (a crash in between): refill copies equal bytes.
    ranges = compact.identical_ranges(memory, golden)
    rf.write_text(__import__("json").dumps({"golden": str(golden), "ranges": ranges}))
    compact.refill(memory, rf)
    assert memory.read_bytes() == want
