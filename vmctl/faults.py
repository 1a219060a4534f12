"""Fault points: named places where a test can make the daemon die for real.

A crash test must kill the daemon at the real step (after QEMU started
restoring, while the snapshot is being written), not at a registry write. The
chaos suite arms points through the environment of the daemon it starts::

    AGENTBOX_FAULTS="restore.resumed=0.3,suspend.migrating=0.2"

and the daemon SIGKILLs itself with that probability when it reaches a point.
Unset (production), ``point`` is one dict lookup. Points: ``restore.waiting`` (a
wake's QEMU started and waiting for its state, not yet recorded, while the snapshot is
rebuilt or verified), ``restore.loading``
(device state streaming in), ``restore.before_cont`` (snapshot marked consumed,
guest not yet running), ``restore.resumed`` (guest running, agent not yet
answered), ``suspend.migrating`` (the snapshot being written),
``suspend.written`` (snapshot complete, VMM not yet stopped), ``compact.recorded`` (a
sleeping sandbox's memory diff written and named in its manifest, the full memory file not
yet deleted), ``expand.rebuilt`` (a wake rebuilt the memory file from the diff, the
manifest still names the diff), ``pause.before_stop`` (PAUSED recorded, vCPUs still
running), ``unpause.before_cont`` (RUNNING recorded, vCPUs stopped).
"""

from __future__ import annotations

import os
import random
import signal

ENV = "AGENTBOX_FAULTS"


def _parse(text: str) -> dict[str, float]:
    armed: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, prob = item.partition("=")
        armed[name] = float(prob or 1.0)
    return armed


_armed = _parse(os.environ.get(ENV, ""))


def point(name: str) -> None:
    prob = _armed.get(name)
    if prob is not None and random.random() < prob:
        os.kill(os.getpid(), signal.SIGKILL)
