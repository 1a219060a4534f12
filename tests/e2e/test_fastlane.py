"""The preview fast lane (gateway/preview/fastlane/) in the real daemon,
 to an app in a real microVM:
requests on a connection that never needed aiohttp are answered by the fast lane (counted in
/metrics), with the same bodies; a connection's first refused request hands it to aiohttp."""

from __future__ import annotations

import hashlib
import os
import re

import httpx
import pytest

from tests.e2e.test_preview import host_for, preview_token, start_app, wait_listening

pytestmark = pytest.mark.e2e


def events(api, name: str) -> int:
    r = api.get("/metrics")
    assert r.status_code == 200, r.text
    m = re.search(rf'agentbox_events_total{{event="{name}"}} (\d+)', r.text)
    return int(m.group(1)) if m else 0


def test_requests_to_a_running_app_take_the_fast_lane(api, sandbox, daemon):
    sid = sandbox["id"]
    token = preview_token(api, sid)
    start_app(api, sid)
    with httpx.Client(base_url=daemon.url, timeout=120) as warmup:  # 502s until it listens
        assert wait_listening(warmup, sid, 8000, token, "/count").status_code == 200
    served, handed = events(api, "fast_lane_served"), events(api, "fast_lane_handed_off")
    auth = {"Host": host_for(sid, 8000), "X-AgentBox-Token": token}
    body = os.urandom(5 << 20)
    with httpx.Client(base_url=daemon.url, timeout=120) as web:  # one keep-alive connection
        counts = [web.get("/count", headers=auth).json()["count"] for _ in range(20)]
        assert counts == sorted(counts) and len(set(counts)) == 20
        r = web.post("/sha", headers=auth, content=body)
        assert r.json() == {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
        r = web.post("/echo", headers=auth, content=body)  # streamed back, no length
        assert r.status_code == 200 and r.content == body
        r = web.get("/chunks", headers=auth)
        assert r.text == "".join(f"chunk {i}\n" for i in range(10))
        seen = web.get("/headers", headers=auth).json()
        assert "X-Agentbox-Token" not in seen and seen["X-Forwarded-Proto"] == "http"
        assert events(api, "fast_lane_served") - served == 24
        assert events(api, "fast_lane_handed_off") == handed
        r = web.get("/count", headers={"Host": host_for(sid, 8000)})  # no token: aiohttp's 401
        assert r.status_code == 401
        assert events(api, "fast_lane_handed_off") == handed + 1
        assert web.get("/count", headers=auth).status_code == 200  # aiohttp's from now on
    assert events(api, "fast_lane_served") - served == 24
