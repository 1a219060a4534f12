"""What of a sandbox's own snapshot can be shipped to another host (gateway.cluster.shipper).

The snapshot directory holds the device state, memory (whole or as a diff from the
golden's), the disk overlay and ``manifest.json`` (vmctl.store). Files inside the
directory are shipped; a path the manifest names outside it (a compact memory's golden,
the overlay's base) is the template's, the same on every host built from the same
inputs, and is returned apart so the caller can record its identity instead of its bytes.
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
    names: list[str]  # files relative to the snapshot directory, manifest.json last
    outside: list[str]  # absolute paths the snapshot needs from the template


def shippable(directory: Path) -> Shippable:
    """The files of the complete snapshot in ``directory``; SnapshotError if there is none
    (no manifest: a suspend that did not finish) or it was already resumed from."""
    manifest = store.Manifest.from_json((directory / store.MANIFEST).read_bytes())
    if store.is_consumed(directory):
        raise SnapshotError("the snapshot was already resumed from")
    names, outside = [], []
    for entry in manifest.files.values():
        for key in ("path", "golden"):
            if key not in entry:
                continue
            path = Path(entry[key])
            if path.is_absolute() and not path.is_relative_to(directory):
                outside.append(str(path))
            else:
                rel = path.relative_to(directory) if path.is_absolute() else path
                if len(rel.parts) != 1:
                    raise SnapshotError(f"snapshot file {rel} is in a subdirectory")
                names.append(rel.name)
    return Shippable(sorted(set(names)) + [store.MANIFEST], sorted(set(outside)))


@dataclass(frozen=True)
class Suspended:
    """A suspended sandbox's snapshot as the shipper needs it."""

    directory: Path
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
    return Suspended(directory, files.names, base, meta)
