"""Sessions through a real daemon: idempotent create, host and path routing, suspend/wake
with the app's memory intact, a daemon restart, the start command run exactly once (issue 4).

Uses a private daemon (restarted mid-test), so the shared one is left alone.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e

APP = Path(__file__).with_name("preview_app.py")


def start_command() -> str:
    """Writes the app from the command line itself (a new session's disk is the template's)
    and records every run of the start command in /root/starts.log."""
    script = base64.b64encode(APP.read_bytes()).decode()
    return (f"echo run >> /root/starts.log && echo {script} | base64 -d > /root/app.py && "
            "exec python3 /root/app.py 0.0.0.0 8000")


def wait_count(client: httpx.Client, name: str, **headers) -> dict:
    deadline = time.monotonic() + 60
    while True:
        r = client.get("/count", headers={"Host": f"{name}.sessions.localhost", **headers})
        if r.status_code != 502 or time.monotonic() > deadline:
            assert r.status_code == 200, (r.status_code, r.headers, r.text)
            return r.json()
        time.sleep(0.2)


def test_session_lifecycle_restart_and_suspend(images_built, tmp_path):
    data = tmp_path / "data"
    d = start_daemon(data)
    name = "alice-" + secrets.token_hex(3)
    try:
        with d.client() as api, httpx.Client(base_url=d.url, timeout=120) as web:
            spec = {"port": 8000, "idle_timeout": 0, "start": start_command(),
                    "metadata": {"owner": "alice"}}
            r = api.put(f"/v1/sessions/{name}", json=spec)
            assert r.status_code == 201, r.text
            s = r.json()
            sid, token = s["sandbox_id"], s["preview_token"]
            assert s["start_state"] == "started" and s["start_pid"] > 0
            assert s["url"] == f"{d.url.replace('127.0.0.1', name + '.sessions.localhost')}"
            again = api.put(f"/v1/sessions/{name}", json=spec)
            assert again.status_code == 200 and again.json()["sandbox_id"] == sid
            assert [x["name"] for x in api.get("/v1/sessions").json()["sessions"]] == [name]

            # Another tenant cannot take (or see) the name.
            other = api.post("/v1/keys", json={"name": "bob"}).json()["key"]
            with d.client(other) as bob:
                r = bob.put(f"/v1/sessions/{name}", json=spec)
                assert r.status_code == 409 and r.json()["error"]["code"] == "session_name_taken"
                assert bob.get(f"/v1/sessions/{name}").status_code == 404
                assert bob.get(f"/v1/sessions/{name}/proxy/count").status_code == 404

            # Host form (preview token) and path form (API key) reach the same process.
            assert web.get("/count", headers={"Host": f"{name}.sessions.localhost"}
                           ).status_code == 401
            first = wait_count(web, name, **{"X-AgentBox-Token": token})
            r = api.get(f"/v1/sessions/{name}/proxy/count")
            assert r.status_code == 200 and r.json()["count"] == first["count"] + 1
            assert r.json()["boot"] == first["boot"]
            r = api.get(f"/v1/sessions/{name}/proxy/headers")
            assert "Authorization" not in r.json()  # the API key never reaches the app

            # Suspend, then a request wakes it with the app's memory intact.
            r = api.post(f"/v1/sandboxes/{sid}/suspend")
            assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
            assert api.get(f"/v1/sessions/{name}").json()["state"] == "suspended"
            r = web.get("/count", headers={"Host": f"{name}.sessions.localhost",
                                           "X-AgentBox-Token": token})
            assert r.status_code == 200 and "x-agentbox-wake-ms" in r.headers
            assert (r.json()["boot"], r.json()["count"]) == (first["boot"], first["count"] + 2)

        # The daemon restarts; the session (and its process) are still there.
        stop_daemon(d)
        d = start_daemon(data)
        with d.client() as api, httpx.Client(base_url=d.url, timeout=120) as web:
            s = api.get(f"/v1/sessions/{name}").json()
            assert s["sandbox_id"] == sid and s["start_state"] == "started"
            after = wait_count(web, name, **{"X-AgentBox-Token": token})
            assert (after["boot"], after["count"]) == (first["boot"], first["count"] + 3)
            # ... and across another suspend/wake cycle after the restart.
            api.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
            r = api.get(f"/v1/sessions/{name}/proxy/count")
            assert r.status_code == 200 and r.json()["boot"] == first["boot"]
            # The start command ran exactly once.
            r = api.get(f"/v1/sandboxes/{sid}/files/root/starts.log")
            assert r.status_code == 200 and r.text == "run\n"
            assert api.put(f"/v1/sessions/{name}", json=spec).status_code == 200
            # Delete: the session and its sandbox are gone; the name is free again.
            assert api.delete(f"/v1/sessions/{name}").status_code == 204
            assert api.get(f"/v1/sessions/{name}").status_code == 404
            assert api.get(f"/v1/sandboxes/{sid}").status_code == 404
            r = web.get("/count", headers={"Host": f"{name}.sessions.localhost"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    finally:
        stop_daemon(d)
        for pid in vmm_pids_for(str(data)):  # only after a failure: the session was deleted
            os.kill(pid, signal.SIGKILL)


def test_session_names_are_validated(api):
    for bad in ("Alice", "-a", "a-", "a_b", "a" * 64, "a.b"):
        r = api.put(f"/v1/sessions/{bad}", json={})
        assert r.status_code in (400, 404), (bad, r.text)
    assert api.put("/v1/sessions/ok", json={"port": 0}).status_code == 400
    assert api.put("/v1/sessions/ok", json={"bogus": 1}).status_code == 400
    assert api.get("/v1/sessions/nobody-here").status_code == 404
