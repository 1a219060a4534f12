"""Tenancy controls against the real daemon and real microVMs: per-key quotas, per-key
rate limits, revocation, and tenant isolation of a revoked key's sandboxes."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import vmm_pids_for

pytestmark = pytest.mark.e2e


def mint(api, **body) -> tuple[str, str]:
    r = api.post("/v1/keys", json={"name": "tenancy-e2e", **body})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def purge(api, key_id: str) -> None:
    """Delete a tenant's sandboxes as the admin (the daemon fixture only cleans its own)."""
    for sb in api.get("/v1/sandboxes", params={"tenant": key_id}).json()["sandboxes"]:
        api.delete(f"/v1/sandboxes/{sb['id']}", params={"tenant": key_id})


def test_admin_false_is_refused_not_an_admin_key(api):
    r = api.post("/v1/keys", json={"name": "x", "admin": "false"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_type"
    assert "x" not in [k["name"] for k in api.get("/v1/keys").json()["keys"]]


def test_max_sandboxes_one_makes_one_real_sandbox_then_refuses(api, daemon):
    key_id, secret = mint(api, limits={"max_sandboxes": 1})
    try:
        with daemon.client(secret) as tenant:
            r = tenant.post("/v1/sandboxes", json={"template": "python"})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            r = tenant.post(f"/v1/sandboxes/{sid}/execute", json={"code": "print(6*7)"})
            assert r.status_code == 200 and r.json()["stdout"] == "42\n", r.text
            assert vmm_pids_for(sid), "the first sandbox has no VMM"
            r = tenant.post("/v1/sandboxes", json={"template": "python"})
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "quota_exceeded"
            assert "max_sandboxes=1" in r.json()["error"]["message"]
            assert [s["id"] for s in tenant.get("/v1/sandboxes").json()["sandboxes"]] == [sid]
            # Deleting it makes room again: the quota counts live sandboxes.
            assert tenant.delete(f"/v1/sandboxes/{sid}").status_code == 204
            r = tenant.post("/v1/sandboxes", json={"template": "python"})
            assert r.status_code == 201, r.text
    finally:
        purge(api, key_id)


def test_a_rate_limited_key_gets_429_after_its_burst_and_recovers(api, daemon):
    key_id, secret = mint(api, limits={"rate": 0.5, "burst": 3})
    with daemon.client(secret) as tenant:
        statuses = [tenant.get("/v1/sandboxes").status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        r = tenant.get("/v1/sandboxes")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limited"
        retry = int(r.headers["Retry-After"])
        assert 1 <= retry <= 2  # one token at 0.5/s
        # Other keys are not slowed down by this one.
        assert api.get("/v1/sandboxes").status_code == 200
        time.sleep(retry + 0.1)
        assert tenant.get("/v1/sandboxes").status_code == 200
        assert tenant.get("/v1/sandboxes").status_code == 429  # just the one token came back


def test_revoked_key_is_401_and_admin_lists_and_deletes_its_sandboxes(api, daemon):
    key_id, secret = mint(api)
    _, other_secret = mint(api)
    try:
        with daemon.client(secret) as tenant, daemon.client(other_secret) as other:
            r = tenant.post("/v1/sandboxes", json={"template": "python"})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            # Another tenant cannot see or touch it, by id or by asking for the tenant.
            assert other.get(f"/v1/sandboxes/{sid}").status_code == 404
            r = other.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
            assert r.status_code == 404
            assert other.delete(f"/v1/sandboxes/{sid}").status_code == 404
            assert other.get("/v1/sandboxes", params={"tenant": key_id}).status_code == 403
            assert other.delete(f"/v1/sandboxes/{sid}",
                                params={"tenant": key_id}).status_code == 403

            assert api.delete(f"/v1/keys/{key_id}").status_code == 204
            r = tenant.get("/v1/sandboxes")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert tenant.post(f"/v1/sandboxes/{sid}/execute",
                               json={"command": "true"}).status_code == 401

        listed = api.get("/v1/sandboxes", params={"tenant": key_id}).json()["sandboxes"]
        assert [s["id"] for s in listed] == [sid]
        assert sid not in [s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]]
        assert vmm_pids_for(sid), "the revoked key's sandbox should still be running"
        r = api.delete(f"/v1/sandboxes/{sid}", params={"tenant": key_id})
        assert r.status_code == 204, r.text
        assert api.get(f"/v1/sandboxes/{sid}", params={"tenant": key_id}).status_code == 404
        deadline = time.monotonic() + 10
        while vmm_pids_for(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not vmm_pids_for(sid), "the deleted sandbox's VMM is still running"
    finally:
        purge(api, key_id)
