"""The manifest that marks a template directory as completely built.

A build writes everything into a temporary directory, writes manifest.json
last (temp file + fsync + rename) and then renames the directory into place.
A directory without a readable manifest is therefore never taken as built.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1


def write_manifest(directory: Path, data: dict[str, Any]) -> Path:
    """Atomically write ``directory/manifest.json``."""
    path = directory / MANIFEST
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **data}, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a built directory, or None if it is absent or unusable."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return data


def sha256_file(path: Path, chunk: int = 4 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
