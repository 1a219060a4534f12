"""Content hashes of build inputs.

Each artifact is keyed by a hash of exactly what determines it (package
versions, file contents, settings, the code that builds it), so an unchanged
template is found instantly and a change rebuilds only what it affects.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

HASH_CHARS = 20


def digest(*parts: Any) -> str:
    """Stable hash of JSON-able parts (dict order does not matter)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:HASH_CHARS]


Files = tuple[tuple[str, bytes], ...]


def snapshot_files(root: Path, pattern: str = "**/*.py") -> Files:
    """(relative path, content) of files under ``root``, caches excluded.

    Builds install this snapshot rather than re-reading the directory, so an
    edit made while a build runs cannot end up under the old hash.
    """
    return tuple((p.relative_to(root).as_posix(), p.read_bytes())
                 for p in sorted(tree_files(root, pattern)))


def files_digest(files: Files) -> str:
    """Hash of file names and contents."""
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(name.encode() + b"\0")
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()[:HASH_CHARS]


def tree_files(root: Path, pattern: str = "**/*.py") -> list[Path]:
    return [p for p in root.glob(pattern)
            if p.is_file() and "__pycache__" not in p.relative_to(root).parts]


def source_digest(*modules: Path) -> str:
    """Hash of the build code itself: changing how we build changes the key."""
    return digest(*[hashlib.sha256(m.read_bytes()).hexdigest() for m in modules])
