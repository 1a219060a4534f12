"""Built templates: look them up, or build them when missing.

A template lives in ``images_dir/<name>/<hash>/`` where the hash covers every
build input (package versions resolved through the host's apt, the guest
code, the build code, settings). So ``build_template`` on an unchanged
template only resolves the inputs and finds the directory: well under a
second. Old hash directories are never deleted automatically because golden
snapshots and sandbox disks may still use them as backing files.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from images.hostclock import clock_args
from images.hashing import files_digest, snapshot_files
from images.inputs import GUEST_DIR, resolve_inputs
from images.manifest import read_manifest
from images.templates import SPECS, TEMPLATES

__all__ = ["TEMPLATES", "TemplateImage", "build_template", "load_template", "DEFAULT_IMAGES_DIR"]

DEFAULT_IMAGES_DIR = Path("/var/lib/agentbox/images")


@dataclass(frozen=True)
class TemplateImage:
    """A built template: boot artifacts plus the defaults to boot them with."""

    name: str          # "python" | "minimal" | "node" | "python-datascience"
    hash: str          # content hash of all build inputs (hex)
    dir: Path          # images_dir / name / hash
    kernel: Path       # bzImage (Debian cloud kernel)
    initrd: Path       # busybox initramfs (gzip'd cpio)
    rootfs: Path       # raw ext4 image; read-only, use copy-on-write layers on top
    cmdline: str       # full kernel command line: the image's + this host's clock args
    mem_mib: int       # default guest RAM
    warmup: str        # Python run in the guest before the golden snapshot ("" = none)

    @classmethod
    def from_manifest(cls, directory: Path, data: dict[str, object]) -> TemplateImage:
        files = data["files"]
        assert isinstance(files, dict)
        return cls(
            name=str(data["name"]), hash=str(data["hash"]), dir=directory,
            kernel=directory / files["kernel"], initrd=directory / files["initrd"],
            rootfs=directory / files["rootfs"],
            cmdline=" ".join(filter(None, (str(data["cmdline"]), clock_args()))),
            mem_mib=int(str(data["mem_mib"])), warmup=str(data["warmup"]),
        )


def _check_name(name: str) -> None:
    if name not in SPECS:
        raise ValueError(f"unknown template {name!r}; known: {', '.join(TEMPLATES)}")


def _load_dir(directory: Path) -> TemplateImage | None:
    data = read_manifest(directory)
    if data is None:
        return None
    try:
        image = TemplateImage.from_manifest(directory, data)
    except (KeyError, TypeError, ValueError, AssertionError):
        return None
    if not all(p.is_file() for p in (image.kernel, image.initrd, image.rootfs)):
        return None
    return image


def load_template(name: str, images_dir: Path) -> TemplateImage | None:
    """The built ``name`` in ``images_dir`` that best fits this checkout, or None: the most
    recent build of this checkout's guest/ code, else the most recent build (several
    checkouts can share one images dir). Never builds."""
    _check_name(name)
    ours = files_digest(snapshot_files(GUEST_DIR))
    best: tuple[tuple[bool, float], TemplateImage] | None = None
    for directory in (Path(images_dir) / name).glob("*"):
        if directory.name.startswith("."):
            continue  # a build in progress or an abandoned one
        image = _load_dir(directory)
        if image is not None:
            manifest = read_manifest(directory) or {}
            key = (manifest.get("guest_digest") == ours,
                   float(str(manifest.get("built_at", 0))))
            if best is None or key > best[0]:
                best = (key, image)
    return best[1] if best else None


def build_template(name: str, images_dir: Path, progress: Callable[[str], None] = print,
                   *, verbose: bool = False) -> TemplateImage:
    """Return template ``name``, building it first unless an identical build exists."""
    _check_name(name)
    images_dir = Path(images_dir)
    inputs = resolve_inputs(SPECS[name], images_dir / ".cache")
    final = images_dir / name / inputs.template_hash
    image = _load_dir(final)
    if image is not None:
        progress(f"[{name}] up to date: {final}")
        return image
    images_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(images_dir, progress):
        image = _load_dir(final)  # someone else may have built it meanwhile
        if image is not None:
            return image
        from images.pipeline import run_build  # heavy imports only when building
        run_build(inputs, images_dir, final, progress, verbose=verbose)
    image = _load_dir(final)
    if image is None:
        raise RuntimeError(f"build of {name} finished but {final} is not a valid template")
    return image


@contextmanager
def _build_lock(images_dir: Path, progress: Callable[[str], None]) -> Iterator[None]:
    """One build at a time per images_dir: builds share caches and both CPU cores."""
    fd = os.open(images_dir / ".build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("waiting for another build in this images dir to finish ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
