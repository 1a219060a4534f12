"""Shared helpers for the benchmarks: percentiles, a private daemon, printing."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import IMAGES_DIR, start_daemon, stop_daemon  # noqa: E402

__all__ = ["IMAGES_DIR", "start_daemon", "stop_daemon", "pct", "report", "private_daemon"]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def report(name: str, values: list[float], unit: str = "ms") -> float:
    med = statistics.median(values)
    print(f"{name:<48} n={len(values):<4} p50={med:9.1f} {unit}  p95={pct(values, 95):9.1f} {unit}"
          f"  min={min(values):8.1f}  max={max(values):8.1f}", flush=True)
    return med


class private_daemon:
    """A daemon with its own data dir (shared, cached images), stopped on exit.
    ``config_edit``: (old, new) pairs replaced in the e2e config's text (e.g. to turn
    pausing on)."""

    def __init__(self, *config_edit: tuple[str, str]) -> None:
        self.config_edit = config_edit

    def __enter__(self):
        from tests.e2e.conftest import CONFIG

        self._tmp = tempfile.TemporaryDirectory(prefix="agentbox-bench-")
        config = CONFIG
        if self.config_edit:
            text = CONFIG.read_text()
            for old, new in self.config_edit:
                assert old in text, old
                text = text.replace(old, new)
            config = Path(self._tmp.name) / "agentbox.toml"
            config.write_text(text)
        self.daemon = start_daemon(Path(self._tmp.name) / "data", config=config)
        return self.daemon

    def __exit__(self, *exc):
        try:
            with self.daemon.client() as c:
                for sb in c.get("/v1/sandboxes").json()["sandboxes"]:
                    c.delete(f"/v1/sandboxes/{sb['id']}")
        finally:
            stop_daemon(self.daemon)
            self._tmp.cleanup()
