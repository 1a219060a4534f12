"""Keys, quotas and tenant scoping through the real app's middlewares and handlers, with
a SandboxService whose controllers are fakes (registry transitions only; no VMs)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from gateway.http import sandbox_routes, key_routes
from gateway.config import Config, ServerConfig
from gateway.sandbox.controller import Wake
from gateway.sandbox.states import Event, State
from gateway.http.middleware import REGISTRY_KEY, api_error_middleware, auth_middleware
from gateway.tenancy.quotas import TenancyConfig
from gateway.http.ratelimit import LIMITER_KEY, RateLimiter, key_rate_middleware
from gateway.store.registry import Registry, SandboxRecord
from gateway.sandbox.service import SandboxService
from vmctl.network import NetworkConfig


class FakeController:
    """The controller surface SandboxService uses; a wake is two registry transitions."""

    def __init__(self, rec: SandboxRecord, registry: Registry) -> None:
        self.rec, self.registry, self.machine = rec, registry, SimpleNamespace()
        self.wakes = 0

    @property
    def state(self) -> State:
        return self.registry.get(self.rec.id).state

    @property
    def record(self) -> SandboxRecord:
        return self.rec

    @property
    def is_idle_paused(self) -> bool:  # a fake never pauses
        return False

    def refresh_record(self) -> SandboxRecord:
        self.rec = self.registry.get(self.rec.id) or self.rec
        return self.rec

    async def create(self) -> None:
        self.rec = self.registry.transition(self.rec.id, Event.CREATED)

    async def destroy(self, cause: str) -> None:
        self.rec = self.registry.transition(self.rec.id, Event.DESTROY, cause)

    def close(self) -> None:
        pass

    @contextlib.asynccontextmanager
    async def request(self):
        if self.state is State.SUSPENDED:
            self.registry.transition(self.rec.id, Event.WAKE)
            self.rec = self.registry.transition(self.rec.id, Event.RESTORED)
            self.wakes += 1
        yield Wake(False, 0.0)


class FakeService(SandboxService):
    def controller(self, rec: SandboxRecord) -> FakeController:  # type: ignore[override]
        ctl = self._controllers.get(rec.id)
        if ctl is None:
            ctl = self._controllers[rec.id] = FakeController(rec, self.registry)  # type: ignore
        return ctl  # type: ignore[return-value]


def fake_host(tmp_path) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A "python" golden and a backend with only what the service reads (no VMs)."""
    golden = SimpleNamespace(template="python", dir=tmp_path / "golden", mem_mib=256,
                             vcpus=1, disk_mib=1024)
    backend = SimpleNamespace(config=SimpleNamespace(network=NetworkConfig(
        pool="169.254.64.0/18")), driver_name="qemu", accel=SimpleNamespace(value="tcg"),
        reason="test")
    return golden, backend


@pytest.fixture
async def env(tmp_path, aiohttp_client):
    config = Config(server=ServerConfig(data_dir=tmp_path), tenancy=TenancyConfig(
        max_sandboxes=3, max_awake=2, max_disk_mib=0, rate=0, address_rate=0))
    registry = Registry(tmp_path / "r.sqlite")
    golden, backend = fake_host(tmp_path)
    service = FakeService(config, registry, backend, {"python": golden})  # type: ignore[arg-type]
    app = web.Application(middlewares=[api_error_middleware, auth_middleware,
                                       key_rate_middleware])
    app[REGISTRY_KEY] = registry
    app[sandbox_routes.SERVICE_KEY] = service
    app[key_routes.TENANCY_KEY] = config.tenancy
    app[LIMITER_KEY] = RateLimiter(config.tenancy)
    app.add_routes(sandbox_routes.routes)
    app.add_routes(key_routes.routes)
    _, admin = registry.create_key("admin", admin=True)
    client = await aiohttp_client(app)
    yield SimpleNamespace(client=client, registry=registry, service=service,
                          admin={"Authorization": f"Bearer {admin}"})
    registry.close()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def new_key(env, **body) -> tuple[str, dict[str, str]]:
    resp = await env.client.post("/v1/keys", json={"name": "t", **body}, headers=env.admin)
    assert resp.status == 201, await resp.text()
    data = await resp.json()
    return data["id"], bearer(data["key"])


@pytest.mark.parametrize("admin", ["false", "true", 0, 1, None, [], {}])
async def test_admin_must_be_a_json_boolean(env, admin):
    resp = await env.client.post("/v1/keys", json={"name": "x", "admin": admin},
                                 headers=env.admin)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_type"
    assert [k.name for k in env.registry.list_keys()] == ["admin"]  # nothing was minted


async def test_admin_false_mints_a_key_that_cannot_mint_keys(env):
    _, auth = await new_key(env, admin=False)
    resp = await env.client.post("/v1/keys", json={"name": "y"}, headers=auth)
    assert resp.status == 403


@pytest.mark.parametrize("body", [{"name": 5}, {"name": ""}, {}, {"name": "x", "colour": 1},
                                  {"name": "x", "limits": {"max_sandboxes": "1"}}, ["x"]])
async def test_bad_key_bodies_are_400(env, body):
    resp = await env.client.post("/v1/keys", json=body, headers=env.admin)
    assert resp.status == 400, await resp.text()


