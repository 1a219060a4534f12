"""The fleet harness itself (tests/cluster/fleet_env.py): three real daemons in three host
namespaces on real etcd; a sandbox created through h1 (placement may put it anywhere) runs
code through every host, in a real VM."""

from __future__ import annotations

from tests.cluster.fleet_env import Fleet


def test_a_sandbox_created_through_one_host_runs_code_through_every_host(
        fleet: Fleet) -> None:
    r = fleet.client("h1").post("/v1/sandboxes", json={"template": "python"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    owner = fleet.owner(sid)
    print(f"\n[fleet] created through h1, placed on {owner.name}")
    for host in fleet.hosts:
        r = fleet.client(host).post(f"/v1/sandboxes/{sid}/execute",
                                    json={"code": f"print('hi {host.name}')"})
        assert r.status_code == 200, (host.name, r.text)
        assert r.json()["stdout"] == f"hi {host.name}\n", r.json()
        assert fleet.client(host).get(f"/v1/sandboxes/{sid}").json()["id"] == sid
    assert fleet.client("h2").delete(f"/v1/sandboxes/{sid}").status_code == 204
