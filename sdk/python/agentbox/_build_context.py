"""Packing a build context (no I/O beyond reading the files): a tar of the directory,
skipping what ``.dockerignore`` names (simple patterns) and VCS/cache directories."""

from __future__ import annotations

import fnmatch
import io
import tarfile
from pathlib import Path

from agentbox.exceptions import InvalidArgumentError

ALWAYS_SKIPPED = (".git", "__pycache__", ".venv", "node_modules")
MAX_CONTEXT_BYTES = 64 * 1024 * 1024  # the server's default [build] max_context_bytes


def _ignored(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    return [line.strip().rstrip("/") for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def pack_context(context: Path, dockerfile: str | Path | None = None) -> tuple[bytes, str]:
    """(tar bytes, the Dockerfile's path inside the tar)."""
    if not context.is_dir():
        raise InvalidArgumentError(f"build context {context} is not a directory")
    patterns = _ignored(context)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(context.rglob("*")):
            rel = path.relative_to(context).as_posix()
            if any(part in ALWAYS_SKIPPED for part in path.relative_to(context).parts):
                continue
            if any(fnmatch.fnmatch(rel, p) or rel.startswith(p + "/") for p in patterns):
                continue
            if path.is_file() or path.is_symlink():
                tar.add(path, arcname=rel, recursive=False)
        name = "Dockerfile"
        if dockerfile is not None:
            dpath = Path(dockerfile)
            try:
                name = dpath.resolve().relative_to(context.resolve()).as_posix()
            except ValueError:  # outside the context: add it under a name of its own
                name = ".agentbox.Dockerfile"
                tar.add(dpath, arcname=name)
        if buf.tell() > MAX_CONTEXT_BYTES:
            raise InvalidArgumentError(f"the build context is larger than {MAX_CONTEXT_BYTES} "
                                       "bytes (add a .dockerignore)")
    return buf.getvalue(), name
