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
        for key in ("path", "golden"):
            if key not in entry:
                continue
            path = Path(entry[key])
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
    own SHA256 identifies the base a sandbox's overlay and memory diff stand on."""
    return hashlib.sha256((golden_dir / store.MANIFEST).read_bytes()).hexdigest()


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
            "idle_timeout": rec.idle_timeout, "metadata": rec.metadata, "egress": rec.egress}
    return Suspended(directory.parent, files.names, base, meta)
