"""The fleet end to end (issue 23): three real daemons in three host namespaces, real etcd,
real SeaweedFS, real TCG VMs (tests/cluster/fleet_env.py). Every request goes to a host
that does not own the sandbox unless it says otherwise; the owner is chosen by creating
on it (``Fleet.create_on``). Measured seconds are printed (``pytest -s``), bounds asserted
generously: this machine is shared with other suites' VMs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import aiohttp

from tests.cluster.fleet_env import Fleet, NsClient

TTL = 2  # the fleet's lease_ttl


def execute(client: NsClient, sid: str, command: str, timeout: float = 120) -> dict[str, Any]:
    r = client.post(f"/v1/sandboxes/{sid}/execute", json={"command": command},
                    timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def error_code(r: Any) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def until_status(client: NsClient, path: str, status: int, code: str | None,
                 timeout: float, what: str, request_timeout: float = 10) -> float:
    """Seconds until GET ``path`` answers ``status`` (and error ``code``). Every change of
    answer on the way is printed with its time."""
    begin = time.monotonic()
    last: Any = None
    while time.monotonic() - begin < timeout:
        try:
            r = client.get(path, timeout=request_timeout)
            seen: Any = (r.status_code, error_code(r))
            if r.status_code == status and (code is None or error_code(r) == code):
                return time.monotonic() - begin
        except Exception as exc:  # the host may be down or restarting
            seen = type(exc).__name__
        if seen != last:
            print(f"  [{what}] {time.monotonic() - begin:6.2f} s: {seen}")
            last = seen
        time.sleep(0.05)
    raise AssertionError(f"{what}: no {status} {code or ''} within {timeout} s; last {last}")


# --- using a sandbox through a host that does not own it ---------------------------------

async def _terminal(url: str, key: str) -> bytes:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, headers={"Authorization": f"Bearer {key}"},
                                   max_msg_size=0) as ws:
            await ws.send_bytes(b"echo $((6 * 7))-terminal\r")
            buf = b""
            async with asyncio.timeout(60):
                while b"42-terminal\r\n" not in buf:
                    msg = await ws.receive()
                    assert msg.type is aiohttp.WSMsgType.BINARY, (msg, buf[-300:])
                    buf += msg.data
            await ws.send_bytes(b"exit 3\r")
            async with asyncio.timeout(30):
                msg = await ws.receive()
                while msg.type is aiohttp.WSMsgType.BINARY:
                    msg = await ws.receive()
            assert json.loads(msg.data) == {"type": "exit", "exit_code": 3}
            return buf


def test_exec_files_preview_and_terminal_through_non_owners(fleet: Fleet) -> None:
    owner, via, other = fleet.hosts
    sid = fleet.create_on(owner)
    far = fleet.create_on(other)
    api = fleet.client(via)

    # The list through the third host is the fleet's: both, oldest first, paged across.
    page = api.get("/v1/sandboxes").json()
    assert [s["id"] for s in page["sandboxes"]] == [sid, far] and "partial" not in page
    first = api.get("/v1/sandboxes", params={"limit": 1}).json()
    second = api.get("/v1/sandboxes", params={"limit": 1, "cursor": first["next_cursor"]})
    assert [s["id"] for s in first["sandboxes"] + second.json()["sandboxes"]] == [sid, far]
    assert second.json()["next_cursor"] is None
    assert fleet.client(other).delete(f"/v1/sandboxes/{far}").status_code == 204

    assert execute(api, sid, "echo $((6 * 7))")["stdout"] == "42\n"
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/blob"}, content=payload)
    assert r.status_code == 201, r.text
    r = fleet.client(other).get(f"/v1/sandboxes/{sid}/files/root/blob")
    assert r.status_code == 200 and r.content == payload

    # A preview URL, through the third host (the owner authenticates the token).
    token = api.get(f"/v1/sandboxes/{sid}/preview").json()["preview_token"]
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={
        "command": "cd /root && echo hello-fleet > index.txt && python3 -m http.server 8000",
        "background": True})
    assert r.status_code == 201, r.text
    web = fleet.client(other, key="")
    headers = {"Host": f"8000-{sid}.localhost", "X-AgentBox-Token": token}
    fleet.wait_for(lambda: web.get("/index.txt", headers=headers).status_code != 502, 60,
                   "the guest's http server listens", every=0.3)
    r = web.get("/index.txt", headers=headers)
    assert (r.status_code, r.text) == (200, "hello-fleet\n"), r.text
    r = web.get("/index.txt", headers={"Host": headers["Host"]})
    assert r.status_code == 401  # private by default, on every host

    # The terminal WebSocket, spliced through a non-owner.
    url = f"ws://{other.address}/v1/sandboxes/{sid}/terminal"
    assert b"42-terminal" in fleet.loop.run(_terminal(url, fleet.admin_key), timeout=120)
    assert fleet.client(other).delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert until_status(api, f"/v1/sandboxes/{sid}", 404, "sandbox_not_found", 10,
                        "deleted everywhere") < 10


# --- the owner's processes SIGKILLed, then restarted --------------------------------------

def test_a_killed_owner_is_unavailable_then_serves_its_sandboxes_after_a_restart(
        fleet: Fleet) -> None:
    owner, via, other = fleet.hosts
    running, suspended = fleet.create_on(owner), fleet.create_on(owner)
    api = fleet.client(via)
    for sid in (running, suspended):
        execute(api, sid, f"echo {sid} > /root/mark && sync")
    r = api.post(f"/v1/sandboxes/{suspended}/suspend")
    assert r.status_code == 200, r.text
    fleet.wait_for(lambda: fleet.record(suspended).state.value == "suspended", 30,
                   "the suspend reaches the record")

    vmms = fleet.kill(owner)
    killed = time.monotonic()
    assert vmms, "the owner had VMMs to kill"
    took = until_status(api, f"/v1/sandboxes/{running}", 503, "owner_unavailable",
                        3 * TTL + 15, "non-owner after the owner died")
    r = fleet.client(other).get(f"/v1/sandboxes/{suspended}")
    assert (r.status_code, error_code(r)) == (503, "owner_unavailable"), r.text
    # Its sandboxes are missing from the fleet's list, which says so (the dead host is
    # named whether its record is still there, refusing connections, or already gone).
    page = api.get("/v1/sandboxes").json()
    assert (page["sandboxes"], page.get("partial")) == ([], [owner.name]), page
    gone = fleet.wait_for(lambda: not fleet.host_record(owner), 3 * TTL + 15,
                          "the owner's record expires")
    r = api.get(f"/v1/sandboxes/{running}")
    assert (r.status_code, error_code(r)) == (503, "owner_unavailable"), r.text
    print(f"\n[fleet] owner SIGKILLed (daemon + {len(vmms)} VMMs): others answer "
          f"owner_unavailable after {took:.2f} s (connection refused), its record "
          f"expired after {gone:.2f} s (TTL {TTL})")

    restarted = fleet.restart(owner)
    print(f"[fleet] owner restarted: answering after {restarted:.2f} s "
          f"({time.monotonic() - killed:.2f} s after the kill)")
    took = until_status(api, f"/v1/sandboxes/{suspended}", 200, None, 30,
                        "the restarted owner serves through a non-owner")
    begin = time.monotonic()
    assert execute(api, suspended, "cat /root/mark")["stdout"] == f"{suspended}\n"
    print(f"[fleet] suspended sandbox: served {took:.2f} s after the restart answered, "
          f"woke and ran in {time.monotonic() - begin:.2f} s")

    state = api.get(f"/v1/sandboxes/{running}").json()["state"]
    outcomes = []
    begin = time.monotonic()
    for _ in range(3):  # a crashed VM answers sandbox_crashed once, then cold boots
        r = api.post(f"/v1/sandboxes/{running}/execute", json={"command": "cat /root/mark"})
        outcomes.append((r.status_code, error_code(r) or r.json().get("stdout")))
        if r.status_code == 200:
            break
    print(f"[fleet] running sandbox after the restart: state {state!r}; execs: {outcomes} "
          f"in {time.monotonic() - begin:.2f} s")
    assert outcomes[-1][0] == 200, outcomes
    assert outcomes[-1][1] == f"{running}\n"  # its disk survived the kill (synced)


# --- the owner's link cut, then back ------------------------------------------------------

def test_a_cut_owner_is_fenced_others_say_unavailable_and_it_serves_again(
        fleet: Fleet) -> None:
    owner, via, _ = fleet.hosts
    sid = fleet.create_on(owner)
    api, own = fleet.client(via), fleet.client(owner, inside=True)
    path = f"/v1/sandboxes/{sid}"
    execute(api, sid, "true")

    fleet.link(owner, up=False)
    try:
        fenced = until_status(own, path, 503, "host_fenced", 3 * TTL + 10, "owner fences")
        unavailable = until_status(api, path, 503, "owner_unavailable", 3 * TTL + 15,
                                   "others see the owner gone")
        print(f"\n[fleet] owner cut: it answers host_fenced {fenced:.2f} s after the cut, "
              f"others owner_unavailable {fenced + unavailable:.2f} s after the cut")
    finally:
        fleet.link(owner, up=True)
    back = until_status(api, path, 200, None, 8 * TTL + 20, "served again after the link")
    assert execute(api, sid, "echo back")["stdout"] == "back\n"
    assert own.get(path).status_code == 200
    print(f"[fleet] link back: served through a non-owner after {back:.2f} s")


# --- the etcd leader dies while requests stream through a non-owner ----------------------

def test_requests_through_a_non_owner_survive_the_etcd_leader_dying(fleet: Fleet) -> None:
    owner, via, _ = fleet.hosts
    sid = fleet.create_on(owner)
    api = fleet.client(via)
    execute(api, sid, "rm -f /root/requests")
    results: list[tuple[int, float, int, str | None]] = []  # (n, sent at, status, code)
    stop = threading.Event()

    def stream() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            sent = time.monotonic()
            try:
                r = api.post(f"/v1/sandboxes/{sid}/execute",
                             json={"command": f"echo {n} >> /root/requests"}, timeout=30)
                results.append((n, sent, r.status_code, error_code(r)))
            except Exception as exc:  # counted: an unknown outcome
                results.append((n, sent, 0, type(exc).__name__))

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        time.sleep(2)
        leader = fleet.etcd.wait_leader()
        fleet.etcd.kill(leader)
        killed = time.monotonic()
        print(f"\n[fleet] killed etcd leader {leader.name} "
              f"(in {next(h.name for h in fleet.hosts if h.member is leader)}'s namespace)")
        time.sleep(12)
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()

    after = [(n, t - killed, s, c) for n, t, s, c in results if t >= killed]
    failed = [x for x in after if x[2] != 200]
    last_failure = max((t for _, t, _, _ in failed), default=0.0)
    ok_before = sum(1 for _, t, s, _ in results if t < killed and s == 200)
    sent_ok = [t for _, t, s, _ in results if s == 200]
    gap = max(b - a for a, b in zip(sent_ok, sent_ok[1:], strict=False))
    print(f"[fleet] {len(results)} requests ({ok_before} ok before the kill); after it "
          f"{len(failed)} failed {sorted({(s, c) for _, _, s, c in failed})}, "
          f"the last sent {last_failure:.2f} s after the kill; longest gap between two "
          f"successful requests {gap:.2f} s")
    assert results and results[-1][2] == 200, results[-5:]
    assert last_failure < 10, failed  # then every request succeeded again

    lines = execute(api, sid, "cat /root/requests")["stdout"].split()
    counts = {int(x): lines.count(x) for x in set(lines)}
    assert all(c == 1 for c in counts.values()), "a request ran twice"
    ok = {n for n, _, s, _ in results if s == 200}
    assert ok <= set(counts), f"answered 200 but never ran: {ok - set(counts)}"
    refused = {n for n, _, s, c in results if s == 503 and c in ("host_fenced",
                                                                   "owner_unavailable")}
    assert not refused & set(counts), "a request refused with 503 ran anyway"
    ran_unanswered = set(counts) - ok
    print(f"[fleet] every one of {len(ok)} successful requests ran exactly once; "
          f"{len(ran_unanswered)} ran without a 200 answer")
    assert set(counts) <= {n for n, *_ in results}
