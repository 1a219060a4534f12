"""Can an e2e daemon config that asks for Firecracker run on this host? (One-line reason.)

Used by conftest's ``images_built`` (so every daemon-backed e2e test skips, with
the reason, when ``AGENTBOX_E2E_CONFIG`` selects Firecracker on a host that
cannot run it) and by test_firecracker_api.py.
"""

from __future__ import annotations

from pathlib import Path

from gateway.config import load
from vmctl.drivers.firecracker import firecracker_usable


def firecracker_skip_reason(config_path: Path) -> str | None:
    """None when the config does not ask for Firecracker or the host can run it."""
    vm = load(config_path).vm
    if vm.vmm != "firecracker":
        return None
    usable, why = firecracker_usable(vm.firecracker.binary)
    if not usable:
        return f"vmm = firecracker, but Firecracker is not usable here: {why}"
    if not vm.firecracker_kernel.is_file():
        return (f"Firecracker guest kernel {vm.firecracker_kernel} not built "
                "(make kernel-firecracker)")
    return None


if __name__ == "__main__":
    # `python -m tests.e2e.firecracker_env CONFIG`: prints the reason (nothing if usable).
    import sys

    print(firecracker_skip_reason(Path(sys.argv[1])) or "")
