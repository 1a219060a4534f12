"""Kernel clock arguments that make guest boots reliable on a busy host.

Under QEMU TCG the guest's TSC is the host's TSC (QEMU reads it directly), but
the guest kernel does not know its frequency: it calibrates against the PIT,
and when the host is loaded (a parallel build, two VMs on two cores) the
calibration fails, the TSC is marked unstable and the boot hangs for good
(microvm has no HPET or ACPI PM timer to fall back on). Seen here about one
boot in two under load. Telling the kernel the frequency (``tsc_early_khz``)
and that the TSC is trustworthy (``tsc=reliable``: no watchdog comparing it
with the jittery jiffies) makes the boot deterministic. Under KVM the guest
TSC runs at the host's rate too, so the same value stays right.

The frequency is a fact about the host, not the image, so it is added when a
template is loaded (see ``catalog``) rather than baked into its hash.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import statistics
import time
from functools import cache
from pathlib import Path

# rdtsc; shl rdx, 32; or rax, rdx; ret
_RDTSC = bytes.fromhex("0f31" "48c1e220" "4809d0" "c3")


def _rdtsc_function() -> tuple[mmap.mmap, ctypes._CFuncPtr]:
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(_RDTSC)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, ctypes.CFUNCTYPE(ctypes.c_uint64)(addr)


def measure_tsc_khz(samples: int = 5, interval: float = 0.02) -> int | None:
    """Measure the host TSC rate against CLOCK_MONOTONIC (None if impossible)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        buf, rdtsc = _rdtsc_function()
    except (OSError, ValueError, PermissionError):  # W^X policies refuse PROT_EXEC
        return None
    try:
        rates = []
        for _ in range(samples):
            # MONOTONIC_RAW: not slewed by NTP, which would bias the ratio.
            t0, c0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW), rdtsc()
            time.sleep(interval)
            c1, t1 = rdtsc(), time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)
            rates.append((c1 - c0) * 1_000_000 / (t1 - t0))
        return int(round(statistics.median(rates), -1))  # kHz, 10 kHz resolution
    finally:
        del rdtsc
        buf.close()


def cpuinfo_tsc_khz(cpuinfo: str) -> int | None:
    """The kernel's ``cpu MHz`` when it says the TSC frequency is known (a VM host)."""
    flags = mhz = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = value
        elif key.strip() == "cpu MHz" and not mhz:
            mhz = value.strip()
    if "tsc_known_freq" not in flags.split() or not mhz:
        return None
    return int(round(float(mhz) * 1000))


@cache
def tsc_khz() -> int | None:
    """The host TSC rate: as the host kernel was told it (VMs), else measured."""
    try:
        known = cpuinfo_tsc_khz(Path("/proc/cpuinfo").read_text())
    except (OSError, ValueError):
        known = None
    return known or measure_tsc_khz()


def clock_args() -> str:
    """Extra kernel command line for this host ("" if the TSC rate is unknown)."""
    khz = tsc_khz()
    return f"tsc=reliable tsc_early_khz={khz}" if khz else ""
