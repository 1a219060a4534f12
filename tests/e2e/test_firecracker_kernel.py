"""The Firecracker guest kernel (images/firecracker/) boots a real template.

Firecracker cannot run here, so this boots the same uncompressed vmlinux under
QEMU's ``microvm`` machine with ``acpi=off`` (TCG): devices are virtio-mmio
found through the kernel command line, exactly the discovery path Firecracker
uses without ACPI, and QEMU enters the kernel through its PVH note. No initrd:
everything needed to mount the python template's ext4 root is built in. The
test waits for the guest's init to start the agent, then asks the agent for
``/health`` over virtio-net from a network namespace the test creates.

Skipped when the kernel or the template has not been built
(``images/firecracker/build_kernel.sh``, ``make images``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from guest.protocol import AGENT_PORT, GUEST_ADDR, GUEST_MAC, PREFIX_LEN, TAP_ADDR, TAP_NAME

pytestmark = pytest.mark.e2e

IMAGES_DIR = Path(os.environ.get("AGENTBOX_IMAGES_DIR", "/var/lib/agentbox/images"))
KERNEL = IMAGES_DIR / "firecracker" / "vmlinux"
AGENT_MARKER = "agentbox-init: agent started"
# Firecracker's own defaults plus what our images expect (see FirecrackerDriver.boot_args).
CMDLINE = "console=ttyS0 reboot=k panic=1 root=/dev/vda rw init=/sbin/agentbox-init"


def template_rootfs(name: str = "python") -> Path:
    """The template's ext4 image, or skip with the reason."""
    catalog = pytest.importorskip("images.catalog")
    image = catalog.load_template(name, IMAGES_DIR)
    if image is None:
        pytest.skip(f"template {name!r} not built in {IMAGES_DIR} (make images)")
    return Path(image.rootfs)


def firecracker_kernel() -> Path:
    if not KERNEL.is_file():
        pytest.skip(f"{KERNEL} not built (images/firecracker/build_kernel.sh)")
    return KERNEL.resolve()


@contextlib.contextmanager
def tap_namespace() -> Iterator[str]:
    """A throwaway netns holding the TAP a guest expects (fixed name and address)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 for a network namespace")
    ns = f"fctest-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for cmd in (["tuntap", "add", TAP_NAME, "mode", "tap"],
                    ["addr", "add", f"{TAP_ADDR}/{PREFIX_LEN}", "dev", TAP_NAME],
                    ["link", "set", TAP_NAME, "up"], ["link", "set", "lo", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def agent_health(ns: str, timeout: float) -> dict:
    """GET /health from the guest agent, from inside ``ns`` (retrying until timeout)."""
    url = f"http://{GUEST_ADDR}:{AGENT_PORT}/health"
    probe = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).read().decode())"
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", probe],
                             capture_output=True, text=True)
        if out.returncode == 0:
            return json.loads(out.stdout)
        if time.monotonic() > deadline:
            raise AssertionError(f"agent did not answer in {timeout}s: {out.stderr[-500:]}")
        time.sleep(0.5)


def wait_for_text(path: Path, text: str, timeout: float, proc: subprocess.Popen | None = None
                  ) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = path.read_text(errors="replace")[-3000:] if path.exists() else "(no console)"
    raise AssertionError(f"{text!r} not seen on the console in {timeout}s:\n{tail}")


def test_kernel_boots_the_python_template_under_qemu_microvm(tmp_path: Path) -> None:
    kernel, rootfs = firecracker_kernel(), template_rootfs("python")
    qemu = shutil.which("qemu-system-x86_64") or pytest.skip("qemu-system-x86_64 missing")
    console = tmp_path / "console.log"
    with tap_namespace() as ns:
        argv = ["ip", "netns", "exec", ns, qemu, "-M", "microvm,acpi=off", "-accel", "tcg",
                "-cpu", "max", "-m", "512M", "-smp", "1", "-nodefaults", "-no-user-config",
                "-nographic", "-no-reboot", "-kernel", str(kernel), "-append", CMDLINE,
                "-drive", f"id=root,file={rootfs},format=raw,if=none,snapshot=on",
                "-device", "virtio-blk-device,drive=root",
                "-netdev", f"tap,id=n0,ifname={TAP_NAME},script=no,downscript=no",
                "-device", f"virtio-net-device,netdev=n0,mac={GUEST_MAC}",
                "-device", "virtio-rng-device", "-serial", f"file:{console}"]
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            text = wait_for_text(console, AGENT_MARKER, 180, proc)
            booted = time.monotonic() - started
            assert "-agentbox-microvm" in text  # our kernel, not Debian's
            health = agent_health(ns, 60)
            print(f"agent started {booted:.1f}s after launch; health: {health}")
        finally:
            proc.kill()
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
