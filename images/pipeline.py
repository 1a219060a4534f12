"""One template build, stage by stage, into a temp dir renamed into place.

Stages: kernel (download + unpack, cached per version), initramfs, rootfs
(debootstrap base cached by key; packages; guest; mkfs), checksums, manifest.
A rootfs already built with the same rootfs key (e.g. only the cmdline
changed) is hard-linked instead of rebuilt. The caller holds the build lock.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from images import debs, rootfs
from images.initramfs import build_initramfs
from images.inputs import BuildInputs
from images.kernel import fetch_kernel
from images.manifest import fsync_dir, read_manifest, sha256_file, write_manifest
from images.proc import BuildContext, BuildError, Progress

KERNEL, INITRD, ROOTFS, PACKAGES, LOG = (
    "vmlinuz", "initrd.img", "rootfs.ext4", "packages.txt", "build.log")


def run_build(inputs: BuildInputs, images_dir: Path, final: Path, progress: Progress,
              *, verbose: bool = False) -> None:
    if os.geteuid() != 0:
        raise BuildError("building images needs root (debootstrap and chroot); "
                         "built templates can be loaded by anyone")
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    cache = images_dir / ".cache"
    # Left by an interrupted build; safe to remove because we hold the build lock.
    for stale in [*parent.glob(".tmp-*"), *cache.glob("base/.*"), *cache.glob("unpacked/.*")]:
        rootfs.remove_tree(stale)
    tmp = parent / f".tmp-{inputs.template_hash}-{os.getpid()}"
    tmp.mkdir()
    started = time.monotonic()
    try:
        with open(tmp / LOG, "w") as log:
            ctx = BuildContext(progress, log, label=inputs.spec.name, verbose=verbose)
            facts = _build_into(ctx, inputs, cache, images_dir, tmp)
            facts["build_seconds"] = round(time.monotonic() - started, 1)
            facts["timings"] = ctx.timings
            write_manifest(tmp, facts)
        os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException:
        try:
            rootfs.remove_tree(tmp)
        except Exception as exc:  # keep the original error; report the leftover
            progress(f"[{inputs.spec.name}] could not remove {tmp}: {exc}")
        raise
    progress(f"[{inputs.spec.name}] built {final} in {time.monotonic() - started:.1f}s")


def _build_into(ctx: BuildContext, inputs: BuildInputs, cache: Path, images_dir: Path,
                out: Path) -> dict[str, Any]:
    with ctx.stage("kernel", f"{inputs.kernel.name} {inputs.kernel.version}"):
        kernel = fetch_kernel(ctx, cache, inputs.kernel)
        _link(kernel.vmlinuz, out / KERNEL)
    with ctx.stage("initramfs"):
        modules = build_initramfs(kernel, _busybox(ctx, inputs, cache), out / INITRD)
    rootfs_facts = _rootfs(ctx, inputs, cache, images_dir, out)
    with ctx.stage("checksums"):
        sha = {f: sha256_file(out / f) for f in (KERNEL, INITRD, ROOTFS)}
    return {
        "name": inputs.spec.name, "hash": inputs.template_hash,
        "files": {"kernel": KERNEL, "initrd": INITRD, "rootfs": ROOTFS},
        "sha256": sha, "cmdline": inputs.cmdline, "mem_mib": inputs.spec.mem_mib,
        "warmup": inputs.spec.warmup, "built_at": time.time(),
        "kernel_package": f"{inputs.kernel.name}={inputs.kernel.version}",
        "kernel_release": kernel.release, "modules": modules,
        "busybox_package": f"{inputs.busybox.name}={inputs.busybox.version}",
        "initrd_key": inputs.initrd_key, "mirror": inputs.mirror.uri,
        "guest_digest": inputs.guest_digest,
        "template_packages": list(inputs.spec.packages), **rootfs_facts,
    }


def _busybox(ctx: BuildContext, inputs: BuildInputs, cache: Path) -> Path:
    root = debs.unpacked(ctx, inputs.busybox, cache)
    for candidate in (root / "bin/busybox", root / "usr/bin/busybox"):
        if candidate.is_file():
            return candidate
    raise BuildError(f"{inputs.busybox.key} contains no busybox binary")


def _rootfs(ctx: BuildContext, inputs: BuildInputs, cache: Path, images_dir: Path,
            out: Path) -> dict[str, Any]:
    previous = _find_rootfs(images_dir, inputs.rootfs_key)
    if previous is not None:
        with ctx.stage("rootfs reuse"):
            directory, data = previous
            _link(directory / ROOTFS, out / ROOTFS)
            _link(directory / PACKAGES, out / PACKAGES)
        return {k: data[k] for k in ("rootfs_key", "disk_mib", "guest_files")}
    with ctx.stage("base (debootstrap)"):
        base = rootfs.base_tree(ctx, cache, inputs.base_key, inputs.mirror,
                                list(inputs.sources))
    tree = out / "tree"
    with ctx.stage("copy base"):
        rootfs.copy_tree(ctx, base, tree)
    with ctx.stage("packages"):
        rootfs.install_packages(ctx, tree, list(inputs.sources), inputs.spec.packages)
    with ctx.stage("guest"):
        guest_files = rootfs.install_guest(ctx, tree, inputs.guest_files)
        rootfs.install_zygote_preload(tree, inputs.spec.preload)
        rootfs.finish_tree(tree)
        (out / PACKAGES).write_text(ctx.run(
            ["dpkg-query", f"--admindir={tree}/var/lib/dpkg", "-W",
             "-f", "${Package}\t${Version}\n"]))
    with ctx.stage("mkfs"):
        disk_mib = rootfs.make_ext4(ctx, tree, out / ROOTFS, inputs.spec.headroom_mib)
        (out / ROOTFS).chmod(0o444)  # a base image: sandboxes write to their own layer
        rootfs.remove_tree(tree)
    return {"rootfs_key": inputs.rootfs_key, "disk_mib": disk_mib, "guest_files": guest_files}


def _find_rootfs(images_dir: Path, key: str) -> tuple[Path, dict[str, Any]] | None:
    for manifest in images_dir.glob("*/*/manifest.json"):
        data = read_manifest(manifest.parent)
        if data and data.get("rootfs_key") == key and (manifest.parent / ROOTFS).is_file():
            return manifest.parent, data
    return None


def _link(src: Path, dest: Path) -> None:
    """Hard link (the files are immutable); a sparse copy across file systems."""
    try:
        os.link(src, dest)
    except OSError:
        subprocess.run(["cp", "--sparse=always", "--reflink=auto", src, dest], check=True)
