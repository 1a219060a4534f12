"""File-system work behind ``/files``: stat, list, streamed read, atomic streamed write, delete.

Paths arrive already checked by ``protocol.validate_path``. Anything that may
touch a slow disk (a guest's virtio-blk under emulation) runs in a worker
thread, a chunk at a time, so health checks stay answered while a large file
moves. Every OSError leaves through :func:`os_errors` as one of our errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import shutil
import stat
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import BinaryIO

from guest.errors import AgentError, BadRequest, InvalidPath, IsADirectory, NotADirectory
from guest.errors import from_os_error
from guest.protocol import DirListing, FileInfo

CHUNK = 256 * 1024  # per thread hop: large enough that hops cost little, small enough to stream
NEW_FILE_MODE = 0o644


@contextlib.contextmanager
def os_errors(path: str) -> Iterator[None]:
    """Map OSError to our errors (FileExistsError from makedirs means a file is in the way)."""
    try:
        yield
    except FileExistsError as exc:
        raise NotADirectory(f"{path}: a parent is not a directory") from exc
    except OSError as exc:
        raise from_os_error(exc, path) from exc


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def file_info(path: str, st: os.stat_result) -> FileInfo:
    return FileInfo(
        path=path,
        name=posixpath.basename(path) or "/",
        type=_kind(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
    )


def stat_path(path: str) -> FileInfo:
    """FileInfo of ``path`` itself (a symlink is reported as ``symlink``)."""
    with os_errors(path):
        return file_info(path, os.lstat(path))


def list_dir(path: str) -> DirListing:
    entries = []
    with os_errors(path), os.scandir(path) as it:
        for entry in it:
            try:
                entries.append(file_info(entry.path, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # removed while we listed
    entries.sort(key=lambda e: e.name)
    return DirListing(path=path, entries=entries)


def open_for_read(path: str) -> tuple[BinaryIO, int] | DirListing:
    """An open regular file and its size, or the listing if ``path`` is a directory."""
    with os_errors(path):
        # stat first: opening a FIFO for reading would block until a writer comes.
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            return list_dir(path)
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"{path}: not a regular file")
        f = open(path, "rb", buffering=0)  # the caller closes it once the body is sent
        return f, os.fstat(f.fileno()).st_size


async def read_chunks(f: BinaryIO, size: int) -> AsyncIterator[bytes]:
    """Yield exactly ``size`` bytes of ``f`` (the Content-Length already promised)."""
    remaining = size
    while remaining > 0:
        chunk = await asyncio.to_thread(f.read, min(CHUNK, remaining))
        if not chunk:
            raise AgentError(f"{f.name}: file shrank while being read")
        remaining -= len(chunk)
        yield chunk


async def write_atomic(path: str, chunks: AsyncIterable[bytes]) -> FileInfo:
    """Stream ``chunks`` into a temp file next to ``path`` and rename it over ``path``.

    Readers see the old content or the new, never a partial file. A symlink at
    ``path`` is written through (its target is replaced), as editors do.
    """
    target = os.path.realpath(path)
    with os_errors(path):
        fd, tmp = await asyncio.to_thread(_create_temp, target)
        try:
            with os.fdopen(fd, "wb") as f:
                await _copy(chunks, f)
                await asyncio.to_thread(_commit, f, tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return file_info(path, os.stat(target))


def _create_temp(target: str) -> tuple[int, str]:
    parent, name = posixpath.split(target)
    if not name:
        raise InvalidPath("cannot write to /")
    if os.path.isdir(target):
        raise IsADirectory(f"{target}: is a directory")
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{name[:64]}.", suffix=".agentbox-part")
    try:
        _copy_mode(fd, target)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, tmp


def _copy_mode(fd: int, target: str) -> None:
    try:
        st = os.stat(target)
    except FileNotFoundError:
        os.fchmod(fd, NEW_FILE_MODE)  # mkstemp's 0600 would surprise non-root readers
        return
    os.fchmod(fd, stat.S_IMODE(st.st_mode))  # an overwrite keeps mode and owner
    if os.geteuid() == 0:
        os.fchown(fd, st.st_uid, st.st_gid)


async def _copy(chunks: AsyncIterable[bytes], f: BinaryIO) -> None:
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) >= CHUNK:
            await asyncio.to_thread(f.write, bytes(buf))
            buf.clear()
    if buf:
        await asyncio.to_thread(f.write, bytes(buf))


def _commit(f: BinaryIO, tmp: str, target: str) -> None:
    f.flush()
    os.fsync(f.fileno())  # the rename must not land before the data does
    os.rename(tmp, target)
    dfd = os.open(os.path.dirname(target) or "/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # ... and the rename itself is on disk before we answer
    finally:
        os.close(dfd)


def delete(path: str) -> None:
    """Remove a file, symlink or (recursively) a directory."""
    if path == "/":
        raise BadRequest("refusing to delete /")
    with os_errors(path):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
