"""Files the daemon keeps at rest are its alone: the data dir 0700, the registry and key
files 0600.

Each is created with its mode (``os.open``/``mkdir`` with an explicit mode; the umask can
only narrow it), never created open and tightened afterwards, so no other local user
can open it in between. A file or directory left looser by an older version is
tightened on start (it is not new: whatever could read it already could). SQLite
gives ``-wal`` and ``-shm`` the database file's mode, so a 0600 registry keeps them
0600 too; left-over ones are tightened with it. Per-VM memory files and disks are
``vmctl``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """``path`` (and missing parents) exists and is 0700."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    _tighten(path, DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """``path`` exists (empty if it was not there) and is 0600, as are SQLite's side files."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o777 & ~FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm", "-journal"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            _tighten(side, FILE_MODE)
    return path


def write_secret(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` (0600 from its creation; replaced atomically)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: never reuse a file someone else made
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _tighten(path: Path, mode: int) -> None:
    if path.stat().st_mode & 0o777 & ~mode:
        path.chmod(mode)
