"""Root file systems: debootstrap once, apt per template, ``mkfs.ext4 -d``.

The base tree (minbase + BASE_PACKAGES) is cached by a hash of its inputs and
copied for each template, which then gets the host's apt sources (including
-updates and -security), its own packages, the guest agent and our init.
The image is made with ``mkfs.ext4 -d`` from the tree: no loop mounts, so a
build never leaves a mounted image behind. The one mount we do need is /proc
inside the chroot (some maintainer scripts read it); it is always unmounted,
and trees are only ever deleted through :func:`remove_tree`, which refuses to
delete through a mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from images.hashing import Files
from images.mirror import AptSource, render_deb822
from images.proc import BuildContext, BuildError
from images.templates import BASE_PACKAGES

SUITE = "bookworm"
AGENT_DIR = "opt/agentbox"
INIT_PATH = "sbin/agentbox-init"
ZYGOTE_PRELOAD = f"{AGENT_DIR}/zygote-preload"  # guest.agent.PRELOAD_FILE
MIN_DISK_MIB = 1024
GUEST_USER = "user"  # unprivileged account for sandbox code that should not be root

NODOC = """\
# Sandboxes need no manuals or translations; copyright files stay.
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
"""
HOSTS = "127.0.0.1\tlocalhost\n127.0.1.1\tagentbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def base_tree(ctx: BuildContext, cache: Path, key: str, mirror: AptSource,
              sources: list[AptSource]) -> Path:
    """debootstrap the shared base (cached under ``cache/base/<key>``).

    The base already has the host's sources, fresh package lists and all
    updates applied, so a template's own apt run only fetches what changed
    since (usually nothing) plus its packages.
    """
    dest = cache / "base" / key
    if (dest / "etc" / "debian_version").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=dest.parent))
    try:
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
               f"--components={','.join(mirror.components)}",
               f"--cache-dir={_debs_cache(cache)}"]
        if mirror.signed_by.startswith("/") and Path(mirror.signed_by).is_file():
            cmd.append(f"--keyring={mirror.signed_by}")
        ctx.run([*cmd, SUITE, work / "tree", mirror.uri])
        install_packages(ctx, work / "tree", sources, ())
        (work / "tree").rename(dest)
    finally:
        remove_tree(work)
    return dest


def _debs_cache(cache: Path) -> Path:
    path = cache / "debootstrap-debs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def copy_tree(ctx: BuildContext, src: Path, dest: Path) -> None:
    ctx.run(["cp", "-a", "--reflink=auto", src, dest])


def install_packages(ctx: BuildContext, tree: Path, sources: list[AptSource],
                     packages: tuple[str, ...]) -> None:
    """Point apt at the host's mirror, apply updates, add ``packages``."""
    _configure_apt(tree, sources)
    apt = ["apt-get", "-y", "-q", "-o", "Dpkg::Options::=--force-confold",
           "-o", "APT::Install-Recommends=false"]
    with _chroot_mounts(ctx, tree):
        chroot(ctx, tree, "apt-get", "-q", "update")
        chroot(ctx, tree, *apt, "dist-upgrade")
        if packages:
            chroot(ctx, tree, *apt, "install", *packages)
        chroot(ctx, tree, "apt-get", "clean")
        _add_user(ctx, tree)
    (tree / "usr/sbin/policy-rc.d").unlink(missing_ok=True)


