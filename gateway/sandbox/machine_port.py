"""The sandbox layer's port to vmctl: everything it asks of one sandbox's ``Machine``.

The controller (operations), start-up recovery (adopting or killing what a previous
daemon left) and the service (handing the running VM to a request) go through this
Protocol, never through ``vmctl.machine.Machine`` itself, so that:

* the surface is written down in one place, with precise types, instead of
  ``getattr`` and ``type: ignore`` where the real class has more than the port says;
* unit tests drive the sandbox layer with a fake that implements it
  (tests/unit/test_controller.py ``FakeMachine``);
* the port cannot drift from the real class: tests/unit/test_machine_port.py checks
  that ``Machine`` has every member below with the same signature, and the fakes
  every member too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from vmctl.agent_client import AgentClient
from vmctl.driver import Driver
from vmctl.machine import MachinePlan
from vmctl.spec import VMMRecord

__all__ = ["MachinePort"]


class MachinePort(Protocol):
    """One sandbox's VM, as the sandbox layer uses it (``vmctl.machine.Machine``)."""

    # Called with a new VMM's record before its guest may run (the controller persists it).
    on_vmm_started: Callable[[VMMRecord], None] | None
    # The guest agent's client while the VM runs; the service closes it at shutdown.
    agent: AgentClient | None

    @property
    def plan(self) -> MachinePlan: ...  # where the VM lives (its slot: the guest's address)
    @property
    def driver(self) -> Driver | None: ...  # the VMM, while one runs (its exit detail)
    @property
    def snapshot_dir(self) -> Path: ...  # recovery: is the sandbox's own snapshot usable?

    def vmm_record(self) -> VMMRecord | None: ...
    def require_agent(self) -> AgentClient: ...

    # -- operations (the controller, one at a time) --------------------------------------
    async def create(self) -> None: ...
    async def suspend(self) -> None: ...
    async def wake(self) -> float: ...
    async def cold_boot(self) -> float: ...
    async def abort_suspend(self) -> None: ...
    async def pause(self) -> None: ...
    async def unpause(self) -> float: ...
    async def stop_vmm(self) -> None: ...
    async def destroy(self) -> None: ...
    async def capture(self, dest: Path, meta: dict[str, object]) -> float: ...

    # -- start-up recovery: what a previous daemon left ----------------------------------
    async def adopt(self, record: VMMRecord) -> None: ...
    async def adopt_paused(self, record: VMMRecord) -> None: ...
    async def ensure_running(self) -> None: ...
    async def finish_restore(self) -> None: ...
    async def kill_recorded(self, record: VMMRecord) -> None: ...
