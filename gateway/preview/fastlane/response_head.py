"""Message heads as aiohttp writes them, sans I/O: what the fast lane sends is what aiohttp's
path would have sent (the same framing choice, the same default headers, the same bytes)."""

from __future__ import annotations

from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time, should_remove_content_length
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict

from gateway.preview.fastlane.request_head import Request


def serialize(status_line: str, headers: CIMultiDict[str]) -> bytes:
    """A message head as aiohttp writes one (``_serialize_headers``)."""
    parts = [status_line, "\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError("a header contains a newline")
        parts += (name, ": ", value, "\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")


def head_for(req: Request, status: int, reason: str, headers: CIMultiDict[str],
             length: int | None, keep_alive: bool) -> tuple[bytes, bool, bool]:
    """The response head aiohttp's server would write (``StreamResponse._prepare_headers``):
    returns it, whether the body is chunked, and whether the connection stays open."""
    chunked = False
    empty = must_be_empty_body(req.method, status)
    if length is None:
        if req.version >= (1, 1):
            if not empty:
                chunked = True
                headers["Transfer-Encoding"] = "chunked"
        elif not empty:
            keep_alive = False
    if empty:
        if "Content-Length" in headers and should_remove_content_length(req.method, status):
            del headers["Content-Length"]
        headers.popall("Transfer-Encoding", None)
    elif length != 0:
        headers.setdefault("Content-Type", "application/octet-stream")
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    headers.setdefault("Server", SERVER_SOFTWARE)
    if "Connection" not in headers:
        if keep_alive:
            if req.version == (1, 0):
                headers["Connection"] = "keep-alive"
        elif req.version == (1, 1):
            headers["Connection"] = "close"
    line = f"HTTP/{req.version[0]}.{req.version[1]} {status} {reason}"
    return serialize(line, headers), chunked, keep_alive


def out_length(headers: CIMultiDict[str]) -> int | None:
    """The Content-Length of a response head about to go out, if it has a valid one."""
    value = headers.get("Content-Length")
    return int(value) if value is not None and value.isdigit() else None
