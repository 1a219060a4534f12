"""A session across real daemons (tests/cluster/fleet_env.py, one TCG VM): PUT through h1
(placed anywhere), then its app answers through h2 by its session host and its API path,
another tenant's PUT through h0 is refused, and DELETE through h2 frees the name."""

from __future__ import annotations

import time

from tests.cluster.fleet_env import Fleet

SESSIONS = "sessions.localhost"  # [server] session_domain's default


def test_a_session_put_through_one_host_is_served_through_another(fleet: Fleet) -> None:
    name = "fleet-app"
    r = fleet.client("h1").put(f"/v1/sessions/{name}", json={
        "template": "python", "start": "python3 -m http.server 8000"})
    assert r.status_code == 201, r.text
    session = r.json()
    owner = fleet.owner(session["sandbox_id"])
    print(f"\n[sessions] PUT through h1, made on {owner.name}")
    h2 = fleet.client("h2")
    deadline = time.monotonic() + 90
    while (r := h2.get("/", headers={"Host": f"{name}.{SESSIONS}",
                                     "X-AgentBox-Token": session["preview_token"]})
           ).status_code == 502 and time.monotonic() < deadline:
        time.sleep(0.5)  # the app is still starting in the guest
    assert r.status_code == 200 and "Directory listing" in r.text, r.text[:300]
    r = h2.get(f"/v1/sessions/{name}/proxy/")
    assert r.status_code == 200 and "Directory listing" in r.text, r.text[:300]
    r = h2.put(f"/v1/sessions/{name}", json={"template": "python"})
    assert (r.status_code, r.json()["sandbox_id"]) == (200, session["sandbox_id"]), r.text

    other = fleet.client("h0").post("/v1/keys", json={"name": "other-tenant"})
    assert other.status_code == 201, other.text
    rival = fleet.client("h0", key=other.json()["key"])
    got: list = []
    fleet.wait_for(lambda: got.append(rival.put(f"/v1/sessions/{name}", json={})) or
                   got[-1].status_code != 401, 10, "the new key reaches the session's host")
    r = got[-1]
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_name_taken", r.text

    assert h2.delete(f"/v1/sessions/{name}").status_code == 204
    fleet.wait_for(lambda: fleet.client("h0").get(f"/v1/sessions/{name}").status_code == 404,
                   10, "the name is gone on every host")
