"""Per-sandbox egress policies (issue 13) with a real VM, real listeners and a real DNS server.

The test's "internet" is a namespace joined to the host by a veth; it holds every target
address (with a listener on each) and a DNS server that answers the test's names. The daemon
started here forwards its sandboxes' allowed names to that server (``network.dns_upstream``)
and lets policies open the test's private and documentation ranges (``egress_allow``), while
its own default stays ``deny_all``. Every "blocked" below aims at a listener that the host
reaches in the same test (and that the guest reaches once a policy allows it), so a missing
rule fails the test instead of passing on "nothing listens there". One sandbox serves every
test: its policy is changed with PATCH while it runs.

Network rule: traffic goes only to the host's own addresses or into the namespace created
here (every target's route is asserted to go through its veth before anything connects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import running_daemon, start_daemon, stop_daemon
from tests.netprobe import listener, probe, probe_code, parse_probe, sh

pytestmark = pytest.mark.e2e

PORT = 47431
NS = f"abegr{os.getpid()}"
HOST_IF = f"abeg{os.getpid() % 100000}"
HOST_END, NS_END = "203.0.113.33", "203.0.113.34"  # the veth's /30
ALLOWED_IP, OTHER_IP = "10.98.1.10", "10.98.2.10"
DNS_IP = "198.51.100.153"
NAMES = {"ok.egress.test": "198.51.100.110", "bad.egress.test": "198.51.100.120",
         "a.wild.egress.test": "198.51.100.130"}
TARGETS = [ALLOWED_IP, OTHER_IP, DNS_IP, *NAMES.values()]
POOL = "169.254.56.0/21"  # no other test's pool

DNS_SERVER = r"""
import socket, struct, sys, threading
names = dict(a.split("=") for a in sys.argv[2].split(","))
log = sys.argv[1]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[3], 53))  # replies leave from the address asked
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind((sys.argv[3], 53))
t.listen(8)

def answer(data):
    qid, flags = struct.unpack("!HH", data[:4])
    pos, labels = 12, []
    while data[pos]:
        labels.append(data[pos + 1:pos + 1 + data[pos]].decode()); pos += 1 + data[pos]
    name, qtype = ".".join(labels).lower(), struct.unpack("!H", data[pos + 1:pos + 3])[0]
    question = data[12:pos + 5]
    with open(log, "a") as f:
        f.write(f"{name} {qtype}\n")
    addr = names.get(name)
    if addr is None:
        return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
    answers = b""
    if qtype == 1:
        answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton(addr)
    return (struct.pack("!HHHHHH", qid, 0x8180, 1, 1 if answers else 0, 0, 0) + question
            + answers)

def tcp():
    while True:
        c, _ = t.accept()
        with c:
            n = struct.unpack("!H", c.recv(2))[0]
            r = answer(c.recv(n))
            c.sendall(struct.pack("!H", len(r)) + r)

threading.Thread(target=tcp, daemon=True).start()
print("ready", flush=True)
while True:
    data, src = s.recvfrom(512)
    s.sendto(answer(data), src)
