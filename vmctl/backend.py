"""Which VMM and accelerator this host uses, decided once at start-up.

``vmm = "auto"`` picks Firecracker only when its binary (the pinned release) is
on PATH, a real KVM works and its guest kernel is built; otherwise QEMU (KVM
where the boot probe works, TCG otherwise). The reason for every choice is
logged and exposed, because "why is this slow" is the first question an
operator asks.

The Backend is also where the VMM-specific choices outside the driver are made,
so the rest of vmctl (golden snapshots, Machine) stays VMM-agnostic:

- ``new_driver()``: the driver, configured (Firecracker binary, jailer);
- ``boot_files(image)``: kernel, initrd and command line a template boots with
  (QEMU: the template's Debian bzImage + initramfs; Firecracker: the vmlinux
  from images/firecracker, no initrd, ``init=`` the agent's init);
- ``layout``: where a VM's disk and memory live and what a suspend keeps
  (``vmctl.disks.Layout``).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import os

from vmctl import accel as accel_probe
from vmctl import disks
from vmctl.cgroup import CgroupManager, Hierarchy, daemon_parent
from vmctl.confine import ConfineConfig, Confinement, confinement_for, slot_uid_offset
from vmctl.driver import Driver
from vmctl.drivers.qemu import QemuDriver
from vmctl.network import NetworkConfig
from vmctl.spec import Accel

if TYPE_CHECKING:
    from vmctl.drivers.firecracker import JailerConfig

log = logging.getLogger(__name__)

VMM_CHOICES = ("auto", "qemu", "firecracker")
ACCEL_CHOICES = ("auto", "kvm", "tcg")
DEFAULT_FIRECRACKER_KERNEL = Path("/var/lib/agentbox/images/firecracker/vmlinux")
# Firecracker boots the template's ext4 root directly (no initramfs to find and
# switch to it), so the kernel must start the image's init itself.
FIRECRACKER_INIT = "init=/sbin/agentbox-init"


@dataclass(frozen=True)
class FirecrackerConfig:
    """``[firecracker]``: how to run the ``firecracker`` binary (see docs/bare-metal.md)."""

    binary: str = "firecracker"  # a name on PATH or an absolute path
    jailer: bool = True  # run each VMM through `jailer` (chroot, own uid/gid, cgroup)
    jailer_binary: str = "jailer"
    # One uid/gid for every jailed VMM; unset (the default), each VMM gets its sandbox's
    # own uid from [confine] uid_base, as QEMU VMMs do.
    uid: int | None = None
    gid: int | None = None
    # This daemon's alone (start-up kills jailed VMMs under it that no sandbox owns), on
    # the same filesystem as the data dir (disks are hard-linked in).
    chroot_base: Path = Path("/srv/jailer")

    def __post_init__(self) -> None:
        object.__setattr__(self, "chroot_base", Path(self.chroot_base))
        if not self.binary:
            raise ValueError("firecracker.binary must not be empty")
        if (self.uid is None) != (self.gid is None):
            raise ValueError("firecracker.uid and firecracker.gid go together")
        if self.jailer:
            self.jailer_config()  # JailerConfig's own checks, at start-up

    def jailer_config(self) -> JailerConfig | None:
        if not self.jailer:
            return None
        from vmctl.drivers.firecracker import JailerConfig
        return JailerConfig(uid=self.uid, gid=self.gid, binary=self.jailer_binary,
                            chroot_base=self.chroot_base)


@dataclass(frozen=True)
class VMConfig:
    vmm: str = "auto"
    accel: str = "auto"  # QEMU only; "auto" = KVM if the boot probe works
    # The default shape's vCPUs (a create may ask for another: gateway.sandbox.resources). Two, as
    # E2B's default: the guest agent's work around a call (the zygote's next fork, a child's
    # exit) then runs beside the call instead of in front of the next (bench/README.md).
    vcpus: int = 2
    ready_timeout: float = 60.0  # cold boot to agent-ready (TCG is slow)
    restore_timeout: float = 30.0  # restore to agent-ready
    firecracker_kernel: Path = DEFAULT_FIRECRACKER_KERNEL  # built by `make kernel-firecracker`
    console_log_bytes: int = 1 << 20  # guest console kept per VM (twice this with rotation)
    # Seconds a sandbox sleeps before its memory snapshot is stored as its diff from the
    # golden (vmctl.memdiff; a wake then rebuilds it first); 0 = right after the suspend,
    # negative = never. QEMU only.
    compact_after: float = 600.0
    # A wake starts the VMM while the snapshot is rebuilt (compact) and verified, and hands
    # it the state once both are done (Machine.wake); false: one after the other.
    overlap_restore: bool = True
    # Spare RAM files per golden (vmctl.ramspare): durable copies of its memory, made after a
    # compaction, so a wake from a compact snapshot writes only its diff; 0 = none. QEMU only.
    ram_spares: int = 1
    network: NetworkConfig = field(default_factory=NetworkConfig)
    firecracker: FirecrackerConfig = field(default_factory=FirecrackerConfig)
    confine: ConfineConfig = field(default_factory=ConfineConfig)

    def __post_init__(self) -> None:
        if self.ram_spares < 0:
            raise ValueError("vm.ram_spares must be >= 0")
        if self.console_log_bytes < 4096:
            raise ValueError("vm.console_log_bytes must be >= 4096")
        if self.vmm not in VMM_CHOICES:
            raise ValueError(f"vm.vmm must be one of {VMM_CHOICES}, not {self.vmm!r}")
        if self.accel not in ACCEL_CHOICES:
            raise ValueError(f"vm.accel must be one of {ACCEL_CHOICES}, not {self.accel!r}")
        object.__setattr__(self, "firecracker_kernel", Path(self.firecracker_kernel))


@dataclass(frozen=True)
class BootFiles:
    """What a fresh VM of one template boots (golden build and cold boot)."""

    kernel: Path
    initrd: Path | None
    cmdline: str


@dataclass(frozen=True)
class Backend:
    driver_name: str
    accel: Accel
    reason: str
    config: VMConfig
    cgroups: CgroupManager | None = None  # None: VMMs are not put in cgroups
    confined: bool = False  # QEMU VMMs run confined (vmctl.confine)

    def new_driver(self) -> Driver:
        if self.driver_name == "firecracker":
            from vmctl.drivers.firecracker import FirecrackerDriver
            fc = self.config.firecracker
            return FirecrackerDriver(binary=fc.binary, jailer=fc.jailer_config(),
                                     console_log_bytes=self.config.console_log_bytes)
        return QemuDriver(cgroups=self.cgroups, console_log_bytes=self.config.console_log_bytes)

    def confinement(self, slot_host_addr: str, vm_id: str, workdir: Path,
                    mem_mib: int, vcpus: int | None = None) -> Confinement | None:
        """How the VMM of the VM in the slot at ``slot_host_addr`` runs (None: unconfined)."""
        if not self.confined:
            return None
        return confinement_for(self.config.confine, slot_uid_offset(slot_host_addr), vm_id,
                               workdir, mem_mib, vcpus or self.config.vcpus)

    def for_daemon(self, data_dir: Path) -> Backend:
        """This backend with VMM confinement set up for the daemon owning ``data_dir``
        (its own parent cgroup, swept of what a crashed run left)."""
        cfg = self.config.confine
        if self.driver_name == "firecracker":
            # The jailer confines (chroot, uid, cgroup); we only hand out the uids.
            return replace(self, confined=self.config.firecracker.jailer)
        if not cfg.enabled:
            return self
        if os.geteuid() != 0:
            log.warning("VMM confinement is on but the daemon is not root: VMMs run unconfined")
            return self
        hierarchy = Hierarchy.detect()
        cgroups = None
        if hierarchy is None:
            log.warning("no cgroup hierarchy with memory, cpu and pids: VMMs get no cgroup")
        else:
            cgroups = CgroupManager(hierarchy, daemon_parent(data_dir))
            swept = cgroups.sweep(keep=set())
            if swept:
                log.info("removed %d empty VMM cgroup(s) left by a previous run", len(swept))
            log.info("VMM cgroups: v%d under %s", hierarchy.version, cgroups.parent)
        return replace(self, cgroups=cgroups, confined=True)

    @property
    def key(self) -> str:
        """Identifies snapshots this backend can restore (driver + accelerator)."""
        return f"{self.driver_name}-{self.accel.value}"

    @property
    def layout(self) -> disks.Layout:
        if self.driver_name == "firecracker":
            return disks.FirecrackerLayout()
        return disks.QemuLayout()

    def boot_files(self, image: Any) -> BootFiles:
        """Kernel, initrd and command line for ``image`` (an images.catalog.TemplateImage)."""
        if self.driver_name != "firecracker":
            return BootFiles(image.kernel, image.initrd, image.cmdline)
        cmdline = image.cmdline
        if not any(arg.startswith("init=") for arg in cmdline.split()):
            cmdline = f"{cmdline} {FIRECRACKER_INIT}"
        # Resolved: the golden snapshot records the exact build (the path is a symlink
        # that `make kernel-firecracker` moves), which cold boots of its sandboxes use.
        return BootFiles(self.config.firecracker_kernel.resolve(), None, cmdline)


async def select(config: VMConfig, kernel: Path) -> Backend:
    if config.vmm in ("auto", "firecracker"):
        usable, why = _firecracker_usable(config.firecracker.binary)
        if usable and not config.firecracker_kernel.is_file():
            usable, why = False, (f"Firecracker guest kernel {config.firecracker_kernel} "
                                  "is not built (make kernel-firecracker)")
        fc = config.firecracker
        if usable and fc.jailer and shutil.which(fc.jailer_binary) is None:
            usable, why = False, (f"jailer {fc.jailer_binary!r} is not on PATH (install it "
                                  "from the same release, or set firecracker.jailer = false)")
        if usable:
            log.info("VMM: firecracker (%s; %s)", why,
                     "jailed" if fc.jailer else "NOT jailed: firecracker.jailer = false")
            return Backend("firecracker", Accel.KVM, why, config)
        if config.vmm == "firecracker":
            raise RuntimeError(f"vm.vmm = 'firecracker' but Firecracker is not usable: {why}")
        log.info("VMM: not firecracker: %s", why)
    forced = None if config.accel == "auto" else config.accel
    choice = await accel_probe.detect(kernel, forced=forced)
    log.info("VMM: qemu with %s (%s)", choice.accel.value, choice.reason)
    return Backend("qemu", choice.accel, choice.reason, config)


def _firecracker_usable(binary: str = "firecracker") -> tuple[bool, str]:
    try:
        from vmctl.drivers.firecracker import firecracker_usable
    except ImportError:
        return False, "firecracker driver not installed"
    return firecracker_usable(binary)
