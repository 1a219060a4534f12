# Generated from agentbox/async_files.py by sdk/python/gen_sync.py: do not edit.
"""``sandbox.files``: read, write, list and remove files in a sandbox.

(``agentbox.files`` is generated from ``async_files.py`` by sdk/python/gen_sync.py.)

Paths are absolute in the sandbox; a relative path is taken from ``/root``.
Reads and writes stream: neither side holds a whole large file in memory unless
the caller asks for ``bytes``/``text``. ``GET`` on a directory answers its
listing as JSON, which is how ``list`` and the directory checks work.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import httpx

from agentbox import _calls, _upload
from agentbox._transport import SyncTransport, mapped_errors
from agentbox.exceptions import InvalidArgumentError, NotFoundError, SandboxNotFoundError
from agentbox.models import FileInfo

Format = Literal["text", "bytes", "stream"]
_MISSING = NotFoundError.code


def _is_listing(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").startswith("application/json")


def _entries(data: Any) -> list[FileInfo]:
    return [FileInfo.from_dict(e) for e in (data or {}).get("entries", [])]


def _file_missing(exc: NotFoundError) -> bool:
    return exc.code == _MISSING and not isinstance(exc, SandboxNotFoundError)


def _mkdir(path: str) -> str:
    p = shlex.quote(_calls.sandbox_path(path))
    return f"if [ -d {p} ]; then exit 3; fi; mkdir -p -- {p}"


class ByteStream:
    """An open download. Iterate for chunks, or ``read()`` it all; ``close()`` (or use
    ``with``) if you stop early. ``size`` is the file's length when the server said it."""

    def __init__(self, cm: AbstractContextManager[httpx.Response],
                 resp: httpx.Response) -> None:
        self._cm, self._resp, self._closed = cm, resp, False
        length = resp.headers.get("content-length")
        self.size = int(length) if length is not None else None

    def __iter__(self) -> Iterator[bytes]:
        try:
            with mapped_errors("download"):
                yield from self._resp.iter_bytes(_upload.CHUNK)
        finally:
            self.close()

    def read(self) -> bytes:
        return b"".join([chunk for chunk in self])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> ByteStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Files:
    def __init__(self, sandbox_id: str, transport: SyncTransport) -> None:
        self._id, self._t = sandbox_id, transport

    def write(self, path: str, data: _upload.Data, *,
              on_progress: _upload.Progress | None = None) -> FileInfo:
        """Write ``data`` (str, bytes, a binary file, a local Path, or an iterable of bytes)
        to ``path``, creating parent directories; atomic on the sandbox side."""
        body, size = _upload.prepare(data)
        size = _upload.sized(body, size)
        body = _upload.with_progress(body, size, on_progress)
        return FileInfo.from_dict(self._t.json(
            _calls.write_file(self._id, path, body, size)))

    def read(self, path: str, format: Format = "text") -> Any:
        """The file's content as ``str`` (UTF-8), ``bytes``, or an open :class:`ByteStream`."""
        stream = self._open(path)
        if format == "stream":
            return stream
        data = stream.read()
        return data if format == "bytes" else data.decode()

    def _open(self, path: str) -> ByteStream:
        cm = self._t.stream(_calls.read_file(self._id, path))
        resp = cm.__enter__()
        if _is_listing(resp):
            cm.__exit__(None, None, None)
            raise InvalidArgumentError(f"{path} is a directory", status=400,
                                       code="is_a_directory")
        return ByteStream(cm, resp)

    def list(self, path: str = _calls.HOME) -> list[FileInfo]:
        """The entries of a directory, sorted by name."""
        with self._t.stream(_calls.read_file(self._id, path)) as resp:
            if not _is_listing(resp):
                raise InvalidArgumentError(f"{path} is not a directory", status=400,
                                           code="not_a_directory")
            resp.read()
            return _entries(resp.json())

    def exists(self, path: str) -> bool:
        try:
            self._t.send(_calls.stat_file(self._id, path))
            return True
        except NotFoundError as exc:
            if _file_missing(exc):
                return False
            raise

    def remove(self, path: str) -> None:
        """Delete a file, or a directory with everything in it."""
        self._t.send(_calls.delete_file(self._id, path))

    def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        call = _calls.execute(self._id, None, _mkdir(path), None, 30, None, None)
        return _made(self._t.json(call), path)

    def download(self, path: str, dest: str | Path, *,
                 on_progress: _upload.Progress | None = None) -> Path:
        """Stream a sandbox file into the local file ``dest``; returns ``dest``."""
        dest = Path(dest)
        with self._open(path) as stream:
            with dest.open("wb") as out:
                done = 0
                for chunk in stream:
                    out.write(chunk)
                    done += len(chunk)
                    if on_progress:
                        on_progress(done, stream.size)
        return dest


def _made(result: Any, path: str) -> bool:
    code = int((result or {}).get("exit_code", 1))
    if code not in (0, 3):
        raise InvalidArgumentError(f"cannot create {path}: {(result or {}).get('stderr', '')}"
                                   .strip(), status=400, code="mkdir_failed")
    return code == 0
