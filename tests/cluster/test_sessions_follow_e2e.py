"""A session follows its sandbox when its host dies (docs/cluster.md, "A session follows
its sandbox"): real daemons (tests/cluster/fleet_env.py), real etcd, real SeaweedFS, ONE
TCG VM.

A session is PUT through h1 (placed on a host A) with a start command that counts its runs
in a file and then serves tests/e2e/preview_app.py (a counter in memory). The counter is
bumped through its API path, the sandbox suspended (the shipper uploads it), A SIGKILLed;
the reaper moves the sandbox to B, B adopts it, and B takes the session over on the first
request for it: the counter goes on from where it was (same process, same boot token),
the start command ran once, the session answers by its API path and its session host,
and the fleet record names B. A comes back: it drops its stale row and forwards to B."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from tests.cluster.fleet_env import Fleet
from tests.cluster.test_adoption import fleet2  # noqa: F401 (the fixture)

SESSIONS = "sessions.localhost"
APP = Path(__file__).parents[1] / "e2e" / "preview_app.py"
START = ("echo run >> /root/starts; while [ ! -f /root/app.py ]; do sleep 0.2; done; "
         "exec python3 /root/app.py 0.0.0.0 8000")


def _session_record(fleet: Fleet, name: str) -> Any:
    from gateway.cluster.etcd import EtcdClient
    from gateway.cluster.keys import Keys
    from gateway.cluster.records import SessionRecord

    async def read() -> Any:
        client = EtcdClient(fleet.etcd.endpoints, attempt_timeout=0.5)
        try:
            kv = await client.get(Keys(f"/{fleet.prefix}").session(name))
        finally:
            await client.aclose()
        return SessionRecord.decode(kv.value) if kv is not None else None
    return fleet.loop.run(read(), timeout=30)


def _count(client: Any, name: str, timeout: float) -> dict[str, Any]:
    """GET the app's /count through the session's API path, waiting out 502 (the app is
    starting) and 503 (the sandbox is being adopted: owner_unavailable, never 404)."""
    deadline = time.monotonic() + timeout
    seen: list[int] = []
    while True:
        r = client.get(f"/v1/sessions/{name}/proxy/count")
        if r.status_code == 200:
            return {**r.json(), "seen": seen}
        assert r.status_code in (502, 503), r.text
        if r.status_code == 503:
            assert r.headers.get("Retry-After"), r.text
        seen.append(r.status_code)
        if r.status_code == 503:
            print(f"[session-follow] 503: {r.text[:300]}")
        assert time.monotonic() < deadline, f"timed out: last {r.status_code} {r.text[:200]}"
        time.sleep(0.3)


def test_a_session_follows_its_sandbox_when_its_host_dies(fleet2: Fleet) -> None:  # noqa: F811
    fleet, name = fleet2, "agent-chat"
    r = fleet.client("h1").put(f"/v1/sessions/{name}", json={"template": "python",
                                                             "start": START})
    assert r.status_code == 201, r.text
    sid = r.json()["sandbox_id"]
    a = fleet.owner(sid)
    b = next(h for h in fleet.hosts if h is not a)
    on_a, on_b = fleet.client(a), fleet.client(b)
    print(f"\n[session-follow] PUT through h1, made on {a.name}")
    r = on_a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/app.tmp"},
                 content=APP.read_bytes())
    assert r.status_code == 201, r.text
    r = on_a.post(f"/v1/sandboxes/{sid}/execute", json={"command": "mv /root/app.tmp "
                                                                   "/root/app.py"})
    assert r.status_code == 200, r.text
    first = _count(on_a, name, 120)
    assert _count(fleet.client("h1"), name, 30)["count"] == first["count"] + 1
    record = _session_record(fleet, name)
    assert (record.host, record.sandbox_id, record.start, record.start_state) == \
        (a.name, sid, START, "started")

    assert on_a.post(f"/v1/sandboxes/{sid}/suspend").json()["state"] == "suspended"
    fleet.wait_for(lambda: bool(fleet.record(sid).snapshot), 120, "snapshot shipped")
    killed_at = time.monotonic()
    fleet.kill(a)
    fleet.wait_for(lambda: fleet.record(sid).host == b.name, 60, "the reaper moves it")

    after = _count(on_b, name, 180)  # 503 while B adopts, then B takes the session over
    took = time.monotonic() - killed_at
    assert after["count"] == first["count"] + 2, after  # memory intact: same process
    assert (after["boot"], after["pid"]) == (first["boot"], first["pid"]), after
    record = _session_record(fleet, name)
    assert (record.host, record.sandbox_id, record.start_state) == (b.name, sid, "started")
    got = on_b.get(f"/v1/sessions/{name}")
    assert got.status_code == 200, got.text
    view = got.json()
    assert (view["sandbox_id"], view["start_state"]) == (sid, "started"), view
    r = on_b.get("/count", headers={"Host": f"{name}.{SESSIONS}",
                                    "X-AgentBox-Token": view["preview_token"]})
    assert r.status_code == 200 and r.json()["count"] == after["count"] + 1, r.text
    r = on_b.post(f"/v1/sandboxes/{sid}/execute", json={"command": "cat /root/starts"})
    assert r.status_code == 200 and r.json()["stdout"] == "run\n", r.text  # started once
    r = on_b.put(f"/v1/sessions/{name}", json={"template": "python", "start": START})
    assert (r.status_code, r.json()["sandbox_id"]) == (200, sid), r.text
    print(f"[session-follow] {a.name} killed -> session served by {b.name} after "
          f"{took:.1f} s (answers while adopting: {sorted(set(after['seen']))})")

    # A comes back: its row is dropped at start-up (B holds the session), and a request
    # through A reaches B.
    fleet.restart(a)
    db = sqlite3.connect(a.data_dir / "registry.sqlite")
    try:
        assert db.execute("SELECT name FROM sessions").fetchall() == []
    finally:
        db.close()
    assert _count(fleet.client(a), name, 60)["count"] == after["count"] + 2
    assert _session_record(fleet, name).host == b.name
    assert on_b.delete(f"/v1/sessions/{name}").status_code == 204
    fleet.wait_for(lambda: _session_record(fleet, name) is None, 30, "the name is freed")