async def test_max_sandboxes_from_the_key_then_from_patch(env):
    key_id, auth = await new_key(env, limits={"max_sandboxes": 1})
    assert (await env.client.post("/v1/sandboxes", json={}, headers=auth)).status == 201
    resp = await env.client.post("/v1/sandboxes", json={}, headers=auth)
    assert resp.status == 409
    err = (await resp.json())["error"]
    assert err["code"] == "quota_exceeded" and "max_sandboxes=1" in err["message"]
    # The admin's own sandboxes are not counted against the tenant.
    assert (await env.client.post("/v1/sandboxes", json={}, headers=env.admin)).status == 201
    resp = await env.client.patch(f"/v1/keys/{key_id}", json={"limits": {"max_sandboxes": 2}},
                                  headers=env.admin)
    view = await resp.json()
    assert view["limits"]["max_sandboxes"] == 2 and view["overrides"] == {"max_sandboxes": 2}
    assert (await env.client.post("/v1/sandboxes", json={}, headers=auth)).status == 201
    resp = await env.client.patch(f"/v1/keys/{key_id}", json={"limits": {"max_sandboxes": None}},
                                  headers=env.admin)
    assert (await resp.json())["limits"]["max_sandboxes"] == 3  # the config default


async def test_a_wake_beyond_max_awake_is_refused_and_the_sandbox_stays_asleep(env):
    _, auth = await new_key(env)  # config default max_awake=2
    ids = []
    for _ in range(2):
        ids.append((await (await env.client.post("/v1/sandboxes", json={},
                                                 headers=auth)).json())["id"])
    resp = await env.client.post("/v1/sandboxes", json={}, headers=auth)
    assert resp.status == 409 and "max_awake=2" in (await resp.json())["error"]["message"]
    env.registry.transition(ids[0], Event.SUSPEND)
    env.registry.transition(ids[0], Event.SUSPENDED)
    third = (await (await env.client.post("/v1/sandboxes", json={}, headers=auth)).json())["id"]
    resp = await env.client.post(f"/v1/sandboxes/{ids[0]}/resume", headers=auth)
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "quota_exceeded"
    assert env.registry.get(ids[0]).state is State.SUSPENDED
    await env.client.delete(f"/v1/sandboxes/{third}", headers=auth)
    resp = await env.client.post(f"/v1/sandboxes/{ids[0]}/resume", headers=auth)
    assert resp.status == 200 and (await resp.json())["state"] == "running"


async def test_max_disk_counts_the_tenants_sandbox_dirs(env, tmp_path):
    _, auth = await new_key(env, limits={"max_disk_mib": 1})
    rec = await (await env.client.post("/v1/sandboxes", json={}, headers=auth)).json()
    assert (await env.client.post("/v1/sandboxes", json={}, headers=auth)).status == 201
    root = Path(env.registry.get(rec["id"]).root)
    root.mkdir(parents=True)
    (root / "disk.qcow2").write_bytes(b"x" * (1 << 20))
    resp = await env.client.post("/v1/sandboxes", json={}, headers=auth)
    assert resp.status == 409 and "max_disk_mib=1" in (await resp.json())["error"]["message"]


async def test_revoked_key_is_401_and_admin_lists_and_deletes_its_sandboxes(env):
    key_id, auth = await new_key(env)
    sid = (await (await env.client.post("/v1/sandboxes", json={}, headers=auth)).json())["id"]
    _, other = await new_key(env)
    assert (await env.client.delete(f"/v1/keys/{key_id}", headers=env.admin)).status == 204
    resp = await env.client.get("/v1/sandboxes", headers=auth)
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    # Another tenant can neither list the revoked key's sandboxes nor touch them.
    assert (await env.client.get(f"/v1/sandboxes?tenant={key_id}", headers=other)).status == 403
    assert (await env.client.get(f"/v1/sandboxes/{sid}", headers=other)).status == 404
    assert (await env.client.delete(f"/v1/sandboxes/{sid}", headers=other)).status == 404
    # Without ?tenant= an admin sees only its own; with it, the revoked key's.
    listed = await (await env.client.get("/v1/sandboxes", headers=env.admin)).json()
    assert sid not in [s["id"] for s in listed["sandboxes"]]
    listed = await (await env.client.get(f"/v1/sandboxes?tenant={key_id}",
                                         headers=env.admin)).json()
    assert [s["id"] for s in listed["sandboxes"]] == [sid]
    resp = await env.client.delete(f"/v1/sandboxes/{sid}?tenant={key_id}", headers=env.admin)
    assert resp.status == 204
    assert env.registry.get(sid).state is State.DESTROYED
    keys = await (await env.client.get("/v1/keys?revoked=1", headers=env.admin)).json()
    assert {k["id"]: k["revoked"] for k in keys["keys"]}[key_id] is True


async def test_key_management_is_admin_only(env):
    key_id, auth = await new_key(env)
    assert (await env.client.get("/v1/keys", headers=auth)).status == 403
    resp = await env.client.patch(f"/v1/keys/{key_id}", json={"limits": {"max_sandboxes": 0}},
                                  headers=auth)
    assert resp.status == 403
    assert (await env.client.delete(f"/v1/keys/{key_id}", headers=auth)).status == 403
    resp = await env.client.delete("/v1/keys/key_nope", headers=env.admin)
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "key_not_found"


async def test_a_keys_rate_override_applies_at_once(env):
    key_id, auth = await new_key(env, limits={"rate": 0.001, "burst": 2})
    statuses = [(await env.client.get("/v1/sandboxes", headers=auth)).status for _ in range(3)]
    assert statuses == [200, 200, 429]
    await env.client.patch(f"/v1/keys/{key_id}", json={"limits": {"rate": 0}},
                           headers=env.admin)
    assert (await env.client.get("/v1/sandboxes", headers=auth)).status == 200
