"""The TypeScript SDK (sdk/typescript) against the real daemon (real microVMs).

Installs its npm dependencies if they are missing (``npm ci``, from the lock file), builds it
(``npm run build``: tsc), then runs its tests with node's test runner, pointed at the e2e
daemon through AGENTBOX_URL / AGENTBOX_API_KEY. The runner's TAP summary is checked: it must
report passes, no failures, and no skipped suite (the live-daemon suite skips itself only
when those variables are missing, which would mean this wrapper is broken).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript"
MIN_NODE = 18


def _node_skip_reason() -> str | None:
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (the TypeScript SDK needs Node {MIN_NODE}+ and npm)"
    out = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    match = re.match(r"v(\d+)\.", out)
    if not match or int(match.group(1)) < MIN_NODE:
        return f"node {out or '(unknown version)'} is older than {MIN_NODE}"
    return None


# Decided at collection, so a machine without node never starts the daemon for this.
_SKIP_REASON = _node_skip_reason()
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=SDK, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(cmd)}  (exit {proc.returncode})\n{proc.stdout}{proc.stderr}")
    return proc


def _summary(tap: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^# (tests|pass|fail|cancelled|skipped|todo) (\d+)$",
                                             tap, re.M)}


@pytest.fixture(scope="module")
def built() -> Path:
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    if not (SDK / "node_modules").is_dir():
        proc = _run(["npm", "ci"], env, timeout=300)
        assert proc.returncode == 0, "npm ci failed"
    proc = _run(["npm", "run", "build"], env, timeout=300)
    assert proc.returncode == 0, "the TypeScript build (tsc) failed"
    return SDK


def test_typescript_sdk_suite(built, daemon):
    env = {**os.environ, "AGENTBOX_URL": daemon.url, "AGENTBOX_API_KEY": daemon.admin_key}
    tests = sorted(str(p.relative_to(built)) for p in (built / "test-dist").glob("*.test.js"))
    assert tests, "no compiled tests in sdk/typescript/test-dist"
    # A Dockerfile build (e2e-templates.test.ts) boots a builder VM: a minute here, more when busy.
    proc = _run(["node", "--test", "--test-reporter=tap", *tests], env, timeout=900)
    summary = _summary(proc.stdout)
    assert proc.returncode == 0, f"node --test exited {proc.returncode}: {summary}"
    assert summary.get("fail") == 0 and summary.get("cancelled") == 0, summary
    assert summary.get("pass", 0) >= 60, f"too few tests ran: {summary}"
    assert "# SKIP" not in proc.stdout, "a TypeScript suite skipped itself"
