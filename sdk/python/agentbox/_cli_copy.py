"""``agentbox cp``: one file between this machine and a sandbox, streamed.

``SBX:/path`` names a sandbox file (a relative path is under /root); anything
else is local (``-`` = stdin/stdout). A destination that is a directory (a
local one, or a remote path ending in ``/``) gets the source's file name.
"""

from __future__ import annotations

import posixpath
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox._cli_output import Progress
from agentbox.client import AgentBox
from agentbox.exceptions import InvalidArgumentError

_REMOTE = re.compile(r"^([A-Za-z0-9_.-]+):(.*)$")


@dataclass(frozen=True)
class Endpoint:
    sandbox: str | None  # None: local
    path: str

    @property
    def remote(self) -> bool:
        return self.sandbox is not None


def parse(arg: str) -> Endpoint:
    """``ID:PATH`` is remote unless it looks like a local path (``./a:b``, ``/x:y``)."""
    match = _REMOTE.match(arg)
    if match and "/" not in match.group(1):
        return Endpoint(match.group(1), match.group(2) or "/root/")
    return Endpoint(None, arg)


def copy(box: AgentBox, src_arg: str, dst_arg: str, show_progress: bool = True) -> dict[str, Any]:
    src, dst = parse(src_arg), parse(dst_arg)
    if src.remote == dst.remote:
        raise InvalidArgumentError("cp copies between this machine and a sandbox: exactly one "
                                   "of SRC and DST must be SBX:/path")
    start = time.monotonic()
    if dst.remote:
        result = _upload(box, src, dst, show_progress)
    else:
        result = _download(box, src, dst, show_progress)
    return {**result, "seconds": round(time.monotonic() - start, 3)}


def _upload(box: AgentBox, src: Endpoint, dst: Endpoint, show: bool) -> dict[str, Any]:
    assert dst.sandbox is not None
    name = "stdin" if src.path == "-" else Path(src.path).name
    path = dst.path + name if dst.path.endswith("/") else dst.path
    if src.path != "-" and Path(src.path).is_dir():
        raise InvalidArgumentError(f"{src.path} is a directory (cp copies one file)")
    progress = Progress(f"{name} -> {dst.sandbox}:{path}") if show else None
    data: Any = sys.stdin.buffer if src.path == "-" else Path(src.path)
    info = box.connect(dst.sandbox).files.write(path, data, on_progress=progress)
    if progress:
        progress.done()
    return {"sandbox": dst.sandbox, "path": info.path, "bytes": info.size, "direction": "up"}


def _download(box: AgentBox, src: Endpoint, dst: Endpoint, show: bool) -> dict[str, Any]:
    assert src.sandbox is not None
    files = box.connect(src.sandbox).files
    name = posixpath.basename(src.path.rstrip("/")) or "download"
    if dst.path == "-":
        done = 0
        with files.read(src.path, format="stream") as stream:
            for chunk in stream:
                sys.stdout.buffer.write(chunk)
                done += len(chunk)
        sys.stdout.buffer.flush()
        return {"sandbox": src.sandbox, "path": "-", "bytes": done, "direction": "down"}
    target = Path(dst.path)
    if target.is_dir() or dst.path.endswith("/"):
        target = target / name
    progress = Progress(f"{src.sandbox}:{src.path} -> {target}") if show else None
    files.download(src.path, target, on_progress=progress)
    if progress:
        progress.done()
    return {"sandbox": src.sandbox, "path": str(target), "bytes": target.stat().st_size,
            "direction": "down"}
