"""Boot the real `python` template under QEMU microvm (TCG) and watch PID 1 work.

Builds the template if missing (minutes, cached by content hash), then boots
it exactly with the TemplateImage's kernel, initrd, rootfs and cmdline. The
NIC is QEMU user networking configured so the guest's fixed address is
reachable through a loopback port forward (no TAP or namespace needed); all
traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from guest import protocol
from images.catalog import TemplateImage, build_template, load_template
from vmctl.drivers.qemu import TCG_CPU

pytestmark = pytest.mark.e2e

IMAGES_DIR = Path(os.environ.get("AGENTBOX_IMAGES_DIR", "/var/lib/agentbox/images"))
MARKER = "agentbox-init: agent started"
QEMU = "qemu-system-x86_64"


@pytest.fixture(scope="module")
def image() -> TemplateImage:
    if shutil.which(QEMU) is None:
        pytest.skip(f"{QEMU} not installed")
    if os.geteuid() != 0:  # building needs root; a built template does not
        built = load_template("python", IMAGES_DIR)
        if built is None:
            pytest.skip(f"python template not built in {IMAGES_DIR} and building needs root")
        return built
    return build_template("python", IMAGES_DIR, progress=print)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Guest:
    """One QEMU process; the serial console goes to a file we poll."""

    def __init__(self, image: TemplateImage, console: Path) -> None:
        self.console = console
        self.port = _free_port()
        net = (f"user,id=n0,net=169.254.0.0/24,host={protocol.TAP_ADDR},"
               f"dhcpstart=169.254.0.100,hostfwd=tcp:127.0.0.1:{self.port}-"
               f"{protocol.GUEST_ADDR}:{protocol.AGENT_PORT}")
        self.argv = [
            QEMU, "-M", "microvm", "-accel", "tcg", "-cpu", TCG_CPU, "-m", str(image.mem_mib),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd),
            "-append", image.cmdline,
            "-drive", f"id=root,file={image.rootfs},format=raw,if=none,snapshot=on",
            "-device", "virtio-blk-device,drive=root",
            "-netdev", net, "-device", f"virtio-net-device,netdev=n0,mac={protocol.GUEST_MAC}",
            "-device", "virtio-rng-device", "-serial", f"file:{console}", "-monitor", "none",
        ]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def output(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def wait_for(self, text: str, timeout: float, count: int = 1) -> float:
        """Seconds since start when ``text`` has appeared ``count`` times on the console."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output().count(text) >= count:
                return time.monotonic() - self.started
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        stderr = self.proc.stderr.read().decode() if self.proc.poll() is not None else ""
        pytest.fail(f"{text!r} x{count} not on the console within {timeout}s "
                    f"(qemu rc={self.proc.poll()} {stderr})\n--- console ---\n{self.output()}")

    def request(self, path: str, body: dict | None = None, timeout: float = 30) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.request("/health", timeout=5)
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                if time.monotonic() > deadline:
                    pytest.fail(f"agent not healthy in {timeout}s\n{self.output()}")
                time.sleep(0.5)

    def exec(self, command: str) -> dict:
        return self.request("/exec", {"command": command, "timeout": 30})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def guest(image: TemplateImage, tmp_path: Path) -> Iterator[Guest]:
    vm = Guest(image, tmp_path / "console.log")
    try:
        yield vm
    finally:
        vm.stop()


def _has_agent(image: TemplateImage) -> bool:
    manifest = json.loads((image.dir / "manifest.json").read_text())
    return "agent.py" in manifest.get("guest_files", [])


def test_boots_to_init_marker(guest: Guest) -> None:
    elapsed = guest.wait_for(MARKER, timeout=60)
    print(f"init marker after {elapsed:.2f}s")
    assert "agentbox-initramfs: ERROR" not in guest.output()


def test_network_pid1_duties_and_clean_poweroff(image: TemplateImage, guest: Guest) -> None:
    if not _has_agent(image):
        pytest.skip("this image has no guest agent to talk to")
    guest.wait_for(MARKER, timeout=60)
    health = guest.wait_healthy(timeout=60)
    assert health["status"] == "ok"
    facts = guest.exec(
        "hostname; echo $PATH; ip -4 -o addr show eth0; ip route show default; "
        "findmnt -n -o FSTYPE /tmp; findmnt -n -o FSTYPE /dev/pts; readlink /dev/fd; "
        # An orphan re-parented to PID 1 must be reaped, never left a zombie.
        "setsid sh -c 'sleep 0.2 & exit 0'; sleep 1.5; ps -eo stat= | grep -c '^Z' || true")
    lines = facts["stdout"].splitlines()
    assert lines[0] == "agentbox"
    assert "/usr/bin" in lines[1]
    assert f"{protocol.GUEST_ADDR}/{protocol.PREFIX_LEN}" in lines[2]
    assert f"default via {protocol.TAP_ADDR}" in lines[3]
    assert lines[4:7] == ["tmpfs", "devpts", "/proc/self/fd"]
    assert lines[7] == "0", f"zombies left: {facts}"
    # SIGTERM to PID 1: everything stops, the disk is synced, the VM powers off.
    try:
        guest.exec("kill -TERM 1")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass  # the agent may be stopped before it answers
    assert guest.proc.wait(timeout=30) == 0
    assert "agentbox-init: shutting down" in guest.output()


def test_agent_is_restarted_when_it_dies(image: TemplateImage, guest: Guest) -> None:
    if not _has_agent(image):
        pytest.skip("this image has no guest agent to kill")
    guest.wait_for(MARKER, timeout=60)
    guest.wait_healthy(timeout=60)
    # The exec'd shell is the agent's child: kill its parent once the reply is sent.
    guest.exec("setsid sh -c 'sleep 0.5; kill -9 '$PPID >/dev/null 2>&1 &")
    guest.wait_for("agentbox-init: agent exited (killed by signal 9)", timeout=30)
    guest.wait_for(MARKER, timeout=30, count=2)
    assert guest.wait_healthy(timeout=60)["status"] == "ok"
