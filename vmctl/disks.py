"""Disk layers and memory files for sandboxes.

Templates are read-only; each sandbox writes to its own qcow2 overlay whose
backing file is the template's golden disk. Memory files are copied with
``cp --sparse=always --reflink=auto``: on XFS/btrfs that is a reflink (no
data copied); elsewhere only the pages the template touched are written.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from vmctl.errors import VmctlError


class DiskError(VmctlError):
    code = "disk_error"
    status = 500


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        raise DiskError(f"{argv[0]} failed: {err.decode(errors='replace').strip()}")


async def create_overlay(path: Path, backing: Path, backing_format: str = "qcow2") -> None:
    await _run("qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_format,
               "-b", str(backing.resolve()), str(path))


async def copy_sparse(src: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    await _run("cp", "--sparse=always", "--reflink=auto", str(src), str(tmp))
    tmp.replace(dest)
