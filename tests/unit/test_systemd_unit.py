"""The shipped unit parses and keeps the hardening the daemon is documented to run with."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "agentbox.service"


def _directives() -> dict[str, str]:
    text = UNIT.read_text().replace("\\\n", " ")
    return dict(line.split("=", 1) for line in text.splitlines()
                if "=" in line and not line.startswith("#"))


def test_unit_is_hardened_but_keeps_what_vmms_need():
    d = _directives()
    assert d["KillMode"] == "process"  # VMMs outlive a daemon restart
    assert d["NoNewPrivileges"] == "yes" and d["ProtectSystem"] == "strict"
    assert d["UMask"] == "0077"
    caps = set(d["CapabilityBoundingSet"].split())
    assert {"CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SYS_CHROOT"} <= caps
    assert "CAP_SYS_MODULE" not in caps and "CAP_SYS_PTRACE" not in caps
    assert "/sys/fs/cgroup" in d["ReadWritePaths"] and "/var/lib/agentbox" in d["ReadWritePaths"]
    assert "PrivateDevices" not in d and "MemoryDenyWriteExecute" not in d


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_accepts_the_unit(tmp_path):
    unit = tmp_path / "agentbox.service"
    unit.write_text(UNIT.read_text().replace("/opt/agentbox/.venv/bin/agentbox-server", "/bin/true")
                    .replace("WorkingDirectory=/opt/agentbox", f"WorkingDirectory={tmp_path}"))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "Unknown" not in r.stderr, r.stderr