"""


def _route_dev(addr: str) -> str:
    return json.loads(sh("ip", "-j", "route", "get", addr))[0].get("dev", "")


@pytest.fixture(scope="module")
def internet(tmp_path_factory):
    log = tmp_path_factory.mktemp("dns") / "queries.log"
    log.touch()
    dns = None
    try:
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", "up0", "netns", NS)
        sh("ip", "addr", "add", f"{HOST_END}/30", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "up")
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        sh("ip", "-n", NS, "addr", "add", f"{NS_END}/30", "dev", "up0")
        for addr in TARGETS:
            sh("ip", "-n", NS, "addr", "add", f"{addr}/32", "dev", "up0")
            sh("ip", "route", "add", f"{addr}/32", "via", NS_END, "dev", HOST_IF)
        sh("ip", "-n", NS, "link", "set", "up0", "up")
        sh("ip", "-n", NS, "route", "add", "default", "via", HOST_END)
        Path(f"/proc/sys/net/ipv4/conf/{HOST_IF}/forwarding").write_text("1")
        for addr in TARGETS:
            assert _route_dev(addr) == HOST_IF, addr  # NETWORK RULE
        dns = subprocess.Popen(
            ["ip", "netns", "exec", NS, sys.executable, "-c", DNS_SERVER, str(log),
             ",".join(f"{k}={v}" for k, v in NAMES.items()), DNS_IP],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert dns.stdout is not None and dns.stdout.readline().strip() == "ready"
        with listener(PORT, "internet", netns=NS):
            got = probe([(a, a, PORT, None) for a in TARGETS])
            assert all(v == "reached:internet" for v in got.values()), got
            yield log
    finally:
        if dns is not None:
            dns.kill()
            dns.wait()
            for pipe in (dns.stdout, dns.stderr):
                if pipe is not None:
                    pipe.close()
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
    assert NS not in sh("ip", "netns", "list")


@pytest.fixture(scope="module")
def egress_daemon(images_built, tmp_path_factory, internet):
    root = tmp_path_factory.mktemp("egress-policy")
    config = root / "agentbox.toml"
    config.write_text(
        '[sandbox]\ntemplates = ["python"]\nidle_timeout = 0\n\n'
        f'[network]\npool = "{POOL}"\nallow_egress = false\n'
        'egress_allow = ["10.98.0.0/16", "198.51.100.0/24"]\n'
        f'dns_upstream = "{DNS_IP}"\n')
    with running_daemon(root / "data", config=config) as d:
        yield d, config


@pytest.fixture(scope="module")
def egress_api(egress_daemon):
    with egress_daemon[0].client() as client:
        yield client


@pytest.fixture(scope="module")
def sid(egress_api):
    r = egress_api.post("/v1/sandboxes", json={"template": "python",
                                               "egress": {"allow": [ALLOWED_IP]}})
    assert r.status_code == 201, r.text
    yield r.json()["id"]
    egress_api.delete(f"/v1/sandboxes/{r.json()['id']}")


def guest(api, sid: str, code: str, timeout: float = 60) -> str:
    r = api.post(f"/v1/sandboxes/{sid}/execute", json={"code": code, "timeout": timeout})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["exit_code"] == 0, out
    return out["stdout"]


def guest_probe(api, sid: str, targets: list[str]) -> dict[str, str]:
    code = probe_code([(t, t, PORT, None) for t in targets], timeout=2)
    return parse_probe(guest(api, sid, code))


def patch(api, sid: str, egress) -> dict:
    r = api.patch(f"/v1/sandboxes/{sid}", json={"egress": egress})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_cidr_rule_opens_only_its_address(egress_api, sid):
    assert egress_api.get(f"/v1/sandboxes/{sid}").json()["egress"] == {
        "default": "deny", "allow": [f"{ALLOWED_IP}/32"], "deny": [], "source": "sandbox"}
    got = guest_probe(egress_api, sid, [ALLOWED_IP, OTHER_IP])
    assert got == {ALLOWED_IP: "reached:internet", OTHER_IP: got[OTHER_IP]}, got
    assert got[OTHER_IP].startswith("blocked:"), got
    assert probe([("other", OTHER_IP, PORT, None)])["other"] == "reached:internet"


def test_patch_switches_a_running_sandbox(egress_api, sid):
    patch(egress_api, sid, {"allow": [ALLOWED_IP, OTHER_IP]})
    got = guest_probe(egress_api, sid, [ALLOWED_IP, OTHER_IP])
    assert set(got.values()) == {"reached:internet"}, got
    patch(egress_api, sid, "deny_all")
    got = guest_probe(egress_api, sid, [ALLOWED_IP, OTHER_IP])
    assert all(v.startswith("blocked:") for v in got.values()), got
    assert egress_api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


_RESOLVE = r"""
import json, socket
out = {}
for name in NAMES:
    try:
        out[name] = sorted({a[4][0] for a in socket.getaddrinfo(name, 1, socket.AF_INET)})
    except socket.gaierror as exc:
        out[name] = "error:" + str(exc.errno)
print("RESOLVED" + json.dumps(out))
"""


def resolve_in_guest(api, sid: str, names: list[str]) -> dict:
    stdout = guest(api, sid, f"NAMES = {names!r}\n" + _RESOLVE)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESOLVED"))
    return json.loads(line[len("RESOLVED"):])


def test_a_domain_rule_resolves_and_opens_only_the_allowed_name(egress_api, sid, internet):
    ok, bad, wild = NAMES
    patch(egress_api, sid, {"allow": [ok, "*.wild.egress.test"]})
    # Not reachable before the name resolved: the rule opens what the resolver answered.
    got = guest_probe(egress_api, sid, [NAMES[ok]])
    assert got[NAMES[ok]].startswith("blocked:"), got
    resolved = resolve_in_guest(egress_api, sid, [ok, bad, wild])
    assert resolved[ok] == [NAMES[ok]] and resolved[wild] == [NAMES[wild]], resolved
    assert str(resolved[bad]).startswith("error:"), resolved
    # The server would have answered it: the filter, not the upstream, refused the name.
    assert f"{bad} " not in internet.read_text() and f"{ok} 1" in internet.read_text()
    got = guest_probe(egress_api, sid, [NAMES[ok], NAMES[wild], NAMES[bad]])
    assert got[NAMES[ok]] == "reached:internet" and got[NAMES[wild]] == "reached:internet", got
    assert got[NAMES[bad]].startswith("blocked:"), got
    assert probe([("bad", NAMES[bad], PORT, None)])["bad"] == "reached:internet"


_TCP_QUERY = r"""
import json, socket, struct
out = {}
for name in NAMES:
    q = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1"
    with socket.create_connection(("169.254.0.22", 53), timeout=10) as s:
        s.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", s.recv(2))[0]
        r = b""
        while len(r) < n:
            r += s.recv(n - len(r))
    out[name] = [r[3] & 15, socket.inet_ntoa(r[-4:]) if r[7] else None]
