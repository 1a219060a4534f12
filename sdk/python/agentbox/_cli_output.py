"""Output helpers for the client CLI: JSON for scripts, aligned tables and progress
for people. Progress and spinners go to stderr, and only when it is a terminal."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        data = dataclasses.asdict(obj)
        for name in ("error", "ok", "text"):  # useful derived properties
            if hasattr(type(obj), name) and isinstance(getattr(type(obj), name), property):
                data[name] = to_jsonable(getattr(obj, name))
        return data
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(obj: Any, out: TextIO | None = None) -> None:
    print(json.dumps(to_jsonable(obj), indent=None, default=str), file=out or sys.stdout)


def remove_each(names: Sequence[str], remove: Callable[[str], bool], kind: str,
                as_json: bool) -> int:
    """Remove each name; report what went (``--json``: one object); 1 if any was unknown."""
    status, removed = 0, []
    for name in names:
        if remove(name):
            removed.append(name)
            if not as_json:
                print(f"removed {name}")
        else:
            status = 1
            print(f"agentbox: no {kind} {name}", file=sys.stderr)
    if as_json:
        print_json({"removed": removed})
    return status


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], out: TextIO | None = None) -> None:
    cells = [[str(c) for c in headers]] + [[("-" if c is None else str(c)) for c in r]
                                          for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(),
              file=out or sys.stdout)


def age(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "-"
    secs = max(0, int((now or time.time()) - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """``progress(done, total)`` callback drawing one updating line on stderr."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label, self.stream = label, stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.start, self._last = time.monotonic(), 0.0

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done != total):
            return
        self._last = now
        rate = done / max(now - self.start, 1e-6)
        pct = f" {100 * done / total:3.0f}%" if total else ""
        of = f" / {human_bytes(total)}" if total else ""
        self.stream.write(f"\r{self.label}: {human_bytes(done)}{of}{pct}  "
                          f"{human_bytes(rate)}/s\x1b[K")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class Spinner:
    """``with Spinner("creating sandbox"):`` shows elapsed time on stderr while it runs."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label, self.stream = label, stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        start, i = time.monotonic(), 0
        while not self._stop.wait(0.1):
            self.stream.write(f"\r{self.FRAMES[i % 4]} {self.label} "
                              f"({time.monotonic() - start:.1f}s)\x1b[K")
            self.stream.flush()
            i += 1

    def __enter__(self) -> Spinner:
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._run, name="agentbox-spinner",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.stream.write("\r\x1b[K")
            self.stream.flush()
