"""Upload bodies: whatever the caller gave (str, bytes, a file, a path, an iterable of
chunks) as a sized, chunked stream with optional progress reports."""

from __future__ import annotations

import io
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from agentbox.exceptions import InvalidArgumentError

CHUNK = 256 * 1024
Progress = Callable[[int, "int | None"], Any]  # (bytes sent, total or None)
Data = str | bytes | bytearray | memoryview | IO[bytes] | IO[str] | Path | Iterable[bytes]


def _file_size(f: Any) -> int | None:
    try:
        return os.fstat(f.fileno()).st_size - f.tell()
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass
    try:
        here = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(here)
        return int(end - here)
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _file_chunks(f: Any) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)


def _path_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        yield from _file_chunks(f)


def prepare(data: Any) -> tuple[Any, int | None]:
    """``(body, size)``: bytes as they are, anything else as an iterator of chunks."""
    if isinstance(data, str):
        return data.encode(), None
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data), None
    if isinstance(data, Path):
        if not data.is_file():
            raise InvalidArgumentError(f"not a local file: {data}")
        return _path_chunks(data), data.stat().st_size
    if hasattr(data, "read"):
        return _file_chunks(data), _file_size(data)
    if isinstance(data, (Iterable, AsyncIterable)):
        return data, None
    raise InvalidArgumentError(f"cannot upload a {type(data).__name__}: give str, bytes, a "
                               "file opened in binary mode, a Path or an iterable of bytes")


def sized(body: Any, size: int | None) -> int | None:
    return len(body) if isinstance(body, bytes) else size


def with_progress(body: Any, total: int | None, progress: Progress | None) -> Any:
    if progress is None:
        return body
    if isinstance(body, bytes):
        body = iter([body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""])

    def counted() -> Iterator[bytes]:
        done = 0
        for chunk in body:
            done += len(chunk)
            yield chunk
            progress(done, total)
    return counted()


async def as_async(body: Any) -> AsyncIterator[bytes]:
    """httpx's AsyncClient streams only async iterables."""
    if isinstance(body, AsyncIterable):
        async for chunk in body:
            yield chunk
    else:
        for chunk in body:
            yield chunk


async def as_async_with_progress(body: Any, total: int | None,
                                 progress: Progress | None) -> AsyncIterator[bytes]:
    if isinstance(body, bytes):
        body = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    done = 0
    async for chunk in as_async(body):
        done += len(chunk)
        yield chunk
        if progress is not None:
            progress(done, total)
