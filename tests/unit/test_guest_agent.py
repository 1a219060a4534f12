"""The agent app as the host sees it: /health, /init, error mapping, start-up as a process."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from guest.agent import create_app
from guest.keepawake import register
from guest.protocol import PROTOCOL_VERSION, ExecResult, Health
from guest.restore import SystemSetters

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


class FakeSystem:
    """Records what /init asks of the system instead of changing the host."""

    def __init__(self, fail: bool = False) -> None:
        self.clock: list[int] = []
        self.entropy: list[bytes] = []
        self.identity: list[tuple[str, str]] = []
        self.fail = fail

    def set_clock(self, time_ns: int) -> None:
        if self.fail:
            raise PermissionError(1, "Operation not permitted")
        self.clock.append(time_ns)

    def add_entropy(self, data: bytes) -> None:
        self.entropy.append(data)

    def setters(self) -> SystemSetters:
        return SystemSetters(set_clock=self.set_clock, add_entropy=self.add_entropy,
                             set_hostname=lambda h: self.identity.append(("hostname", h)),
                             set_machine_id=lambda m: self.identity.append(("machine-id", m)))


@pytest.fixture
def system():
    return FakeSystem()


@pytest.fixture
def keepawake_dir(tmp_path):
    return tmp_path / "keepawake"


@pytest.fixture
async def client(aiohttp_client, keepawake_dir, system):
    app = create_app(keepawake_dir=str(keepawake_dir), setters=system.setters())
    return await aiohttp_client(app)


async def error_of(resp) -> tuple[int, str]:
    return resp.status, (await resp.json())["error"]["code"]


async def test_health(client):
    resp = await client.get("/health")
    assert resp.status == 200
    assert Health.from_dict(await resp.json()) == Health("ok", PROTOCOL_VERSION, 0, 0)


async def test_health_counts_live_vetoes_only(client, keepawake_dir):
    register(str(keepawake_dir), os.getpid())  # alive: counts
    (keepawake_dir / str(dead_pid())).write_text("12345")  # exited: stale, cleaned
    (keepawake_dir / "hold-build").write_text("")
    health = Health.from_dict(await (await client.get("/health")).json())
    assert health.veto == 2
    assert sorted(os.listdir(keepawake_dir)) == sorted([str(os.getpid()), "hold-build"])


def dead_pid() -> int:
    proc = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, check=True)
    return int(proc.stdout)


async def test_init_sets_clock_entropy_and_env(client, system):
    body = {"time_ns": 1_800_000_000_000_000_000, "entropy_hex": "00ff10", "env": {"A": "1"}}
    resp = await client.post("/init", json=body)
    assert resp.status == 204
    assert system.clock == [1_800_000_000_000_000_000]
    assert system.entropy == [b"\x00\xff\x10"]
    resp = await client.post("/exec", json={"command": 'echo "$A"'})
    assert ExecResult.from_dict(await resp.json()).stdout == "1\n"
    resp = await client.post("/exec", json={"command": 'echo "$A"', "env": {"A": "2"}})
    assert ExecResult.from_dict(await resp.json()).stdout == "2\n"  # the request wins


async def test_init_without_entropy_skips_it(client, system):
    assert (await client.post("/init", json={"time_ns": 5})).status == 204
    assert (system.clock, system.entropy, system.identity) == ([5], [], [])


async def test_a_first_init_sets_hostname_and_machine_id(client, system):
    body = {"time_ns": 5, "hostname": "sbx-0123abcd", "machine_id": "ab" * 16}
    assert (await client.post("/init", json=body)).status == 204
    assert system.identity == [("hostname", "sbx-0123abcd"), ("machine-id", "ab" * 16)]
    for bad in ({"hostname": "Bad_Host"}, {"hostname": "-x"}, {"machine_id": "xyz"},
                {"machine_id": "AB" * 16}, {"hostname": 3}):
        resp = await client.post("/init", json={"time_ns": 5, **bad})
        assert await error_of(resp) == (400, "bad_request"), bad
    assert len(system.identity) == 2


def test_write_machine_id_is_atomic_and_read_only(tmp_path):
    from guest.restore import write_machine_id

    path = tmp_path / "machine-id"
    path.write_text("old\n")
    write_machine_id("cd" * 16, str(path))
    assert path.read_text() == "cd" * 16 + "\n" and path.stat().st_mode & 0o777 == 0o444
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine-id"]


def test_init_request_sends_identity_only_when_set():
    from guest.protocol import InitRequest

    assert set(InitRequest(time_ns=1).to_dict()) == {"time_ns", "entropy_hex", "env"}
    assert InitRequest(time_ns=1, hostname="h").to_dict()["hostname"] == "h"


@pytest.mark.parametrize(
    "body",
    [
        {"time_ns": "now"},
        {"time_ns": True},
        {"time_ns": -1},
        {"time_ns": 1, "entropy_hex": "xyz"},
        {"time_ns": 1, "env": {"A": 1}},
        {"entropy_hex": "00"},
        {"time_ns": 1, "extra": 1},
    ],
)
async def test_init_rejects_bad_requests(client, system, body):
    assert await error_of(await client.post("/init", json=body)) == (400, "bad_request")
    assert system.clock == []


async def test_init_reports_a_failed_setter_after_doing_the_rest(aiohttp_client, tmp_path):
    system = FakeSystem(fail=True)
    client = await aiohttp_client(create_app(keepawake_dir=str(tmp_path), setters=system.setters()))
    body = {"time_ns": 1, "entropy_hex": "aa", "env": {"B": "x"}}
    assert await error_of(await client.post("/init", json=body)) == (500, "internal")
    assert system.entropy == [b"\xaa"]
    resp = await client.post("/exec", json={"command": 'echo "$B"'})
    assert ExecResult.from_dict(await resp.json()).stdout == "x\n"


async def test_malformed_json_is_bad_json(client):
    for url in ("/exec", "/init"):
        assert await error_of(await client.post(url, data=b"{")) == (400, "bad_json")
        assert await error_of(await client.post(url, data=b"\xff\xfe")) == (400, "bad_json")


async def test_unknown_route_and_method_are_json_errors(client):
    assert await error_of(await client.get("/nope")) == (404, "not_found")
    assert await error_of(await client.get("/exec")) == (405, "method_not_allowed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_runs_as_a_module_and_stops_on_sigterm(tmp_path):
    port = free_port()
    argv = ["-m", "guest.agent", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "AGENTBOX_KEEPAWAKE_DIR": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        health = await wait_for_health(port)
        assert health.status == "ok"
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0
        assert b"listening on 127.0.0.1" in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()


async def wait_for_health(port: int, within: float = 15.0) -> Health:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    return Health.from_dict(await resp.json())
            except aiohttp.ClientConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


async def test_oversized_body_is_413(client):
    resp = await client.post("/exec", data=io.BytesIO(b" " * (17 * 1024 * 1024)))
    assert await error_of(resp) == (413, "too_large")