def _configure_apt(tree: Path, sources: list[AptSource]) -> None:
    (tree / "etc/apt/sources.list").unlink(missing_ok=True)
    (tree / "etc/apt/sources.list.d/debian.sources").write_text(render_deb822(sources))
    for src in sources:  # a host keyring outside Debian's default location
        key = Path(src.signed_by)
        if key.is_absolute() and key.is_file() and not (tree / key.relative_to("/")).exists():
            (tree / key.relative_to("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(key, tree / key.relative_to("/"))
    (tree / "etc/dpkg/dpkg.cfg.d/01-agentbox-nodoc").write_text(NODOC)
    # No daemon may start inside the build chroot.
    policy = tree / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    shutil.copy2("/etc/resolv.conf", tree / "etc/resolv.conf", follow_symlinks=True)


def _add_user(ctx: BuildContext, tree: Path) -> None:
    if f"\n{GUEST_USER}:" not in "\n" + (tree / "etc/passwd").read_text():
        chroot(ctx, tree, "useradd", "--create-home", "--uid", "1000",
               "--shell", "/bin/bash", GUEST_USER)


class _chroot_mounts:
    """/proc inside the chroot for the duration of a block; always unmounted."""

    def __init__(self, ctx: BuildContext, tree: Path) -> None:
        self.ctx, self.proc = ctx, tree / "proc"

    def __enter__(self) -> None:
        self.ctx.run(["mount", "-t", "proc", "proc", self.proc])

    def __exit__(self, *exc: object) -> None:
        self.ctx.run(["umount", "--lazy", self.proc])


def chroot(ctx: BuildContext, tree: Path, *argv: str) -> str:
    return ctx.run(["chroot", tree, *argv])


def install_guest(ctx: BuildContext, tree: Path, files: Files) -> list[str]:
    """Write the guest package to /opt/agentbox/guest and init.py to /sbin."""
    dest = tree / AGENT_DIR / "guest"
    contents = dict(files)
    if "init.py" not in contents:
        raise BuildError("guest/init.py is missing: the guest could not boot")
    for rel, data in contents.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    init = tree / INIT_PATH
    init.write_bytes(contents["init.py"])
    init.chmod(0o755)
    # Byte-compile now: under TCG the first import would otherwise cost seconds.
    chroot(ctx, tree, "python3", "-m", "compileall", "-q", f"/{AGENT_DIR}")
    return sorted(contents)


def install_zygote_preload(tree: Path, modules: tuple[str, ...]) -> None:
    """What the guest agent's execute zygote imports (read by guest/agent.py at start)."""
    (tree / ZYGOTE_PRELOAD).parent.mkdir(parents=True, exist_ok=True)
    (tree / ZYGOTE_PRELOAD).write_text("".join(f"{m}\n" for m in modules))


def finish_tree(tree: Path) -> None:
    """System files the guest expects, and no build leftovers."""
    (tree / "etc/hostname").write_text("agentbox\n")
    (tree / "etc/hosts").write_text(HOSTS)
    (tree / "etc/resolv.conf").unlink(missing_ok=True)
    (tree / "etc/resolv.conf").write_text("# agentbox-init writes this from agentbox.dns=\n")
    (tree / "etc/fstab").write_text("# root is mounted by the initramfs; see agentbox-init\n")
    _prune_docs(tree)
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/debconf/*-old",
                    "var/log/apt/*", "var/log/*.log", "tmp/*", "var/tmp/*", "root/.cache"):
        for path in tree.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                remove_tree(path)
            else:
                path.unlink(missing_ok=True)


def _prune_docs(tree: Path) -> None:
    """What debootstrap installed before the nodoc rule existed (copyrights stay)."""
    for sub in ("usr/share/man", "usr/share/info", "usr/share/doc", "usr/share/locale"):
        for path in (tree / sub).rglob("*"):
            keep = path.name in ("copyright", "locale.alias")
            if not keep and (path.is_file() or path.is_symlink()):
                path.unlink()


def make_ext4(ctx: BuildContext, tree: Path, image: Path, headroom_mib: int) -> int:
    """Create a sparse ext4 image holding ``tree``; return its size in MiB."""
    used = int(ctx.run(["du", "-sx", "--block-size=1M", tree]).split()[0])
    size_mib = max(MIN_DISK_MIB, _round_up(used + headroom_mib, 64))
    with open(image, "wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    ctx.run(["mkfs.ext4", "-q", "-F", "-L", "agentbox-root", "-m", "0",
             "-d", tree, image, f"{size_mib}M"])
    ctx.run(["e2fsck", "-fn", image])  # cheap proof the image is consistent
    return size_mib


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def remove_tree(path: Path) -> None:
    """rm -rf that refuses to descend through a mount point (e.g. a chroot's /proc)."""
    if not path.exists():
        return
    # An interrupted debootstrap or chroot step can leave /proc or /sys
    # mounted inside the tree; detach those first, deepest first.
    for mount in sorted(_mounts_under(path), reverse=True):
        subprocess.run(["umount", "--lazy", mount], check=False, capture_output=True)
    busy = _mounts_under(path)
    if busy:
        raise BuildError(f"refusing to delete {path}: still mounted: {', '.join(busy)}")
    shutil.rmtree(path)


def _mounts_under(path: Path) -> list[str]:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    return [m for m in mounts if m == real or m.startswith(real + "/")]
