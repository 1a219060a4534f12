"""What of a sandbox's own snapshot can be shipped to another host (gateway.cluster.shipper).

The snapshot directory (``{root}/snapshot``) holds the device state, the disk overlay
(hard-linked) and ``manifest.json`` (vmctl.store); the memory is QEMU's RAM file in the
root itself, or a diff from the golden's inside the snapshot. Files the manifest names
under the root are shipped, named relative to it. A path outside the root (a compact
memory's golden, the overlay's base) is the template's and is returned apart, so the
caller records its identity instead of its bytes. The manifest's paths are absolute: a
restore must put the files at the same root path (same ``sandboxes_dir``, same id).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord
from vmctl import store
from vmctl.errors import SnapshotError


@dataclass(frozen=True)
class Shippable:
    names: list[str]  # relative to the sandbox root ("snapshot/state", "memory"), manifest last
    outside: list[str]  # absolute paths the snapshot needs from the template


def shippable(directory: Path) -> Shippable:
    """The files of the complete snapshot in ``directory`` (a sandbox root's ``snapshot``),
    named relative to the sandbox root: QEMU's memory file lives in the root itself
    (vmctl.disks.QemuLayout), beside the snapshot directory. SnapshotError if there is no
    complete snapshot (no manifest: a suspend that did not finish) or it was already
    resumed from."""
    manifest = store.Manifest.from_json((directory / store.MANIFEST).read_bytes())
    if store.is_consumed(directory):
        raise SnapshotError("the snapshot was already resumed from")
    root = directory.parent
    names, outside = [], []
    for entry in manifest.files.values():
        # A compact memory (vmctl.store.compact_memory) is its diff from the golden's: the
        # diff is shipped, the memory file it replaced no longer exists.
        for sub, key in ((entry.get("diff"), "path"), (entry.get("diff"), "golden"),
                         (None if "diff" in entry else entry, "path"), (entry, "golden")):
            if sub is None or key not in sub:
                continue
            path = Path(sub[key])
            path = path if path.is_absolute() else directory / path
            if not path.is_relative_to(root):
                outside.append(str(path))
                continue
            rel = path.relative_to(root)
            if len(rel.parts) > 2 or (len(rel.parts) == 2 and rel.parts[0] != directory.name):
                raise SnapshotError(f"snapshot file {rel} is outside its usual places")
            names.append(str(rel))
    return Shippable(sorted(set(names)) + [f"{directory.name}/{store.MANIFEST}"],
                     sorted(set(outside)))


@dataclass(frozen=True)
class Suspended:
    """A suspended sandbox's snapshot as the shipper needs it."""

    directory: Path  # the sandbox root: ``names`` are relative to it
    names: list[str]
    base: str  # identity of what the snapshot needs from the template (its golden)
    meta: dict[str, Any]


def base_identity(golden_dir: Path) -> str:
    """The golden's manifest hashes every file of the golden (disk base, memory), so its
    own SHA256 identifies the base a sandbox's overlay and memory diff stand on. Goldens
    built on two hosts differ (a booted VM's memory does): the same base on two hosts
    means the same build, copied (docs/cluster.md)."""
    return hashlib.sha256((golden_dir / store.MANIFEST).read_bytes()).hexdigest()


_bases: dict[tuple[str, int, int], str] = {}  # (manifest path, mtime, size) -> identity


def local_bases(images_dir: Path) -> dict[str, Path]:
    """Every golden under ``images_dir`` ({template}/{build}/golden-*/ with a manifest)
    by its base identity (blocking; the manifests' hashes are cached by mtime and size)."""
    out: dict[str, Path] = {}
    for manifest in sorted(images_dir.glob(f"*/*/golden-*/{store.MANIFEST}")):
        try:
            st = manifest.stat()
            key = (str(manifest), st.st_mtime_ns, st.st_size)
            if key not in _bases:
                _bases[key] = base_identity(manifest.parent)
        except OSError:
            continue
        out.setdefault(_bases[key], manifest.parent)
    return out


def describe_suspended(rec: SandboxRecord) -> Suspended | None:
    """What to ship for ``rec`` (blocking: run it in a thread); None unless it is
    SUSPENDED with a complete, unconsumed snapshot."""
    if rec.state is not State.SUSPENDED:
        return None
    directory = Path(rec.root) / "snapshot"
    try:
        files = shippable(directory)
        base = base_identity(Path(rec.golden))
    except (OSError, SnapshotError):
        return None
    meta = {"tenant": rec.tenant, "template": rec.template, "vcpus": rec.vcpus,
            "memory_mib": rec.memory_mib, "disk_mib": rec.disk_mib,
            "idle_timeout": rec.idle_timeout, "metadata": rec.metadata, "egress": rec.egress,
            "suspended_at": rec.asleep_since or rec.updated_at}
    return Suspended(directory.parent, files.names, base, meta)
