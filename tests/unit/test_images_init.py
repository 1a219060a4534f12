"""guest/init.py (the guest's PID 1): command line parsing and restart policy."""

from __future__ import annotations

import os

import pytest

from guest import init, protocol

DEFAULTS = (protocol.GUEST_ADDR, protocol.PREFIX_LEN, protocol.TAP_ADDR)


def test_config_defaults_come_from_the_protocol() -> None:
    cfg = init.Config.from_cmdline("console=ttyS0 root=/dev/vda rw quiet\n", DEFAULTS)
    assert cfg.address == f"{protocol.GUEST_ADDR}/{protocol.PREFIX_LEN}"
    assert cfg.gateway == protocol.TAP_ADDR
    assert (cfg.iface, cfg.dns, cfg.debug) == ("eth0", "", False)


def test_config_overrides() -> None:
    cfg = init.Config.from_cmdline(
        "quiet agentbox.ip=10.0.2.15/24 agentbox.gw=10.0.2.2 agentbox.dns=10.0.2.3 "
        "agentbox.iface=eth1 agentbox.debug", DEFAULTS)
    assert (cfg.address, cfg.gateway, cfg.dns, cfg.iface, cfg.debug) == (
        "10.0.2.15/24", "10.0.2.2", "10.0.2.3", "eth1", True)


def test_supervisor_starts_at_once_then_backs_off() -> None:
    sup = init.Supervisor()
    assert sup.due(0.0) and sup.timeout(0.0) == 0.0
    delays = []
    now = 0.0
    for pid in range(100, 110):
        sup.started(pid, now)
        assert not sup.due(now) and sup.timeout(now) is None  # running: wait for SIGCHLD
        now += 0.1  # a crash right after start
        delays.append(sup.exited(now))
        assert not sup.due(now)
        now += delays[-1]
        assert sup.due(now)
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == init.Supervisor.MAX


def test_supervisor_resets_backoff_after_a_stable_run() -> None:
    sup = init.Supervisor()
    for _ in range(5):
        sup.started(1, 0.0)
        sup.exited(0.1)
    sup.started(2, 1000.0)
    assert sup.exited(1000.0 + init.Supervisor.STABLE) == init.Supervisor.BASE


def test_supervisor_stop_prevents_restarts() -> None:
    sup = init.Supervisor()
    sup.started(1, 0.0)
    sup.stop()
    sup.exited(1.0)
    sup.stop()
    assert not sup.due(1e9) and sup.timeout(1e9) is None


@pytest.mark.parametrize(("status", "text"), [
    (0, "exit status 0"), (3 << 8, "exit status 3"), (9, "killed by signal 9")])
def test_describe_wait_status(status: int, text: str) -> None:
    assert init.describe(status) == text


def test_reap_collects_exited_children() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    reaped: list[tuple[int, int]] = []
    while not reaped:
        reaped = [r for r in init.reap() if r[0] == pid]
    assert os.waitstatus_to_exitcode(reaped[0][1]) == 7
