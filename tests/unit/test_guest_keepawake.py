"""agentbox-keepawake: the veto files it writes and how the agent counts them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from guest import keepawake
from guest.keepawake import count_vetoes, register, start_time

pytestmark = pytest.mark.timeout(30)
SCRIPT = Path(keepawake.__file__)


def run_script(veto_dir: Path, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, keepawake.ENV_DIR: str(veto_dir)}
    return subprocess.Popen([str(SCRIPT), *args], env=env, **kw)


def test_script_is_executable_with_a_system_shebang():
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/python3\n")


def test_live_pid_counts_dead_pid_is_cleaned(tmp_path):
    register(str(tmp_path), os.getpid())
    child = subprocess.Popen(["sleep", "10"])
    register(str(tmp_path), child.pid)
    assert count_vetoes(str(tmp_path)) == 2
    child.kill()
    child.wait()
    assert count_vetoes(str(tmp_path)) == 1
    assert os.listdir(tmp_path) == [str(os.getpid())]


def test_recycled_pid_does_not_count(tmp_path):
    # Same pid, different start time: the holder died and someone else got its pid.
    (tmp_path / str(os.getpid())).write_text("1")
    assert count_vetoes(str(tmp_path)) == 0


def test_ignores_partial_and_foreign_files(tmp_path):
    (tmp_path / ".123.tmp").write_text("")
    (tmp_path / "README").write_text("")
    assert count_vetoes(str(tmp_path)) == 0
    assert count_vetoes(str(tmp_path / "missing")) == 0


def test_start_time_of_self_and_of_nothing():
    assert start_time(os.getpid())
    assert start_time(2**22 + 1) is None  # above pid_max


def test_veto_lasts_while_the_command_runs(tmp_path):
    proc = run_script(tmp_path, "sleep", "0.5")
    try:
        deadline = time.monotonic() + 5
        while count_vetoes(str(tmp_path)) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert count_vetoes(str(tmp_path)) == 1
        assert os.listdir(tmp_path) == [str(proc.pid)]  # exec kept our pid for the command
    finally:
        assert proc.wait(timeout=5) == 0
    assert count_vetoes(str(tmp_path)) == 0


def test_missing_command_leaves_no_veto(tmp_path):
    proc = run_script(tmp_path, "--", "/nonexistent/cmd", stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 127 and b"/nonexistent/cmd" in err
    assert os.listdir(tmp_path) == []


def test_hold_release_status(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, keepawake.ENV_DIR: str(tmp_path)}
        return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True)

    assert run("--hold").returncode == 0
    assert run("--hold", "build").returncode == 0
    assert run("--hold", "build").returncode == 0  # idempotent per name
    assert run("--status").stdout == b"2\n"
    assert run("--release", "build").returncode == 0
    assert run("--release", "build").returncode == 1  # nothing to release
    assert count_vetoes(str(tmp_path)) == 1
    assert run("--release").returncode == 0
    assert count_vetoes(str(tmp_path)) == 0
    assert run("--hold", "a/b").returncode == 2
    assert run().returncode == 2


def test_directory_is_world_writable_and_sticky(tmp_path):
    target = tmp_path / "run" / "keepawake"
    keepawake.ensure_dir(str(target))
    assert target.stat().st_mode & 0o7777 == 0o1777
