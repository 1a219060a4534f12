"""The sandbox layer's counters: wake/suspend counts and durations, rejections.

One ``Metrics`` object per service, updated by its controllers (no I/O). ``GET /metrics``
(``gateway.http.metrics``) renders it in the Prometheus text format, with the gauges it
reads at scrape time (sandboxes per state, requests held right now, warm-pool members).
It lives here, not beside the route, so that the sandbox layer never imports ``http/``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Upper bounds (seconds) of the duration histograms' buckets.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, seconds: float) -> None:
        self.n += 1
        self.total += seconds
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        pairs = zip(BUCKETS, self.counts, strict=True)
        lines += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in pairs]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}",
                  f"{name}_count {self.n}"]
        return lines


@dataclass
class Metrics:
    restore_seconds: Histogram = field(default_factory=Histogram)
    suspend_seconds: Histogram = field(default_factory=Histogram)
    unpause_seconds: Histogram = field(default_factory=Histogram)  # wake from PAUSED
    events: Counter[str] = field(default_factory=Counter)  # restores, restore_failures, ...

    def render(self, states: Counter[str], held: int,
               pool_ready: dict[str, int] | None = None) -> str:
        lines = ["# TYPE agentbox_sandboxes gauge"]
        lines += [f'agentbox_sandboxes{{state="{s}"}} {n}' for s, n in sorted(states.items())]
        lines += ["# TYPE agentbox_requests_held gauge", f"agentbox_requests_held {held}"]
        if pool_ready is not None:  # gateway.sandbox.warm_pool: members a create can claim now
            lines += ["# TYPE agentbox_pool_ready gauge"]
            lines += [f'agentbox_pool_ready{{template="{t}"}} {n}'
                      for t, n in sorted(pool_ready.items())]
        lines += ["# TYPE agentbox_events_total counter"]
        lines += [f'agentbox_events_total{{event="{e}"}} {n}'
                  for e, n in sorted(self.events.items())]
        lines += self.restore_seconds.render("agentbox_restore_seconds")
        lines += self.suspend_seconds.render("agentbox_suspend_seconds")
        lines += self.unpause_seconds.render("agentbox_unpause_seconds")
        return "\n".join(lines) + "\n"
