"""Which VMM and accelerator this host uses, decided once at start-up.

``vmm = "auto"`` picks Firecracker only when its binary is on PATH and a real
KVM works; otherwise QEMU (KVM where the boot probe works, TCG otherwise).
The reason for every choice is logged and exposed, because "why is this slow"
is the first question an operator asks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from vmctl import accel as accel_probe
from vmctl.driver import Driver
from vmctl.drivers.qemu import QemuDriver
from vmctl.network import NetworkConfig
from vmctl.spec import Accel

log = logging.getLogger(__name__)

VMM_CHOICES = ("auto", "qemu", "firecracker")
ACCEL_CHOICES = ("auto", "kvm", "tcg")


@dataclass(frozen=True)
class VMConfig:
    vmm: str = "auto"
    accel: str = "auto"  # QEMU only; "auto" = KVM if the boot probe works
    vcpus: int = 1
    ready_timeout: float = 60.0  # cold boot to agent-ready (TCG is slow)
    restore_timeout: float = 30.0  # restore to agent-ready
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        if self.vmm not in VMM_CHOICES:
            raise ValueError(f"vm.vmm must be one of {VMM_CHOICES}, not {self.vmm!r}")
        if self.accel not in ACCEL_CHOICES:
            raise ValueError(f"vm.accel must be one of {ACCEL_CHOICES}, not {self.accel!r}")


@dataclass(frozen=True)
class Backend:
    driver_name: str
    accel: Accel
    reason: str
    config: VMConfig

    def new_driver(self) -> Driver:
        if self.driver_name == "firecracker":
            from vmctl.drivers.firecracker import FirecrackerDriver
            return FirecrackerDriver()
        return QemuDriver()

    @property
    def key(self) -> str:
        """Identifies snapshots this backend can restore (driver + accelerator)."""
        return f"{self.driver_name}-{self.accel.value}"


async def select(config: VMConfig, kernel: Path) -> Backend:
    if config.vmm in ("auto", "firecracker"):
        usable, why = _firecracker_usable()
        if usable:
            log.info("VMM: firecracker (%s)", why)
            return Backend("firecracker", Accel.KVM, why, config)
        if config.vmm == "firecracker":
            raise RuntimeError(f"vm.vmm = 'firecracker' but Firecracker is not usable: {why}")
        log.info("VMM: not firecracker: %s", why)
    forced = None if config.accel == "auto" else config.accel
    choice = await accel_probe.detect(kernel, forced=forced)
    log.info("VMM: qemu with %s (%s)", choice.accel.value, choice.reason)
    return Backend("qemu", choice.accel, choice.reason, config)


def _firecracker_usable() -> tuple[bool, str]:
    try:
        from vmctl.drivers.firecracker import firecracker_usable
    except ImportError:
        return False, "firecracker driver not installed"
    return firecracker_usable()
