"""What of a sandbox's own snapshot can be shipped to another host (gateway.cluster.shipper).

The snapshot directory holds the device state, memory (whole or as a diff from the
golden's), the disk overlay and ``manifest.json`` (vmctl.store). Files inside the
directory are shipped; a path the manifest names outside it (a compact memory's golden,
the overlay's base) is the template's, the same on every host built from the same
inputs, and is returned apart so the caller can record its identity instead of its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
