"""Golden snapshots per shape, built on first use and cached.

A restore needs a snapshot with the sandbox's vCPU count and RAM size, so a create of a
(template, vcpus, memory_mib) that has no golden snapshot yet builds one (vmctl.golden:
boot, warm, save; under TCG a minute or more) and *waits* for it: the create answers
when its sandbox runs, as every create does. Concurrent creates of the same new shape
share one build. The build is owned by the service (a client that disconnects does not
cancel it, the next create finds it done). A failed build is not remembered: the next
create of that shape tries again. Built snapshots live in the template's image
directory under a name that says their shape, so they are found again after a restart
and shared by every daemon using the same images dir. See docs/operations.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from vmctl.backend import Backend
from vmctl.golden import BUILD_SLOTS, Golden, ensure_golden

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


class ShapeGoldens:
    def __init__(self, backend: Backend, defaults: dict[str, Golden], spawn: Spawn) -> None:
        self.backend = backend
        self.defaults = defaults
        self._spawn = spawn
        self._built: dict[tuple[str, int, int], Golden] = {}
        self._building: dict[tuple[str, int, int], asyncio.Task[Golden]] = {}
        # Start-up builds took the first slots (one per template); on-demand ones rotate
        # through the rest of the reserved build slots.
        self._slots = itertools.cycle(range(len(defaults), BUILD_SLOTS))

    def cached(self, template: str, vcpus: int, memory_mib: int) -> Golden | None:
        default = self.defaults[template]
        if (default.vcpus, default.mem_mib) == (vcpus, memory_mib):
            return default
        return self._built.get((template, vcpus, memory_mib))

    async def get(self, template: str, vcpus: int, memory_mib: int) -> Golden:
        """The golden snapshot of this shape, waiting for its build if there is none."""
        found = self.cached(template, vcpus, memory_mib)
        if found is not None:
            return found
        key = (template, vcpus, memory_mib)
        task = self._building.get(key)
        if task is None:
            task = self._spawn(self._build(key), f"golden-{template}-{vcpus}c-{memory_mib}M")
            self._building[key] = task
        return await asyncio.shield(task)

    async def _build(self, key: tuple[str, int, int]) -> Golden:
        template, vcpus, memory_mib = key
        try:
            image = await asyncio.to_thread(_image_of, self.defaults[template])
            golden = await ensure_golden(image, self.backend, progress=log.info,
                                         build_slot=next(self._slots), mem_mib=memory_mib,
                                         vcpus=vcpus)
            self._built[key] = golden
            return golden
        finally:
            self._building.pop(key, None)


def _image_of(golden: Golden):  # type: ignore[no-untyped-def]
    """The template build a golden snapshot was made from (its parent directory)."""
    from images.catalog import TemplateImage
    from images.manifest import read_manifest

    directory = golden.dir.parent
    data = read_manifest(directory)
    if data is None:
        from vmctl.errors import ImageError
        raise ImageError(f"template build {directory} has no manifest")
    return TemplateImage.from_manifest(directory, data)