print("TCP" + json.dumps(out))
"""


def test_the_resolver_answers_over_tcp_too(egress_api, sid):
    ok, bad, _ = NAMES
    patch(egress_api, sid, {"allow": [ok]})
    stdout = guest(egress_api, sid, f"NAMES = {[ok, bad]!r}\n" + _TCP_QUERY)
    got = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("TCP"))[3:])
    assert got == {ok: [0, NAMES[ok]], bad: [3, None]}, got
    assert guest_probe(egress_api, sid, [NAMES[ok]])[NAMES[ok]] == "reached:internet"


def test_invalid_policies_are_refused(egress_api, sid):
    for bad in ("open", {"allow": ["10.0.0.1/8"]}, {"allow": ["169.254.169.254"]},
                {"allow": ["192.168.1.0/24"]}, {"allow": ["exa mple.com"]},
                {"allow": ["x"] * 65}, {"default": "maybe"}, {"nope": []}, 5):
        r = egress_api.patch(f"/v1/sandboxes/{sid}", json={"egress": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_egress", r.text
    r = egress_api.post("/v1/sandboxes", json={"template": "python", "egress": "open"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_egress", r.text


def test_ipv6_rules_are_kept_and_ipv6_stays_denied(egress_api, sid):
    info = patch(egress_api, sid, {"default": "allow", "deny": ["2001:db8:98::/48"]})
    assert info["egress"]["deny"] == ["2001:db8:98::/48"]
    got = guest_probe(egress_api, sid, [ALLOWED_IP])  # default allow reaches the holes' v4
    assert got[ALLOWED_IP] == "reached:internet", got


def test_a_fork_keeps_its_sources_policy_and_deadline(egress_api, sid):
    patch(egress_api, sid, {"allow": [OTHER_IP]})
    r = egress_api.patch(f"/v1/sandboxes/{sid}", json={"ttl": 3600})
    assert r.status_code == 200, r.text
    deadline = r.json()["expires_at"]
    r = egress_api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1}, timeout=600)
    assert r.status_code == 201, r.text
    [fork] = r.json()["sandboxes"]
    try:
        assert fork["egress"]["allow"] == [f"{OTHER_IP}/32"], fork
        assert fork["expires_at"] == deadline, fork
        got = guest_probe(egress_api, fork["id"], [OTHER_IP, ALLOWED_IP])
        assert got[OTHER_IP] == "reached:internet", got
        assert got[ALLOWED_IP].startswith("blocked:"), got  # the host default would allow it
    finally:
        egress_api.delete(f"/v1/sandboxes/{fork['id']}")
        egress_api.patch(f"/v1/sandboxes/{sid}", json={"ttl": 0})


def test_the_policy_survives_a_suspend_and_wake(egress_api, sid):
    patch(egress_api, sid, {"allow": [OTHER_IP]})
    r = egress_api.post(f"/v1/sandboxes/{sid}/suspend")
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while egress_api.get(f"/v1/sandboxes/{sid}").json()["state"] != "suspended":
        assert time.monotonic() < deadline
        time.sleep(1)
    got = guest_probe(egress_api, sid, [OTHER_IP, ALLOWED_IP])  # wakes it
    assert got[OTHER_IP] == "reached:internet", got
    assert got[ALLOWED_IP].startswith("blocked:"), got


def test_the_policy_and_resolver_survive_a_daemon_restart(egress_daemon, egress_api, sid):
    ok = "ok.egress.test"
    patch(egress_api, sid, {"allow": [OTHER_IP, ok]})
    d, config = egress_daemon
    stop_daemon(d)
    port = int(d.url.rsplit(":", 1)[1])
    new = start_daemon(d.data_dir, port=port, config=config)
    d.proc = new.proc  # the module's cleanup stops this one
    assert egress_api.get(f"/v1/sandboxes/{sid}").json()["egress"]["allow"] == [
        f"{OTHER_IP}/32", ok]
    resolved = resolve_in_guest(egress_api, sid, [ok, "bad.egress.test"])
    assert resolved[ok] == [NAMES[ok]] and str(resolved["bad.egress.test"]).startswith("error")
    got = guest_probe(egress_api, sid, [OTHER_IP, ALLOWED_IP, NAMES[ok]])
    assert got[OTHER_IP] == "reached:internet" and got[NAMES[ok]] == "reached:internet", got
    assert got[ALLOWED_IP].startswith("blocked:"), got
