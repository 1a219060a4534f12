"""Everything a template build depends on, resolved up front, and its hashes.

Resolution asks the host's apt which kernel and busybox versions it would
fetch and reads the guest sources; nothing is downloaded. The keys are layered
so a change rebuilds only what it touches: the debootstrap base, the rootfs,
the initramfs and the template (which adds cmdline, RAM and warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from guest.protocol import TAP_ADDR
from images import debs
from images.hashing import Files, digest, files_digest, snapshot_files, source_digest
from images.mirror import AptSource, debian_mirror, host_sources, render_deb822, suite_sources
from images.templates import BASE_PACKAGES, TemplateSpec

HERE = Path(__file__).resolve().parent
GUEST_DIR = HERE.parent / "guest"
# Bump to force a fresh base (debootstrap + updates) after changing how
# rootfs.base_tree works; the base does not hash rootfs.py itself, or every
# edit there would cost a three-minute debootstrap.
BASE_FORMAT = 2
# The kernel command line. root= and rw are read by our initramfs (init.sh);
# reboot=k + panic=1 make a crashed guest exit the VMM instead of hanging;
# quiet keeps TCG boots fast (the serial console is slow). agentbox.dns: the guest's
# resolver is its gateway, where the sandbox's namespace hands DNS to the daemon's
# filtering forwarder (vmctl/dnsfwd.py). init_on_free=1: the kernel zeroes every
# page it frees, so free memory is zero as in the golden and drops out of a compact
# snapshot's diff (a third of its size after a few commands: bench/zeroing.py), and a
# process's data does not outlive it in free pages.
CMDLINE = (f"console=ttyS0 reboot=k panic=1 root=/dev/vda rw quiet init_on_free=1 "
           f"agentbox.dns={TAP_ADDR}")


@dataclass(frozen=True)
class BuildInputs:
    spec: TemplateSpec
    sources: tuple[AptSource, ...]   # host entries for bookworm, -updates, -security
    mirror: AptSource                # the one debootstrap uses
    kernel: debs.DebPackage
    busybox: debs.DebPackage
    guest_files: Files               # guest/**/*.py as read when the build was resolved
    cmdline: str = CMDLINE
    # Digests of the build code, taken at resolve time like everything else, so
    # editing images/ during a build cannot change a build's keys half-way.
    rootfs_code: str = ""
    initrd_code: str = ""

    @property
    def guest_digest(self) -> str:
        return files_digest(self.guest_files)

    @property
    def base_key(self) -> str:
        return digest("base", BASE_FORMAT, self.mirror.uri, self.mirror.components,
                      BASE_PACKAGES, render_deb822(list(self.sources)))

    @property
    def rootfs_key(self) -> str:
        return digest("rootfs", self.base_key, render_deb822(list(self.sources)),
                      self.spec.packages, self.spec.headroom_mib, self.guest_digest,
                      self.rootfs_code, self.spec.preload)

    @property
    def initrd_key(self) -> str:
        return digest("initrd", self.kernel.key, self.busybox.key, self.initrd_code)

    @property
    def template_hash(self) -> str:
        return digest("template", self.spec.name, self.rootfs_key, self.initrd_key,
                      self.kernel.key, self.cmdline, self.spec.mem_mib, self.spec.warmup)


def resolve_inputs(spec: TemplateSpec, cache: Path | None = None,
                   guest_dir: Path = GUEST_DIR) -> BuildInputs:
    """Resolve what a build of ``spec`` would use now (``cache`` memoises apt answers)."""
    sources = suite_sources(host_sources())
    kernel, busybox = debs.boot_packages(cache / "apt-resolve.json" if cache else None)
    return BuildInputs(
        spec=spec,
        sources=tuple(sources),
        mirror=debian_mirror(sources),
        kernel=kernel,
        busybox=busybox,
        guest_files=snapshot_files(guest_dir),
        rootfs_code=source_digest(HERE / "rootfs.py", HERE / "mirror.py"),
        initrd_code=source_digest(HERE / "init.sh", HERE / "initramfs.py",
                                  HERE / "kernel.py", HERE / "kmod.py"),
    )
