"""Fetch single Debian packages through the host's apt, cached by version.

The kernel and busybox come from packages that are downloaded and unpacked,
never installed on the host. apt resolves them against the host's configured
sources (so the mirror is the operator's), and the unpacked trees are kept
under ``cache/unpacked/<package>_<version>`` to be shared by every template.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from images.proc import BUILD_ENV, BuildContext, BuildError

KERNEL_META = "linux-image-cloud-amd64"
BUSYBOX = "busybox-static"
APT_LISTS = Path("/var/lib/apt/lists")


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str

    @property
    def key(self) -> str:
        """File-system-safe ``name_version`` (epochs' ':' become '%', as apt does)."""
        return f"{self.name}_{self.version.replace(':', '%')}"


def _apt_cache(*args: str) -> str:
    proc = subprocess.run(["apt-cache", *args], capture_output=True, text=True,
                          env=BUILD_ENV, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def candidate(name: str) -> DebPackage | None:
    """The version apt would install for ``name`` (None if unknown to apt)."""
    match = re.search(r"^\s*Candidate:\s*(\S+)", _apt_cache("policy", name), re.M)
    if not match or match.group(1) == "(none)":
        return None
    return DebPackage(name, match.group(1))


def kernel_package() -> DebPackage:
    """The real ``linux-image-<abi>-cloud-amd64`` the metapackage points at."""
    meta = resolve(KERNEL_META)
    shown = _apt_cache("show", f"{meta.name}={meta.version}")
    match = re.search(r"^Depends:.*?\b(linux-image-[0-9][^\s,(]*-cloud-amd64)", shown, re.M)
    if not match:
        raise BuildError(f"cannot find the kernel image {meta.name} {meta.version} depends on")
    return resolve(match.group(1))


def resolve(name: str) -> DebPackage:
    """Like :func:`candidate`, refreshing the host's package lists once if needed."""
    found = candidate(name)
    if found is None:
        subprocess.run(["apt-get", "update", "-qq"], env=BUILD_ENV, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = candidate(name)
    if found is None:
        raise BuildError(f"package {name!r} is not available from the host's apt sources")
    return found


def unpacked(ctx: BuildContext, pkg: DebPackage, cache: Path) -> Path:
    """Download and unpack ``pkg`` once; return the unpacked tree's root."""
    dest = cache / "unpacked" / pkg.key
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{pkg.key}.", dir=dest.parent))
    try:
        # _apt must be able to write the download directory, or apt warns and
        # falls back to downloading as root.
        os.chmod(work, 0o777)
        ctx.run(["apt-get", "download", "-q", f"{pkg.name}={pkg.version}"], cwd=work)
        debs = list(work.glob("*.deb"))
        if len(debs) != 1:
            raise BuildError(f"apt-get download {pkg.name} produced {len(debs)} files")
        ctx.run(["dpkg-deb", "-x", debs[0], work / "root"])
        debs[0].unlink()
        os.chmod(work, 0o755)
        (work / "root").rename(dest)  # atomic: a half-unpacked tree is never seen
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def lists_signature(lists: Path = APT_LISTS) -> str:
    """Changes whenever apt's view of the archive can change (apt-get update, sources)."""
    entries = []
    for path in sorted([*lists.glob("*"), *Path("/etc/apt").rglob("*.sources"),
                        *Path("/etc/apt").rglob("*.list")]):
        if path.is_file():
            st = path.stat()
            entries.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(entries)


def boot_packages(memo: Path | None = None) -> tuple[DebPackage, DebPackage]:
    """(kernel, busybox) packages apt would fetch now.

    apt-cache costs ~0.5 s per call when apt's binary cache is disabled (as in
    container images), so answers are memoised in ``memo`` for as long as the
    package lists and sources are unchanged: an up-to-date check stays fast.
    """
    signature = lists_signature()
    if memo is not None and memo.is_file():
        try:
            data = json.loads(memo.read_text())
            if data["signature"] == signature:
                return DebPackage(**data["kernel"]), DebPackage(**data["busybox"])
        except (ValueError, KeyError, TypeError):
            pass
    kernel, busybox = kernel_package(), resolve(BUSYBOX)
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(memo.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"signature": lists_signature(),
                                   "kernel": kernel.__dict__, "busybox": busybox.__dict__}))
        os.replace(tmp, memo)
    return kernel, busybox
