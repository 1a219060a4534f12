"""Drain with real daemons (tests/cluster/fleet_env.py): ``agentbox-server drain h0`` moves
h0's running sandbox to another host by live migration and its suspended (shipped) sandbox
by its record (the other host adopts it from the object store), while a client keeps asking
both through another host; none is lost, each request ran once, the guests' processes and
files survive, the records moved by CAS (gen + 1), h0 keeps no VMM nor the suspended one's
files, and placement skips h0 from then on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from tests.cluster.fleet_env import REPO, Fleet


def run(fleet: Fleet, host: str, sid: str, code: str) -> str:
    r = fleet.client(host).post(f"/v1/sandboxes/{sid}/execute",
                                json={"command": code, "timeout": 60})
    assert r.status_code == 200, (host, r.status_code, r.text)
    assert r.json()["exit_code"] == 0, r.json()
    return str(r.json()["stdout"])


def test_drain_moves_a_running_and_a_suspended_sandbox_and_loses_no_request(
        fleet: Fleet) -> None:
    h0 = fleet.host("h0")
    sid = fleet.create_on(h0)
    pid = run(fleet, "h0", sid, "setsid python3 -c 'import time\nn=0\nwhile True:\n"
                                " n+=1; open(\"/root/n\",\"w\").write(str(n)); time.sleep(0.05)'"
                                " >/dev/null 2>&1 & echo $!").strip()
    digest = run(fleet, "h0", sid, "head -c 2097152 /dev/urandom > /root/f && sync && "
                                   "sha256sum /root/f").split()[0]
    before = fleet.record(sid)

    # The suspended one: a file and a process, suspended on h0, its snapshot shipped.
    sus = fleet.create_on(h0)
    on_h0 = fleet.client(h0)
    payload = os.urandom(1 << 20)
    assert on_h0.put(f"/v1/sandboxes/{sus}/files", params={"path": "/root/blob.bin"},
                     content=payload).status_code == 201
    sus_pid = run(fleet, "h0", sus, "setsid sleep 99999 >/dev/null 2>&1 & echo $!").strip()
    r = on_h0.post(f"/v1/sandboxes/{sus}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
    shipped: list = []
    took_ship = fleet.wait_for(lambda: bool(shipped.append(fleet.record(sus))
                                            or shipped[-1].snapshot), 180, "snapshot shipped")
    sus_before = shipped[-1]
    assert sus_before.host == "h0" and sus_before.state.value == "suspended"
    sus_root = h0.data_dir / "sandboxes" / sus
    assert (sus_root / "snapshot" / "manifest.json").is_file()

    # A client asking both through h1 all along (never straight to their owner): the
    # running one executes (each request appends its number in the guest), the suspended
    # one is read (not woken). A 503 owner_unavailable (the new owner still adopting; the
    # request was not served) is asked again after its Retry-After.
    answers: list[tuple[float, int, str]] = []
    sus_answers: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def ask() -> None:
        client = fleet.client("h1", timeout=120)
        n = 0
        while not stop.is_set():
            n += 1
            r = client.post(f"/v1/sandboxes/{sid}/execute",
                            json={"command": f"echo {n} >> /root/seq && echo ok"})
            answers.append((time.monotonic(), r.status_code, f"{n} {r.text[:200]}"))
            r = client.get(f"/v1/sandboxes/{sus}")
            sus_answers.append((time.monotonic(), r.status_code, r.text[:300]))
            if r.status_code == 503:
                time.sleep(min(1.0, float(r.headers.get("Retry-After", "1"))))
    asker = threading.Thread(target=ask)
    asker.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        cli = subprocess.run(
            ["nsenter", f"--net=/var/run/netns/{fleet.etcd.switch}", "--", sys.executable,
             "-m", "gateway.cli", "drain", "h0", "--config", str(h0.config_path),
             "--wait", "300"], cwd=REPO, capture_output=True, text=True, timeout=400)
        took = time.monotonic() - started
        assert cli.returncode == 0, (cli.stdout, cli.stderr, fleet.logs())
        assert "empty: 1 running and 1 suspended" in cli.stdout, cli.stdout
        # the new owner adopts the suspended one: read through h1, it answers from there
        fleet.wait_for(lambda: bool(sus_answers) and sus_answers[-1][1] == 200
                       and time.monotonic() - sus_answers[-1][0] < 1, 120,
                       "the suspended sandbox answers through h1 again")
        time.sleep(1.0)
    finally:
        stop.set()
        asker.join(timeout=180)

    after = fleet.record(sid)
    assert after.host != "h0" and after.gen == before.gen + 1, (before, after)
    failed = [a for a in answers if a[1] != 200]
    assert not failed, failed[:5]
    gaps = [b[0] - a[0] for a, b in zip(answers, answers[1:], strict=False)]
    # Each execute answered 200 ran exactly once in the guest (and nothing else ran).
    ran = run(fleet, after.host, sid, "cat /root/seq").split()
    assert sorted(ran, key=int) == [a[2].split()[0] for a in answers], (ran, len(answers))

    sus_after = fleet.record(sus)
    assert sus_after.host not in ("h0", "") and sus_after.gen == sus_before.gen + 1, sus_after
    assert sus_after.state.value == "suspended" and sus_after.snapshot == sus_before.snapshot
    refused = [a for a in sus_answers if a[1] != 200]
    assert all(a[1] == 503 and "owner_unavailable" in a[2] for a in refused), refused[:5]
    assert all('"suspended"' in a[2] for a in sus_answers if a[1] == 200)
    print(f"\n[drain] h0 -> {after.host} (running), -> {sus_after.host} (suspended, shipped "
          f"in {took_ship:.1f} s): CLI returned after {took:.1f} s; {len(answers)} executes "
          f"through h1, none failed, longest gap between answers {max(gaps) * 1000:.0f} ms; "
          f"{len(sus_answers)} reads of the suspended one, {len(refused)} answered 503 "
          "owner_unavailable while it was adopted (then asked again)")

    # The same guests: the running one's process still counts, its file is whole; the
    # suspended one wakes on its new host with its process and file; h0 keeps nothing.
    assert run(fleet, "h2", sid, f"kill -0 {pid} && echo alive").strip() == "alive"
    assert run(fleet, "h0", sid, "sha256sum /root/f").split()[0] == digest
    n1 = int(run(fleet, after.host, sid, "cat /root/n"))
    time.sleep(0.5)
    assert int(run(fleet, after.host, sid, "cat /root/n")) > n1
    import hashlib
    fleet.wait_for(lambda: fleet.client("h1").get(f"/v1/sandboxes/{sus}").status_code == 200,
                   120, f"{sus_after.host} adopted {sus}")
    woke = run(fleet, "h1", sus, f"kill -0 {sus_pid} && echo alive; sha256sum /root/blob.bin")
    assert woke.split()[0] == "alive", woke
    assert woke.split()[1] == hashlib.sha256(payload).hexdigest(), woke
    assert fleet.owner(sus).name == sus_after.host
    assert fleet.vmm_pids(h0) == [] and not sus_root.exists()

    # Placement skips a draining host: a create through h0 lands elsewhere, or (no other
    # host has room by its published load: 2 cores here) is refused, never made on h0.
    r = fleet.client("h0").post("/v1/sandboxes", json={"template": "python"})
    assert r.status_code in (201, 503), r.text
    if r.status_code == 201:
        assert fleet.owner(r.json()["id"]).name != "h0"
        assert fleet.client("h0").delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204
    subprocess.run(["nsenter", f"--net=/var/run/netns/{fleet.etcd.switch}", "--",
                    sys.executable, "-m", "gateway.cli", "drain", "h0", "--undo", "--config",
                    str(h0.config_path)], cwd=REPO, check=True, capture_output=True, timeout=60)
    for gone in (sid, sus):
        assert fleet.client("h1").delete(f"/v1/sandboxes/{gone}").status_code == 204


def test_a_destination_that_dies_mid_move_leaves_the_sandbox_running_and_the_drain_goes_on(
        fleet: Fleet) -> None:
    """The destination host loses power while the sandbox streams to it: the sandbox runs
    on at h0 (held requests admitted, none lost), the next pass moves it to the surviving
    host, and the dead host's half-made arrival is gone once it restarts."""
    from gateway.cluster import drain
    from gateway.cluster.etcd import EtcdClient
    from gateway.cluster.keys import Keys

    h0 = fleet.host("h0")
    sid = fleet.create_on(h0)
    pid = run(fleet, "h0", sid, "setsid sleep 100000 >/dev/null 2>&1 & echo $!").strip()
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def ask() -> None:  # straight to h0: forwarded once the sandbox has moved
        client = fleet.client("h0", timeout=120)
        while not stop.is_set():
            r = client.post(f"/v1/sandboxes/{sid}/execute", json={"command": "echo ok"})
            answers.append((r.status_code, r.text[:200]))
    asker = threading.Thread(target=ask)
    asker.start()

    async def mark(on: bool) -> None:
        client = EtcdClient(fleet.etcd.endpoints)
        try:
            await drain.mark(client, Keys(f"/{fleet.prefix}"), "h0", draining=on)
        finally:
            await client.aclose()
    victim: list = []
    try:
        fleet.loop.run(mark(True), timeout=30)

        def incoming() -> bool:
            victim.extend(h for h in fleet.hosts[1:] if fleet.vmm_pids(h))
            return bool(victim)
        fleet.wait_for(incoming, 120, "an arrival's VMM on h1 or h2", every=0.01)
        dead = victim[0]
        killed = fleet.kill(dead)
        survivor = next(h for h in fleet.hosts[1:] if h is not dead)
        fleet.wait_for(lambda: fleet.record(sid).host == survivor.name, 180,
                       f"{sid} moved to {survivor.name}")
        time.sleep(1.0)
    finally:
        stop.set()
        asker.join(timeout=180)
        if victim and not victim[0].alive():  # whatever failed: it comes back (clean-up)
            fleet.restart(victim[0])
    print(f"\n[drain] {dead.name} killed mid-move (VMMs {killed}); moved to "
          f"{survivor.name}; {len(answers)} requests to h0")
    assert killed, "the arrival's VMM was not running when its host died"
    failed = [a for a in answers if a[0] != 200]
    assert not failed, failed[:5]
    assert run(fleet, survivor.name, sid, f"kill -0 {pid} && echo alive").strip() == "alive"
    assert fleet.vmm_pids(h0) == []

    # The dead host came back: its half-made arrival is discarded, no VMM or namespace left.
    assert fleet.vmm_pids(dead) == []
    r = fleet.client(dead).get(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200 and r.json()["id"] == sid  # forwarded to the survivor
    fleet.loop.run(mark(False), timeout=30)
    assert fleet.client("h0").delete(f"/v1/sandboxes/{sid}").status_code == 204
