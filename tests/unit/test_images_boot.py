"""images/: module metadata from ELF, load order, and the initramfs archive."""

from __future__ import annotations

import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from images import hostclock, proc
from images.initramfs import Entry, newc
from images.kmod import ModuleError, ModuleTree, load_order, modinfo


def elf_with_modinfo(info: bytes) -> bytes:
    """A minimal ELF64 LE object holding a .modinfo section (and .shstrtab)."""
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    data_off = 64
    str_off = data_off + len(info)
    sh_off = str_off + len(shstrtab)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, sh_off, 0, 64, 0, 0, 64, 3, 2)

    def section(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)

    sections = bytes(64) + section(1, data_off, len(info)) + section(10, str_off, len(shstrtab))
    return header + info + shstrtab + sections


def make_tree(root: Path, modules: dict[str, str], builtin: list[str]) -> ModuleTree:
    for name, depends in modules.items():
        path = root / "kernel" / "drivers" / f"{name}.ko"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(elf_with_modinfo(
            b"license=GPL\0depends=" + depends.encode() + b"\0name=" + name.encode() + b"\0"))
    (root / "modules.builtin").write_text("".join(f"kernel/fs/{b}.ko\n" for b in builtin))
    return ModuleTree(root)


def test_modinfo_reads_the_section(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {"virtio_blk": "virtio,virtio_ring"}, [])
    info = modinfo(tree.index()["virtio_blk"])
    assert info == {"license": "GPL", "depends": "virtio,virtio_ring", "name": "virtio_blk"}


def test_modinfo_rejects_non_elf(tmp_path: Path) -> None:
    (tmp_path / "x.ko").write_bytes(b"not an elf file at all")
    with pytest.raises(ModuleError):
        modinfo(tmp_path / "x.ko")


def test_load_order_puts_dependencies_first_and_skips_builtins(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {
        "virtio_ring": "", "virtio": "virtio_ring", "virtio_blk": "virtio,virtio_ring",
        "virtio-rng": "virtio,virtio_ring", "net_failover": "failover", "failover": "",
        "virtio_net": "virtio_ring,virtio,net_failover",
    }, builtin=["ext4", "jbd2"])
    order = [p.name for p in load_order(tree, ["virtio_blk", "ext4", "virtio_net", "virtio_rng"])]
    assert order == ["virtio_ring.ko", "virtio.ko", "virtio_blk.ko", "failover.ko",
                     "net_failover.ko", "virtio_net.ko", "virtio-rng.ko"]


def test_load_order_missing_module_is_an_error(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {"virtio_blk": "virtio"}, [])
    with pytest.raises(ModuleError, match="'virtio'"):
        load_order(tree, ["virtio_blk"])


def test_load_order_detects_cycles(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {"a": "b", "b": "a"}, [])
    with pytest.raises(ModuleError, match="cycle"):
        load_order(tree, ["a"])


def parse_newc(blob: bytes) -> list[tuple[str, int, bytes]]:
    out, pos = [], 0
    while True:
        assert blob[pos:pos + 6] == b"070701"
        fields = [int(blob[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        namesize, filesize, mode = fields[11], fields[6], fields[1]
        name = blob[pos + 110: pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        data = blob[pos:pos + filesize]
        pos += filesize + (-(pos + filesize) % 4)
        if name == "TRAILER!!!":
            return out
        out.append((name, mode, data))


def test_newc_round_trips() -> None:
    entries = [Entry("bin", stat.S_IFDIR | 0o755), Entry("init", stat.S_IFREG | 0o755, b"#!x"),
               Entry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
               Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))]
    blob = newc(entries)
    assert len(blob) % 4 == 0
    assert parse_newc(blob) == [(e.name, e.mode, e.data) for e in entries]
    assert newc(entries) == blob  # reproducible


@pytest.mark.skipif(shutil.which("cpio") is None, reason="cpio(1) not installed")
def test_newc_is_readable_by_cpio() -> None:
    blob = newc([Entry("init", stat.S_IFREG | 0o755, b"hello"),
                 Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))])
    listing = subprocess.run(["cpio", "-itv", "--quiet"], input=blob,
                             capture_output=True, check=True).stdout.decode().splitlines()
    assert listing[0].startswith("-rwxr-xr-x") and listing[0].endswith(" init")
    assert listing[1].startswith("crw-------") and listing[1].split()[4:6] == ["5,", "1"]


CPUINFO_VM = "processor\t: 0\ncpu MHz\t\t: 2100.000\nflags\t\t: fpu tsc tsc_known_freq\n"
CPUINFO_METAL = "processor\t: 0\ncpu MHz\t\t: 800.123\nflags\t\t: fpu tsc constant_tsc\n"


def test_cpuinfo_tsc_only_when_the_kernel_knows_it() -> None:
    assert hostclock.cpuinfo_tsc_khz(CPUINFO_VM) == 2_100_000
    # Without tsc_known_freq, "cpu MHz" is the current (scaled) core clock: useless.
    assert hostclock.cpuinfo_tsc_khz(CPUINFO_METAL) is None


def test_measured_tsc_is_plausible() -> None:
    khz = hostclock.measure_tsc_khz(samples=3, interval=0.01)
    if khz is None:
        pytest.skip("rdtsc not available here")
    assert 500_000 < khz < 10_000_000


def test_clock_args_name_the_frequency() -> None:
    args = hostclock.clock_args()
    assert args == "" or args.startswith("tsc=reliable tsc_early_khz=")


def test_run_logs_output_and_quotes_it_on_failure(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    with open(log_path, "w") as log:
        assert proc.run(["sh", "-c", "echo hello"], log=log) == "hello\n"
        with pytest.raises(proc.BuildError, match="(?s)exited with 3.*boom"):
            proc.run(["sh", "-c", "echo boom >&2; exit 3"], log=log)
    assert "hello" in log_path.read_text() and "$ sh -c" in log_path.read_text()


def test_stage_records_timings_and_reports_failure(tmp_path: Path) -> None:
    seen: list[str] = []
    with open(tmp_path / "log", "w") as log:
        ctx = proc.BuildContext(seen.append, log, label="t")
        with ctx.stage("one"):
            pass
        with pytest.raises(RuntimeError), ctx.stage("two"):
            raise RuntimeError("x")
    assert set(ctx.timings) == {"one"}
    assert seen[0] == "[t] one ..." and seen[1].startswith("[t] one done in")
    assert seen[-1].startswith("[t] two FAILED")
