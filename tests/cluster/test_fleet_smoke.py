"""The fleet harness itself (tests/cluster/fleet_env.py): three real daemons in three host
namespaces on real etcd; a sandbox created through h1 (placement may put it anywhere) runs
code through every host, in a real VM. Its owner's daemon is then restarted (SIGTERM: the
VMM lives on and is adopted again) and its console is still read, through another host."""

from __future__ import annotations

import secrets

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

    # The owner's daemon restarts; its VMM (and the guest's state) is adopted again.
    via = next(h for h in fleet.hosts if h is not owner)
    api = fleet.client(via)
    vmms = fleet.vmm_pids(owner)
    fleet.stop(owner)
    took = fleet.restart(owner)
    assert fleet.vmm_pids(owner) == vmms
    fleet.wait_for(lambda: api.get(f"/v1/sandboxes/{sid}").status_code == 200, 30,
                   "the restarted owner is served through another host")
    marker = "fleet-console-" + secrets.token_hex(4)
    r = api.post(f"/v1/sandboxes/{sid}/execute",
                 json={"command": f"echo {marker} > /dev/console"})
    assert r.status_code == 200, r.text
    fleet.wait_for(lambda: any(marker in line for line in api.get(
        f"/v1/sandboxes/{sid}/logs", params={"tail": 50}).json()["console"]), 10,
        "the adopted VMM's console is read", every=0.2)
    print(f"[fleet] owner restarted in {took:.2f} s, VMM {vmms} adopted, console read")
    assert fleet.client("h2").delete(f"/v1/sandboxes/{sid}").status_code == 204
