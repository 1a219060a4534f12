"""How a VMM is confined: its own uid, a chroot, seccomp, and its own cgroup.

Theory of operation
-------------------
A VMM is the one host process that parses guest-controlled device traffic, so it
is the host's first line of defence if the VM boundary breaks. Each QEMU:

* starts as root only long enough to open what it needs (kernel, disk, memory
  file, TAP, sockets), then ``-chroot``s into its VM directory and drops to the
  sandbox's own uid/gid (``-runas``): one uid per network slot, so two sandboxes
  never share a uid and neither can read the other's files (``chown_private``);
* runs under QEMU's seccomp filter (``-sandbox on`` with obsolete syscalls,
  spawning processes and resource control denied). ``elevateprivileges=deny``
  is not set: QEMU 7.2 installs its filter *before* ``-runas`` drops privileges,
  so that option kills it at the drop. After the drop the process holds no
  capabilities and cannot exec, so set*id calls cannot raise its privileges;
* joins its own cgroup (``vmctl.cgroup``) before it executes a single
  instruction of QEMU, with memory, CPU and pids limits.

QEMU opens its disks before the chroot, but reopens them by name later (the
first ``cont`` after an incoming migration re-activates the block layer), so the
disk and its whole backing chain must be found at the same absolute paths inside
the chroot: ``mirror_into_chroot`` hard-links them there (the data dir and the
images dir must therefore share one filesystem; start-up says so if not).

The uid is derived from the slot's address (``uid_base`` + the slot's /30 number
in the IPv4 space, modulo 2^20), which recovery finds again in the registry, so
nothing about it needs to be stored, and two daemons with different pools on one
host never hand out the same uid (two sharing a pool never hold the same slot).
"""

from __future__ import annotations

import ipaddress
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vmctl.errors import VMStartError

# QEMU's seccomp policy (see qemu-options.hx, -sandbox).
SECCOMP = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"


@dataclass(frozen=True)
class ConfineConfig:
    """``[vm]`` keys ``confine``, ``uid_base``, ``memory_overhead_mib``, ``cpu_percent``,
    ``pids_max``."""

    enabled: bool = True
    uid_base: int = 200000  # VMMs run as uid/gid uid_base + slot_uid_offset(slot)
    memory_overhead_mib: int = 256  # cgroup memory limit = guest RAM + this (QEMU, TCG cache)
    cpu_percent: int = 100  # per vCPU: 100 = at most one host core per vCPU
    pids_max: int = 64  # threads of one VMM (QEMU uses ~10 with one vCPU)

    def __post_init__(self) -> None:
        if not 1000 <= self.uid_base <= 2**31 - UID_SPAN:
            raise ValueError("uid_base must be in 1000..2^31-2^20 (a range no user owns)")
        if self.memory_overhead_mib < 32:
            raise ValueError("memory_overhead_mib must be >= 32")
        if not 1 <= self.cpu_percent <= 100_000:
            raise ValueError("cpu_percent must be 1..100000")
        if self.pids_max < 16:
            raise ValueError("pids_max must be >= 16 (QEMU needs its threads)")


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpu_quota_us: int  # per 100 ms period
    pids_max: int

    PERIOD_US = 100_000


@dataclass(frozen=True)
class Confinement:
    """What one VMM runs as. ``chroot`` is the VM's own directory."""

    uid: int
    gid: int
    chroot: Path
    cgroup: str  # cgroup name relative to the daemon's parent cgroup
    limits: Limits


UID_SPAN = 1 << 20


def slot_uid_offset(slot_host_addr: str) -> int:
    """The slot's /30 number in the IPv4 space, folded into the uid range."""
    return (int(ipaddress.IPv4Address(slot_host_addr)) >> 2) % UID_SPAN


def confinement_for(config: ConfineConfig, uid_offset: int, vm_id: str, workdir: Path,
                    mem_mib: int, vcpus: int) -> Confinement | None:
    if not config.enabled:
        return None
    uid = config.uid_base + uid_offset
    limits = Limits(memory_bytes=(mem_mib + config.memory_overhead_mib) << 20,
                    cpu_quota_us=Limits.PERIOD_US * vcpus * config.cpu_percent // 100,
                    pids_max=config.pids_max)
    return Confinement(uid=uid, gid=uid, chroot=workdir, cgroup=vm_id, limits=limits)


def chown_private(path: Path, confinement: Confinement | None, mode: int = 0o600) -> None:
    """Make ``path`` readable and writable by its VMM's uid only."""
    if confinement is None:
        os.chmod(path, mode)
        return
    os.chown(path, confinement.uid, confinement.gid)
    os.chmod(path, mode)


def qemu_args(confinement: Confinement | None) -> list[str]:
    if confinement is None:
        return []
    c = confinement
    return ["-sandbox", SECCOMP, "-chroot", str(c.chroot), "-runas", f"{c.uid}:{c.gid}"]


_QCOW2_MAGIC = b"QFI\xfb"


def backing_chain(disk: Path) -> list[Path]:
    """``disk`` and every file under it (qcow2 backing files, read from the headers)."""
    chain = [disk]
    while len(chain) < 16:
        with open(chain[-1], "rb") as f:
            header = f.read(20)
            if len(header) < 20 or header[:4] != _QCOW2_MAGIC:
                break
            offset, size = struct.unpack(">QI", header[8:20])
            if not offset or not 0 < size <= 1023:
                break
            f.seek(offset)
            name = f.read(size).decode()
        backing = Path(name) if name.startswith("/") else chain[-1].parent / name
        chain.append(backing)
    return chain


def mirror_into_chroot(chroot: Path, files: Iterable[Path]) -> None:
    """Hard-link each file to the same absolute path under ``chroot`` (idempotent)."""
    for path in files:
        target = chroot / path.relative_to("/")
        if target.exists() and os.path.samefile(target, path):
            continue
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".link")
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError as exc:
            raise VMStartError(
                f"cannot link {path} into the VMM's chroot ({exc.strerror}): a confined VMM "
                "needs the data dir and the images dir on one filesystem") from exc
        os.replace(tmp, target)
