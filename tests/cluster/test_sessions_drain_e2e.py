"""A drained host's session keeps answering (docs/cluster.md, "A session follows its
sandbox"): real daemons, etcd, SeaweedFS, ONE TCG VM. A session's sandbox (running its
counter app, tests/e2e/preview_app.py) is live-migrated away by ``agentbox-server drain``
while a client keeps asking the session through the other host; afterwards the new owner
holds the session (record and row), the counter went on in the same process (the start
command ran once), and the drained host's row is gone."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time

from tests.cluster.fleet_env import REPO, Fleet
from tests.cluster.test_adoption import fleet2  # noqa: F401 (the fixture)
from tests.cluster.test_sessions_follow_e2e import APP, START, _count, _session_record


def test_a_drain_moves_a_sessions_running_sandbox_and_the_session_keeps_answering(
        fleet2: Fleet) -> None:  # noqa: F811
    fleet, name = fleet2, "agent-drain"
    r = fleet.client("h1").put(f"/v1/sessions/{name}", json={"template": "python",
                                                             "start": START})
    assert r.status_code == 201, r.text
    sid = r.json()["sandbox_id"]
    a = fleet.owner(sid)
    b = next(h for h in fleet.hosts if h is not a)
    on_a, on_b = fleet.client(a), fleet.client(b)
    assert on_a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/app.tmp"},
                    content=APP.read_bytes()).status_code == 201
    assert on_a.post(f"/v1/sandboxes/{sid}/execute",
                     json={"command": "mv /root/app.tmp /root/app.py"}).status_code == 200
    first = _count(on_b, name, 120)

    answers: list[tuple[int, dict]] = []
    stop = threading.Event()

    def ask() -> None:
        asker = fleet.client(b, timeout=60)
        while not stop.is_set():
            r = asker.get(f"/v1/sessions/{name}/proxy/count")
            answers.append((r.status_code, r.json() if r.status_code == 200 else
                            {"text": r.text[:200]}))
            time.sleep(0.2 if r.status_code == 200 else 1.0)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    try:
        cli = subprocess.run(
            ["nsenter", f"--net=/var/run/netns/{fleet.etcd.switch}", "--", sys.executable,
             "-m", "gateway.cli", "drain", a.name, "--config", str(a.config_path),
             "--wait", "300"], cwd=REPO, capture_output=True, text=True, timeout=400)
        assert cli.returncode == 0, (cli.stdout, cli.stderr)
        fleet.wait_for(lambda: _session_record(fleet, name).host == b.name, 30,
                       "the new owner takes the session over")
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert fleet.record(sid).host == b.name
    bad = [x for x in answers if x[0] not in (200, 503)]
    assert not bad, bad[:5]  # never session_not_found; 503 (retry) at most
    counts = [x[1]["count"] for x in answers if x[0] == 200]
    assert counts == list(range(first["count"] + 1, first["count"] + 1 + len(counts)))
    last = _count(on_b, name, 30)
    assert (last["boot"], last["pid"]) == (first["boot"], first["pid"]), last
    r = on_b.post(f"/v1/sandboxes/{sid}/execute", json={"command": "cat /root/starts"})
    assert r.status_code == 200 and r.json()["stdout"] == "run\n", r.text
    record = _session_record(fleet, name)
    assert (record.host, record.sandbox_id, record.start_state) == (b.name, sid, "started")

    def rows_on_a() -> list:
        db = sqlite3.connect(a.data_dir / "registry.sqlite")
        try:
            return db.execute("SELECT name FROM sessions").fetchall()
        finally:
            db.close()
    fleet.wait_for(lambda: rows_on_a() == [], 30, f"{a.name} drops its stale row")
    print(f"\n[session-drain] {a.name} -> {b.name}: {len(counts)} answers, "
          f"{sum(1 for x in answers if x[0] == 503)} x 503")
    assert on_a.get(f"/v1/sessions/{name}").status_code == 200  # forwarded to b
    subprocess.run(["nsenter", f"--net=/var/run/netns/{fleet.etcd.switch}", "--",
                    sys.executable, "-m", "gateway.cli", "drain", a.name, "--undo",
                    "--config", str(a.config_path)], cwd=REPO, check=True,
                   capture_output=True, timeout=60)
    assert on_b.delete(f"/v1/sessions/{name}").status_code == 204
