"""Suspended sandboxes' snapshots in the shared object store: the upload and the fetch.

A shipped snapshot is its files under ``{prefix}/snapshots/{id}/{digest[:32]}/`` plus
``index.json``, which names every file with its size and SHA256, the disk's base image
identity and the metadata a new host needs to register the sandbox. ``digest`` is the
SHA256 of the index itself, so the location ``{object prefix}#{digest}`` that the
sandbox's etcd record carries pins every byte: a fetch checks the index against the
digest and each file against the index, and refuses anything else.

The index is written last, and the record points at it only after that (the caller's
compare-and-set), so a record never names a half-uploaded snapshot. The disk is the
qcow2 overlay only: its base is the template's image, the same on every host; the index
records the base's identity and a host whose base differs refuses the fetch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gateway.cluster.errors import ClusterError
from gateway.cluster.keys import check_sandbox_id
from gateway.cluster.objstore import ObjectStoreError

INDEX = "index.json"
MAX_INDEX_BYTES = 64 << 10
MAX_FILE_BYTES = 64 << 30
# A file's path relative to the shipped directory: one or two components, each starting
# with a letter or digit (so never "." or "..": nothing can escape the directory).
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME = re.compile(rf"{_PART}(/{_PART})?")


class SnapshotRefused(ClusterError):
    """A shipped snapshot that must not be restored here (corrupt, or another base)."""


class Store(Protocol):  # what shipping needs of gateway.cluster.objstore.ObjectStore
    async def put_file(self, key: str, path: Path, sha256: str) -> None: ...
    async def put_bytes(self, key: str, data: bytes) -> None: ...
    async def get_bytes(self, key: str, limit: int) -> bytes: ...
    async def get_file(self, key: str, path: Path, limit: int) -> str: ...


@dataclass(frozen=True)
class ShipFile:
    name: str  # relative to the shipped directory: "memory", "snapshot/state"
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"bad snapshot file name {self.name!r}")
        if not isinstance(self.size, int) or not 0 <= self.size <= MAX_FILE_BYTES:
            raise ValueError(f"{self.name}: bad size {self.size!r}")
        if not isinstance(self.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: bad sha256")


@dataclass(frozen=True)
class Index:
    sandbox_id: str
    base: str  # the disk's base image identity (the template's image digest)
    files: tuple[ShipFile, ...]
    meta: dict[str, Any] = field(default_factory=dict)  # tenant, template, shape, ...

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Index:
        try:
            data = json.loads(raw)
            files = tuple(ShipFile(**f) for f in data.pop("files"))
            index = cls(files=files, **data)
            check_sandbox_id(index.sandbox_id)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SnapshotRefused(f"unreadable snapshot index: {exc}") from exc
        if len({f.name for f in files}) != len(files) or INDEX in {f.name for f in files}:
            raise SnapshotRefused("snapshot index names a file twice")
        return index


@dataclass(frozen=True)
class UploadPlan:
    prefix: str  # object key prefix, no trailing slash
    digest: str  # SHA256 of ``index``
    index: bytes
    files: tuple[ShipFile, ...]  # largest first: the long transfers start early

    @property
    def location(self) -> str:
        return f"{self.prefix}#{self.digest}"


def plan_upload(key_prefix: str, index: Index) -> UploadPlan:
    raw = index.encode()
    digest = hashlib.sha256(raw).hexdigest()
    prefix = f"{key_prefix.strip('/')}/snapshots/{index.sandbox_id}/{digest[:32]}"
    files = tuple(sorted(index.files, key=lambda f: (-f.size, f.name)))
    return UploadPlan(prefix, digest, raw, files)


def parse_location(location: str) -> tuple[str, str]:
    prefix, sep, digest = location.partition("#")
    if not sep or not prefix or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise SnapshotRefused(f"bad snapshot location {location!r}")
    return prefix, digest


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


HELD_BYTES = 256 << 10  # files up to this size are read once, hashed and sent from memory


def _read_small(path: Path) -> bytes | None:
    with open(path, "rb") as f:
        data = f.read(HELD_BYTES + 1)
    return data if len(data) <= HELD_BYTES else None


async def describe(directory: Path, names: list[str],
                   held: dict[str, bytes] | None = None) -> tuple[ShipFile, ...]:
    """The files to ship (size and SHA256 of each), hashed off the event loop. With
    ``held``, small files are read once into it, so what is sent is what was hashed even
    if the file is replaced meanwhile (a suspended sandbox's manifest is rewritten by the
    background seal while it ships: ``upload`` sends ``held``'s bytes)."""
    out = []
    for name in names:
        path = directory / name
        data = await asyncio.to_thread(_read_small, path) if held is not None else None
        if data is not None:
            assert held is not None
            held[name] = data
            out.append(ShipFile(name, len(data), hashlib.sha256(data).hexdigest()))
            continue
        out.append(ShipFile(name, path.stat().st_size, await asyncio.to_thread(hash_file, path)))
    return tuple(out)


async def _retrying(what: str, attempt: Any, retries: int, backoff: float) -> None:
    for n in range(retries + 1):
        try:
            return await attempt()
        except ObjectStoreError:
            if n == retries:
                raise
            await asyncio.sleep(backoff * 2 ** n)


async def upload(store: Store, plan: UploadPlan, directory: Path, *, concurrency: int = 2,
                 retries: int = 3, backoff: float = 0.5,
                 held: dict[str, bytes] | None = None) -> str:
    """Upload every file (those in ``held`` from those bytes), then the index; the
    location to record. A cancellation (a newer suspend superseding this one) stops every
    transfer; what was sent is left unnamed."""
    gate = asyncio.Semaphore(concurrency)
    held = held or {}

    async def one(f: ShipFile) -> None:
        key = f"{plan.prefix}/{f.name}"
        async with gate:
            if f.name in held:
                await _retrying(f.name, lambda: store.put_bytes(key, held[f.name]), retries,
                                backoff)
                return
            await _retrying(f.name, lambda: store.put_file(
                key, directory / f.name, f.sha256), retries, backoff)

    async with asyncio.TaskGroup() as group:
        for f in plan.files:
            group.create_task(one(f))
    await _retrying(INDEX, lambda: store.put_bytes(f"{plan.prefix}/{INDEX}", plan.index),
                    retries, backoff)
    return plan.location


async def fetch(store: Store, location: str, dest: Path, *,
                base: str | Collection[str]) -> Index:
    """Download a shipped snapshot into ``dest`` (which must not exist), every byte
    checked; on any failure nothing is left at ``dest``. ``base`` is this host's identity
    of the disk's base image (or the set of those it holds): a snapshot made over another
    base is refused."""
    prefix, digest = parse_location(location)
    raw = await store.get_bytes(f"{prefix}/{INDEX}", MAX_INDEX_BYTES)
    if hashlib.sha256(raw).hexdigest() != digest:
        raise SnapshotRefused(f"{location}: the index does not match its digest")
    index = Index.decode(raw)
    if index.base != base if isinstance(base, str) else index.base not in base:
        held = base if isinstance(base, str) else ", ".join(sorted(b[:16] for b in base))
        raise SnapshotRefused(f"{index.sandbox_id}: its disk is an overlay on base "
                              f"{index.base!r}, this host has {held!r}")
    if dest.exists():
        raise FileExistsError(dest)
    partial = dest.with_name(dest.name + ".fetching")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for f in index.files:
            (partial / f.name).parent.mkdir(exist_ok=True)
            got = await store.get_file(f"{prefix}/{f.name}", partial / f.name, f.size)
            if got != f.sha256 or (partial / f.name).stat().st_size != f.size:
                raise SnapshotRefused(f"{index.sandbox_id}: {f.name} does not match its "
                                      "SHA256 (corrupt in the object store or in transit)")
        partial.rename(dest)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, partial, True)
        raise
    return index
