"""Built-in templates brought up after start-up, so the first start waits only for one.

``make run`` builds the default template before the daemon starts; every other template in
``[sandbox] templates`` that is not built yet is built here, in the background, one at a
time: the image by ``agentbox-server images build NAME --no-golden`` in a child process at
the lowest CPU and I/O priority (``nice -n 19``, ``ionice -c 3``), then its golden snapshot
in the daemon. While that runs, ``GET /v1/templates`` lists the template as ``building``
with its stage and elapsed time, and creating a sandbox from it answers 503
``template_building`` with ``Retry-After``; if it fails the list says ``failed`` with the
error and a create answers 503 ``template_build_failed`` (an operator fixes it and
restarts). Each stays cached by content hash like ``make images``' builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.http import wire
from gateway.errors import Unavailable
from vmctl.golden import Golden

log = logging.getLogger(__name__)

# images.pipeline's stages in order, then the golden snapshot: "stage k of N" for progress.
STAGES = ("kernel", "initramfs", "rootfs reuse", "base (debootstrap)", "copy base", "packages",
          "guest", "mkfs", "checksums", "golden")
RETRY_AFTER = "30"
MAX_ERROR = 2000


@dataclass
class Progress:
    started: float
    stage: str = "queued"
    line: str = ""

    def view(self) -> wire.TemplateProgress:
        n = STAGES.index(self.stage) + 1 if self.stage in STAGES else 0
        return wire.TemplateProgress(stage=self.stage, stage_index=n, stages=len(STAGES),
                                     elapsed_s=round(time.monotonic() - self.started, 1),
                                     last=self.line)


def stage_of(line: str) -> str | None:
    """The pipeline stage a progress line of ``images build`` announces, if any."""
    for stage in STAGES:
        if f"] {stage}" in line:
            return stage
    return "golden" if "golden[" in line else None


def priority_argv(argv: list[str]) -> list[str]:
    prefix = ["nice", "-n", "19"]
    if shutil.which("ionice"):
        prefix += ["ionice", "-c", "3"]
    return prefix + argv


class BuiltinBuilds:
    """Owns the background build task; ``aclose`` stops it (and its child process)."""

    def __init__(self, names: list[str], images_dir: Path, config_path: Path | None,
                 make_golden: Callable[[Any, Callable[[str], None]], Any],
                 on_ready: Callable[[str, Golden], None]) -> None:
        self.names = names
        self.images_dir, self.config_path = images_dir, config_path
        self.make_golden, self.on_ready = make_golden, on_ready
        now = time.monotonic()
        self.building: dict[str, Progress] = {n: Progress(now) for n in names}
        self.failed: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None

    def start(self) -> None:
        if self.names:
            self._task = asyncio.create_task(self._run(), name="builtin-template-builds")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 30)

    def check(self, name: str) -> None:
        """Raise the answer for a create from ``name`` while it is not servable."""
        if name in self.building:
            p = self.building[name].view()
            raise Unavailable(f"template {name!r} is still being built (stage {p.stage}, "
                              f"{p.elapsed_s:.0f}s so far)", code="template_building",
                              headers={"Retry-After": RETRY_AFTER})
        if name in self.failed:
            raise Unavailable(f"template {name!r} failed to build: {self.failed[name]}",
                              code="template_build_failed")

    def views(self) -> list[wire.Template]:
        out = [wire.Template(name=n, state="building", progress=p.view())
               for n, p in self.building.items()]
        return out + [wire.Template(name=n, state="failed", error=e)
                      for n, e in self.failed.items()]

    async def _run(self) -> None:
        for name in list(self.names):
            progress = self.building[name]
            progress.started = time.monotonic()
            try:
                image = await self._image(name, progress)
                progress.stage = "golden"
                golden = await self.make_golden(image, lambda line, p=progress: self._note(p, line))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("background build of template %r failed", name)
                self.failed[name] = str(exc)[-MAX_ERROR:] or type(exc).__name__
                del self.building[name]
                continue
            del self.building[name]
            self.on_ready(name, golden)
            log.info("template %r is ready (built in the background in %.0fs)", name,
                     time.monotonic() - progress.started)

    def _note(self, progress: Progress, line: str) -> None:
        progress.line = line[-300:]
        stage = stage_of(line)
        if stage:
            progress.stage = stage

    async def _image(self, name: str, progress: Progress) -> Any:
        from images.catalog import load_template

        argv = [sys.executable, "-m", "gateway.cli", "images", "build", name, "--no-golden",
                "--images-dir", str(self.images_dir)]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        proc = self._proc = await asyncio.create_subprocess_exec(
            *priority_argv(argv), stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        tail: list[str] = []
        try:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                self._note(progress, line)
                tail = (tail + [line])[-20:]
            code = await proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
            raise
        if code != 0:
            raise RuntimeError(f"`images build {name}` exited {code}: " + "\n".join(tail))
        image = load_template(name, self.images_dir)
        if image is None:
            raise RuntimeError(f"`images build {name}` succeeded but no image is loadable")
        return image
