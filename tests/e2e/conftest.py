"""End-to-end fixtures: one real daemon (real VMs) shared by the whole e2e session.

The daemon runs as a subprocess with its own data dir and a private network
pool; images come from the shared, content-hash-cached images dir (built by
`make images`, or here if missing). At the end every sandbox is deleted through
the API, the daemon is stopped, and the suite checks that nothing was left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES_DIR = Path(os.environ.get("AGENTBOX_IMAGES_DIR", "/var/lib/agentbox/images"))
# AGENTBOX_E2E_CONFIG picks another daemon config (make test-firecracker: the Firecracker one).
TEST_TEMPLATES = ("python", "python-datascience")  # what agentbox-test.toml serves
CONFIG = Path(os.environ.get("AGENTBOX_E2E_CONFIG")
              or Path(__file__).with_name("agentbox-test.toml")).resolve()


@dataclass
class Daemon:
    url: str
    admin_key: str
    data_dir: Path
    proc: subprocess.Popen
    log_path: Path

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.admin_key if key is None else key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(data_dir: Path, port: int | None = None, timeout: float = 300,
                 config: Path = CONFIG, env: dict[str, str] | None = None) -> Daemon:
    """``env``: extra environment (e.g. AGENTBOX_FAULTS for crash tests)."""
    port = port or _free_port()
    log_path = data_dir.parent / f"{data_dir.name}-daemon.log"
    log_file = open(log_path, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
         "--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
         "--images-dir", str(IMAGES_DIR)],
        cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})})
    log_file.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                key = (data_dir / "admin.key").read_text().strip()
                return Daemon(url, key, data_dir, proc, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"daemon not ready in {timeout}s: {log_path.read_text()[-3000:]}")


def stop_daemon(daemon: Daemon, sig: int = signal.SIGTERM) -> None:
    if daemon.proc.poll() is None:
        daemon.proc.send_signal(sig)
        try:
            daemon.proc.wait(30)
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()


def vmm_pids_for(text: str) -> list[int]:
    """PIDs of VMM processes whose command line mentions ``text`` (a sandbox id or dir)."""
    # Anchored on the program name: the daemon's own command line may say "firecracker".
    pattern = f"^([^ ]*/)?(qemu-system-[^ ]*|firecracker) .*{text}"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="session")
def images_built() -> Path:
    from images.catalog import build_template, load_template
    from tests.e2e.firecracker_env import firecracker_skip_reason

    reason = firecracker_skip_reason(CONFIG)
    if reason:
        pytest.skip(reason)

    for name in TEST_TEMPLATES:  # normally built already by `make images`
        if load_template(name, IMAGES_DIR) is None:
            build_template(name, IMAGES_DIR)
    return IMAGES_DIR


@contextlib.contextmanager
def running_daemon(data_dir: Path, config: Path = CONFIG) -> Iterator[Daemon]:
    """A daemon for a test module or session: at the end its sandboxes are deleted through
    the API, it is stopped, and no VMM of its data dir may be left."""
    d = start_daemon(data_dir, config=config)
    try:
        yield d
    finally:
        try:
            with d.client() as client:
                for sb in client.get("/v1/sandboxes").json()["sandboxes"]:
                    client.delete(f"/v1/sandboxes/{sb['id']}")
        finally:
            stop_daemon(d)
        leftovers = vmm_pids_for(str(d.data_dir))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"VMM processes left behind: {leftovers}"


@pytest.fixture(scope="session")
def daemon(images_built, tmp_path_factory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("agentbox") / "data") as d:
        yield d


@pytest.fixture
def api(daemon) -> httpx.Client:
    with daemon.client() as client:
        yield client


@pytest.fixture
def sandbox(api):
    """A fresh sandbox, deleted afterwards."""
    r = api.post("/v1/sandboxes", json={"template": "python"})
    assert r.status_code == 201, r.text
    sb = r.json()
    yield sb
    api.delete(f"/v1/sandboxes/{sb['id']}")
