"""Real listeners and connection probes for the network-isolation tests.

Every "cannot reach" assertion in the suite aims at a listener opened here, and the same
listener is first shown to be reachable from somewhere that should reach it, so a missing
firewall makes the test fail instead of passing on "nothing listens there".

A listener answers each connection with its token and closes, so a probe can tell *which*
listener it reached. ``probe_code`` is self-contained Python: the same text runs in a test
namespace (``ip netns exec``) or inside a guest (the ``execute`` API).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator

LISTENER = r"""
import socket, sys, threading
port, token = int(sys.argv[1]), sys.argv[2].encode()
if len(sys.argv) > 3:  # also log UDP datagrams "source payload" to this file (no reply)
    def udp(log=sys.argv[3]):
        u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        u.bind(("::", port))
        while True:
            data, src = u.recvfrom(512)
            with open(log, "a") as f:
                f.write(f"{src[0]} {data.decode(errors='replace')}\n")
    threading.Thread(target=udp, daemon=True).start()
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 and IPv6, every address
s.bind(("::", port))
s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.sendall(token)
    finally:
        c.close()
"""

_PROBE = r"""
import json, socket
# One-way UDP first, from each source in UDP_SOURCES (None = the default): a listener logs
# what arrives, so a packet that gets through is seen even when no reply can come back.
for label, host, port, _ in TARGETS if UDP_NONCE else ():
    for source in UDP_SOURCES:
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as u:
                if source:
                    u.bind((source, 0))
                u.sendto(f"{UDP_NONCE} {label} {source}".encode(), info[4])
        except OSError:
            pass
out = {}
for label, host, port, source in TARGETS:
    try:
        src = (source, 0) if source else None
        with socket.create_connection((host, port), timeout=TIMEOUT, source_address=src) as c:
            c.settimeout(TIMEOUT)
            out[label] = "reached:" + c.recv(100).decode(errors="replace")
    except OSError as exc:
        out[label] = "blocked:" + type(exc).__name__
print("PROBE" + json.dumps(out))
"""

Target = tuple[str, str, int, str | None]  # label, host, port, source address or None


def probe_code(targets: list[Target], timeout: float = 2.0, udp_nonce: str = "",
               udp_sources: tuple[str | None, ...] = (None,)) -> str:
    return (f"TARGETS = {targets!r}\nTIMEOUT = {timeout!r}\nUDP_NONCE = {udp_nonce!r}\n"
            f"UDP_SOURCES = {udp_sources!r}\n" + _PROBE)


def udp_seen(log: str, nonce: str) -> set[str]:
    """``"label source"`` of every datagram of probe ``nonce`` that a listener logged."""
    return {line.split(f"{nonce} ", 1)[1] for line in log.splitlines() if f" {nonce} " in line}


def parse_probe(stdout: str) -> dict[str, str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("PROBE"))
    return json.loads(line[len("PROBE"):])


def probe(targets: list[Target], netns: str | None = None, timeout: float = 2.0,
          udp_nonce: str = "") -> dict[str, str]:
    """Run the probe on this host, or inside network namespace ``netns``."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    code = probe_code(targets, timeout, udp_nonce)
    proc = subprocess.run([*prefix, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60 + timeout * len(targets))
    assert proc.returncode == 0, proc.stderr
    return parse_probe(proc.stdout)


@contextmanager
def listener(port: int, token: str, netns: str | None = None,
             udp_log: str | None = None) -> Iterator[None]:
    """A listener on every address of ``netns`` (or of the host), for the ``with`` block;
    with ``udp_log``, UDP datagrams to the same port are logged there."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    extra = [udp_log] if udp_log else []
    proc = subprocess.Popen([*prefix, sys.executable, "-c", LISTENER, str(port), token, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"listener {token} did not start: {proc.stderr.read()}")
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def sh(*argv: str) -> str:
    """Run a command that must succeed (namespace plumbing in tests)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def link_local(ns: str, dev: str) -> str:
    """The (non-tentative) IPv6 link-local address of ``dev`` in namespace ``ns``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = json.loads(sh("ip", "-n", ns, "-j", "-6", "addr", "show", "dev", dev,
                            "scope", "link"))
        for info in (a for link in out for a in link["addr_info"]):
            if "local" in info and not info.get("tentative"):
                return info["local"]
        time.sleep(0.2)
    raise AssertionError(f"no link-local address on {ns}/{dev}")


_RAW_UDP = r"""
import socket, struct
def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
ifname = next(n for _, n in socket.if_nameindex() if n != "lo")
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
src_mac = s.getsockname()[4]
for label, src, dst, port in FRAMES:
    payload = f"{NONCE} {label} {src}".encode()
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload  # no UDP checksum
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
    s.send(bytes.fromhex(DST_MAC.replace(":", "")) + src_mac + b"\x08\x00" + ip + udp)
print("sent", len(FRAMES))
"""


def raw_udp_code(frames: list[tuple[str, str, str, int]], dst_mac: str, nonce: str) -> str:
    """Guest code that hand-builds Ethernet frames (label, source, destination, port) carrying
    UDP datagrams and sends them to ``dst_mac``: what the guest's kernel would never send
    (a destination of 127.0.0.1, any source) goes out anyway."""
    return f"FRAMES = {frames!r}\nDST_MAC = {dst_mac!r}\nNONCE = {nonce!r}\n" + _RAW_UDP
