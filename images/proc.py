"""Subprocesses and progress reporting for the build.

Builds are long (minutes under debootstrap) and mostly spent in child
processes, so every command's output goes to a build log, the user sees stage
names with elapsed time, and a failure quotes the log's tail instead of a bare
exit status.
"""

from __future__ import annotations

import collections
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

Progress = Callable[[str], None]

# apt and dpkg must never stop to ask a question in an unattended build.
BUILD_ENV = {
    "DEBIAN_FRONTEND": "noninteractive",
    "LC_ALL": "C.UTF-8",
    "LANG": "C.UTF-8",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}


class BuildError(RuntimeError):
    """A build step failed; the message carries the command's last output lines."""


@dataclass
class BuildContext:
    """What every stage needs: where to log, how to report, and stage timings."""

    progress: Progress
    log: IO[str]
    label: str = ""
    verbose: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        """Report ``name`` when it starts and, with its elapsed time, when it ends."""
        prefix = f"[{self.label}] " if self.label else ""
        self.progress(f"{prefix}{name}{': ' + detail if detail else ''} ...")
        self.log.write(f"\n=== {name}\n")
        start = time.monotonic()
        try:
            yield
        except BaseException:
            self.progress(f"{prefix}{name} FAILED after {time.monotonic() - start:.1f}s")
            raise
        elapsed = time.monotonic() - start
        self.timings[name] = round(self.timings.get(name, 0.0) + elapsed, 2)
        self.progress(f"{prefix}{name} done in {elapsed:.1f}s")

    def run(self, cmd: Sequence[str | os.PathLike[str]], *, cwd: Path | None = None,
            stdin: bytes | None = None, env: dict[str, str] | None = None) -> str:
        """Run ``cmd`` to completion, logging its output; raise BuildError on failure."""
        return run(cmd, log=self.log, cwd=cwd, stdin=stdin, env=env,
                   echo=self.progress if self.verbose else None)


def run(cmd: Sequence[str | os.PathLike[str]], *, log: IO[str], cwd: Path | None = None,
        stdin: bytes | None = None, env: dict[str, str] | None = None,
        echo: Progress | None = None) -> str:
    """Run a command, stream its merged output into ``log``; return the output."""
    argv = [os.fspath(c) for c in cmd]
    log.write("$ " + " ".join(argv) + "\n")
    log.flush()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    lines: list[str] = []
    with subprocess.Popen(
        argv, cwd=cwd, env={**BUILD_ENV, **(env or {})},
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    ) as proc:  # the context closes the pipes (no ResourceWarning) and reaps the child
        try:
            if stdin is not None:
                assert proc.stdin is not None
                proc.stdin.write(stdin.decode())
                proc.stdin.close()
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail.append(line)
                lines.append(line)
                if echo:
                    echo("    " + line.rstrip())
            rc = proc.wait()
        except BaseException:
            # Interrupted (Ctrl-C, an exception in the log writer): never leave the
            # child running behind us.
            _stop(proc)
            raise
    log.flush()
    if rc != 0:
        raise BuildError(f"{argv[0]} exited with {rc}: {' '.join(argv)}\n" + "".join(tail))
    return "".join(lines)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
