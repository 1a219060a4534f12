"""Typed descriptions of what a driver boots and what it leaves behind."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guest.protocol import GUEST_MAC, TAP_NAME
from vmctl.confine import Confinement


class Accel(enum.Enum):
    KVM = "kvm"
    TCG = "tcg"


@dataclass(frozen=True)
class VMSpec:
    """Everything needed to start one VM. Identical for boot and restore of the same VM,
    except paths (which never enter the saved device state)."""

    vm_id: str
    workdir: Path  # per-VM directory: control sockets, console log
    kernel: Path
    disk: Path  # the VM's own writable disk (qcow2 overlay for QEMU)
    mem_file: Path  # file backing guest RAM (QEMU: memory-backend-file share=on)
    initrd: Path | None = None
    cmdline: str = "console=ttyS0"
    mem_mib: int = 256
    vcpus: int = 1
    netns: str | None = None  # run the VMM inside this network namespace
    tap: str = TAP_NAME
    mac: str = GUEST_MAC
    accel: Accel = Accel.TCG
    confinement: Confinement | None = None  # None: the VMM runs unconfined (as the daemon)

    def __post_init__(self) -> None:
        if self.mem_mib < 64:
            raise ValueError("mem_mib must be >= 64")
        if not 1 <= self.vcpus <= 32:
            raise ValueError("vcpus must be 1..32")


@dataclass(frozen=True)
class SnapshotFiles:
    """A saved VM: device state + guest memory + the disk layer it was taken with."""

    state: Path
    memory: Path
    disk: Path
    accel: Accel
    driver: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VMMRecord:
    """What the registry stores to find a running VMM again after a daemon restart."""

    driver: str
    pid: int
    control_socket: str
    workdir: str
    accel: str
    started_at: float
