"""Preview proxy benchmark: one warm sandbox's HTTP server measured three ways with wrk.

* direct  - wrk -> guest_addr:8000 (the host reaches the guest for any TCP port)
* gateway - wrk -> the daemon, Host: 8000-<id>.localhost, X-AgentBox-Token (our proxy)
* nginx   - wrk -> nginx on loopback, a reverse proxy (keepalive upstream) to guest_addr:8000

Requests/s and p50/p99 latency at 1 and 16 connections; ratios ours/nginx and ours/direct.
The app is tests/e2e/preview_app.py (aiohttp in the guest), ``GET /small`` = 512 bytes.
Needs wrk and nginx (Debian packages; installed here with apt-get if missing and root).
Starts its own daemon and nginx, and removes both (and the sandbox) at the end.

usage: .venv/bin/python bench/proxy.py [--duration 10] [--connections 1,16]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from _common import REPO, private_daemon

from gateway.config import load
from tests.e2e.conftest import CONFIG
from vmctl import network

APP = REPO / "tests" / "e2e" / "preview_app.py"
SMALL = "b" * 512
NGINX_CONF = """worker_processes 1;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fcgi; uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream guest {{ server {addr}:{upstream_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://guest;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_buffering off;
    }}
  }}
}}
"""


def ensure_tools() -> None:
    missing = [p for p, b in (("wrk", "wrk"), ("nginx", "nginx")) if not shutil.which(b)
               and not Path(f"/usr/sbin/{b}").exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing {', '.join(missing)}: apt-get install {' '.join(missing)}")
    print(f"installing {', '.join(missing)} (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=True, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def guest_addr(data_dir: Path, sandbox_id: str) -> str:
    db = sqlite3.connect(f"file:{data_dir / 'registry.sqlite'}?mode=ro", uri=True)
    try:
        (slot,) = db.execute("SELECT slot FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    return network.slot_for(slot, sandbox_id, load(CONFIG).vm.network).guest_addr


def start_app(api: httpx.Client, sid: str) -> None:
    script = APP.read_text().replace(
        'app.router.add_get("/count", count)',
        'app.router.add_get("/count", count)\n'
        f'app.router.add_get("/small", lambda r: web.Response(text="{SMALL}"))')
    api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/app.py"},
            content=script.encode()).raise_for_status()
    api.post(f"/v1/sandboxes/{sid}/commands", json={
        "command": "python3 /root/app.py 0.0.0.0 8000", "background": True}).raise_for_status()


def wait_ok(url: str, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=5).text == SMALL:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


def start_nginx(addr: str, workdir: Path,
                upstream_port: int = 8000) -> tuple[subprocess.Popen, int]:
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, addr=addr, port=port,
                                      upstream_port=upstream_port))
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(workdir), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def wrk(url: str, connections: int, duration: int, headers: dict[str, str],
        script: str | None = None) -> dict[str, float]:
    args = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "--timeout", "10s"]
    if script:
        args += ["-s", script]
    for k, v in headers.items():
        args += ["-H", f"{k}: {v}"]
    out = subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    return {"rps": rps, "p50": _latency(out, "50%"), "p99": _latency(out, "99%"),
            "errors": 0 if errors is None else 1}


def _latency(out: str, label: str) -> float:
    value, unit = re.search(rf"{re.escape(label)}\s+([\d.]+)(us|ms|s)\b", out).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", default="1,16")
    args = parser.parse_args()
    ensure_tools()
    conns = [int(c) for c in args.connections.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="agentbox-bench-nginx-"))
    nginx = None
    with private_daemon() as d, d.client() as api:
        sid = api.post("/v1/sandboxes", json={"idle_timeout": 0}).json()["id"]
        token = api.get(f"/v1/sandboxes/{sid}/preview").json()["preview_token"]
        start_app(api, sid)
        addr = guest_addr(d.data_dir, sid)
        host = f"8000-{sid}.localhost"
        try:
            nginx, nginx_port = start_nginx(addr, workdir)
            targets = {
                "direct": (f"http://{addr}:8000/small", {}),
                "gateway": (f"{d.url}/small", {"Host": host, "X-AgentBox-Token": token}),
                "nginx": (f"http://127.0.0.1:{nginx_port}/small", {"Host": host}),
            }
            for url, headers in targets.values():
                wait_ok(url, headers)
                wrk(url, 4, 2, headers)  # warm: TCG translates the guest's hot paths once
            results = {}
            print(f"{'target':<8} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
            for c in conns:
                for name, (url, headers) in targets.items():
                    r = results[name, c] = wrk(url, c, args.duration, headers)
                    print(f"{name:<8} {c:>5} {r['rps']:>9.0f} {r['p50']:>8.2f} "
                          f"{r['p99']:>8.2f}{'  (errors!)' if r['errors'] else ''}", flush=True)
            for c in conns:
                ours, ng, direct = (results[n, c] for n in ("gateway", "nginx", "direct"))
                print(f"{c:>2} conn: ours/nginx {ours['rps'] / ng['rps']:.2f} req/s, "
                      f"p50 {ours['p50'] / ng['p50']:.2f}x; ours/direct "
                      f"{ours['rps'] / direct['rps']:.2f} req/s, "
                      f"p50 {ours['p50'] / direct['p50']:.2f}x")
        finally:
            if nginx is not None:
                nginx.send_signal(signal.SIGQUIT)
                try:
                    nginx.wait(10)
                except subprocess.TimeoutExpired:
                    nginx.kill()
                    nginx.wait()
            shutil.rmtree(workdir, ignore_errors=True)
            api.delete(f"/v1/sandboxes/{sid}")


if __name__ == "__main__":
    main()
