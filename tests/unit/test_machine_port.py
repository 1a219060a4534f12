"""The sandbox layer's port (``MachinePort``) and ``vmctl.machine.Machine`` cannot drift apart:
the real class has every member of the port, with the same signature and types, and the unit
fakes have every member too (with the same parameters), so a test never drives the sandbox
layer through a method the real machine lacks, or the other way round."""

from __future__ import annotations

import inspect
import typing

import pytest

from gateway.sandbox.machine_port import MachinePort
from tests.unit.test_controller import FakeMachine, ProcessMachine
from tests.unit.test_controller_pause import PausingMachine, SlowPausingMachine
from vmctl.machine import Machine
from vmctl.spec import VMMRecord


def port_members() -> dict[str, object]:
    """Each member of the port: its attributes (annotations), properties and methods."""
    members: dict[str, object] = dict(typing.get_type_hints(MachinePort))
    for name, value in vars(MachinePort).items():
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
            members[name] = value
    return members


def _hint(cls: type, name: str) -> object:
    """The declared type of ``cls.name``: a property's return type or a class annotation."""
    value = inspect.getattr_static(cls, name, None)
    if isinstance(value, property):
        return typing.get_type_hints(value.fget)["return"]
    return typing.get_type_hints(cls).get(name, inspect.Parameter.empty)


def mismatches(cls: type) -> list[str]:
    """How ``cls`` differs from the port (empty: it implements every member, same types)."""
    found = []
    for name, member in port_members().items():
        value = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(member):
            if not inspect.isfunction(value):
                found.append(f"{name}: missing method")
            elif inspect.iscoroutinefunction(member) != inspect.iscoroutinefunction(value):
                found.append(f"{name}: async in one, not the other")
            elif inspect.signature(member, eval_str=True) != inspect.signature(value,
                                                                               eval_str=True):
                found.append(f"{name}: {inspect.signature(value)} is not the port's "
                             f"{inspect.signature(member)}")
            continue
        expected = _hint(MachinePort, name)
        if _hint(cls, name) != expected:
            found.append(f"{name}: {_hint(cls, name)} is not the port's {expected}")
        elif not isinstance(member, property) and isinstance(value, property):
            found.append(f"{name}: read-only on {cls.__name__}, the port sets it")
    return found


def test_port_has_what_recovery_and_the_controller_use():
    members = port_members()
    for name in ("create", "suspend", "wake", "cold_boot", "destroy", "vmm_record", "adopt",
                 "adopt_paused", "ensure_running", "finish_restore", "kill_recorded",
                 "require_agent", "snapshot_dir", "on_vmm_started", "agent", "driver", "plan"):
        assert name in members, name


def test_machine_implements_the_port_with_the_same_signatures():
    assert mismatches(Machine) == []


def test_a_drifted_machine_is_caught():
    class Drifted(Machine):
        async def wake(self, fast: bool) -> float:  # type: ignore[override]  # not in the port
            return 0.0

        def kill_recorded(self, record: VMMRecord) -> None:  # type: ignore[override]
            pass

        @property
        def agent(self) -> None:  # type: ignore[override]  # the service sets it
            return None

        async def adopt(self, record: dict) -> None:  # type: ignore[override]
            pass

    found = {m.split(":")[0] for m in mismatches(Drifted)}
    assert found == {"wake", "kill_recorded", "agent", "adopt"}


@pytest.mark.parametrize("fake", [FakeMachine, ProcessMachine, PausingMachine,
                                  SlowPausingMachine])
def test_unit_fakes_have_every_member_of_the_port(fake):
    machine = fake()
    for name, member in port_members().items():
        assert hasattr(machine, name), f"{fake.__name__} lacks {name}"
        if not inspect.isfunction(member):
            continue
        method = getattr(machine, name)
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(member), name
        params = list(inspect.signature(member).parameters)[1:]  # without self
        assert list(inspect.signature(method).parameters) == params, name
