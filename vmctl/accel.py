"""Choose KVM or TCG for QEMU: KVM only where a real boot probe works.

``/dev/kvm`` existing is not enough: on PVM hosts (module ``kvm_pvm``) a stock
kernel prints its decompressor banner and then hangs. The probe boots the
template's kernel with no root device under KVM; a working KVM gets far enough
to print ``Linux version`` and panic on the missing root fs (QEMU then exits
because of ``-no-reboot``). Anything else within the time limit means TCG.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vmctl.spec import Accel

log = logging.getLogger(__name__)

PVM_MODULE = Path("/sys/module/kvm_pvm")
PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class AccelChoice:
    accel: Accel
    reason: str


async def detect(kernel: Path, qemu: str = "qemu-system-x86_64",
                 forced: str | None = None) -> AccelChoice:
    if forced in ("kvm", "tcg"):
        return AccelChoice(Accel(forced), f"forced by config ({forced})")
    if PVM_MODULE.exists():
        return AccelChoice(Accel.TCG, "host KVM is PVM (kvm_pvm loaded): stock guest kernels hang")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelChoice(Accel.TCG, "/dev/kvm missing or not accessible")
    if await _kvm_boots(kernel, qemu):
        return AccelChoice(Accel.KVM, "KVM boot probe succeeded")
    return AccelChoice(Accel.TCG, "KVM boot probe failed (kernel did not start under KVM)")


async def _kvm_boots(kernel: Path, qemu: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="agentbox-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        proc = await asyncio.create_subprocess_exec(
            qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128M",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-kernel", str(kernel), "-append", "console=ttyS0 panic=-1",
            "-serial", f"file:{console}",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        try:
            await asyncio.wait_for(proc.wait(), PROBE_TIMEOUT_S)
        except TimeoutError:
            pass
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        text = console.read_text(errors="replace") if console.exists() else ""
    ok = "Linux version" in text and ("Kernel panic" in text or "VFS:" in text)
    log.info("KVM boot probe: %s", "ok" if ok else "failed")
    return ok
