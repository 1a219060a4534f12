"""gateway.tenancy.usage: awake and suspended intervals from a transition log, clipped to
windows."""

from __future__ import annotations

import pytest

from gateway.tenancy import usage

SHAPE = usage.Shape(vcpus=2, mem_mib=512, snapshot_bytes=1 << 30)


def log(*steps: tuple[float, str | None, str, str], sid="s", key="k"):
    return [{"sandbox_id": sid, "tenant": key, "at": at, "from_state": src, "to_state": dst,
             "event": ev} for at, src, dst, ev in steps]


LIFE = log((0, None, "creating", "insert"), (10, "creating", "running", "created"),
           (70, "running", "suspending", "suspend"), (75, "suspending", "suspended",
                                                       "suspended"),
           (3675, "suspended", "restoring", "wake"), (3680, "restoring", "running",
                                                       "restored"),
           (3700, "running", "destroyed", "destroy"))


def test_awake_is_time_running_and_storage_is_time_suspended_times_snapshot():
    u = usage.account(LIFE, SHAPE, 0, 1e9, now=1e6)
    assert u.awake_seconds == 60 + 20
    assert u.vcpu_seconds == 160 and u.gib_seconds == 40  # 80 s x 2 vCPUs, 80 s x 0.5 GiB
    assert u.suspended_seconds == 3600
    assert u.snapshot_gib_hours == pytest.approx(1.0)  # 1 GiB for an hour
    assert (u.restores, u.created, u.destroyed) == (1, 1, 1)


def test_windows_clip_intervals_and_count_events_inside_them():
    u = usage.account(LIFE, SHAPE, 40, 3690, now=1e6)
    assert u.awake_seconds == 30 + 10  # 40-70 and 3680-3690
    assert u.suspended_seconds == 3600
    assert (u.restores, u.created, u.destroyed) == (1, 0, 0)
    assert usage.account(LIFE, SHAPE, 5000, 6000, now=1e6).awake_seconds == 0


def test_an_open_interval_ends_now_and_a_restart_that_adopted_the_vmm_changes_nothing():
    running = LIFE[:2]  # created at 10, still running (adopted across restarts: no rows)
    assert usage.account(running, SHAPE, 0, 1e9, now=100).awake_seconds == 90
    assert usage.account(running, SHAPE, 0, 50, now=100).awake_seconds == 40
    # a VMM found dead at start-up: recovery records crashed at its own time
    crashed = [*running, *log((500, "running", "failed", "crashed"))]
    assert usage.account(crashed, SHAPE, 0, 1e9, now=1e6).awake_seconds == 490


def test_by_key_sums_each_keys_sandboxes():
    rows = [*LIFE, *log((0, None, "creating", "insert"), (1, "creating", "running", "created"),
                        sid="t"),
            *log((0, None, "creating", "insert"), (2, "creating", "running", "created"),
                 sid="o", key="other")]
    report = usage.by_key(rows, lambda sid: SHAPE, 0, 1e9, now=101)
    total, items = report["k"]
    assert sorted(i.sandbox_id for i in items) == ["s", "t"]
    assert total.awake_seconds == 80 + 100 and total.created == 2
    assert report["other"][0].awake_seconds == 99
    lines = usage.prometheus({k: t for k, (t, _) in report.items()})
    assert 'agentbox_usage_vcpu_seconds_total{key="k"} 360' in lines
    assert 'agentbox_usage_created_total{key="other"} 1' in lines


def test_an_interval_recovery_closes_ends_at_the_crashed_daemons_last_heartbeat():
    running = LIFE[:2]  # running since 10
    found_dead = [*running, *log((520, "running", "failed", "crashed"))]  # by recovery at 520
    downtime = [(300.0, 525.0)]  # last heartbeat at 300; the next run began (after recovery)
    assert usage.account(found_dead, SHAPE, 0, 1e9, 1e6, downtime).awake_seconds == 290
    # a crash seen while the daemon ran, and an adopted VMM: not touched by downtimes
    live = [*running, *log((200, "running", "failed", "crashed"))]
    assert usage.account(live, SHAPE, 0, 1e9, 1e6, downtime).awake_seconds == 190
    assert usage.account(running, SHAPE, 0, 1e9, 600, downtime).awake_seconds == 590


def test_the_registry_records_daemon_runs(tmp_path):
    from gateway.store.registry import Registry

    reg = Registry(tmp_path / "r.sqlite")
    first = reg.start_run()
    reg.heartbeat(first)
    assert reg.downtimes() == []
    reg.start_run()
    (beat, restart), = reg.downtimes()
    assert beat <= restart
    reg.close()


def test_a_sandbox_is_billed_for_its_own_shape_and_an_old_row_for_its_goldens():
    from types import SimpleNamespace

    from gateway.http.control_routes import shape_of

    goldens = {"/g/old": SimpleNamespace(vcpus=1, mem_mib=512)}
    service = SimpleNamespace(golden_for=lambda rec: goldens[rec.golden],
                              goldens=SimpleNamespace(get=lambda template: None))
    recs = {"new": SimpleNamespace(vcpus=2, memory_mib=1024, golden="/g/new", template="python",
                                   snapshot_bytes=7),
            "old": SimpleNamespace(vcpus=0, memory_mib=0, golden="/g/old", template="python",
                                   snapshot_bytes=0),  # before per-sandbox shapes
            "gone": SimpleNamespace(vcpus=0, memory_mib=0, golden="/g/removed",
                                    template="python", snapshot_bytes=0)}
    shape = shape_of(service, recs)  # type: ignore[arg-type]
    assert shape("new") == usage.Shape(2, 1024, 7)
    assert shape("old") == usage.Shape(1, 512, 0)  # not today's default vCPU count
    assert shape("gone") == usage.Shape(1, 0, 0)
