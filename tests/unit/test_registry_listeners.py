"""The registry tells its listeners (the live feed; with [cluster] on, the cluster's record
publisher) about each committed insert and transition, after the commit; a listener that
raises undoes nothing and does not stop the others."""

from __future__ import annotations

import pytest

from gateway.cluster.publisher import Publisher
from gateway.sandbox.states import Event, IllegalTransition, State
from gateway.store.feed import Transition
from gateway.store.registry import Registry
from tests.unit.test_registry import _rec


def test_listeners_hear_inserts_and_transitions_after_commit(tmp_path) -> None:
    reg = Registry(tmp_path / "r.sqlite")
    heard: list[tuple[str, str, State]] = []

    def broken(t: Transition) -> None:
        raise RuntimeError("listener bug")
    reg.listeners.append(broken)  # first: the next one still hears everything
    reg.listeners.append(lambda t: heard.append((t.sandbox_id, t.to_state,
                                                 reg.get(t.sandbox_id).state)))
    try:
        reg.insert_sandbox(_rec())
        reg.transition("abc", Event.CREATED)
        with pytest.raises(IllegalTransition):
            reg.transition("abc", Event.RESTORED)  # refused: nobody hears anything
        reg.transition("abc", Event.DESTROY)
        first = _rec().state
        # Each listener saw the committed state (it reads back the same).
        assert heard == [("abc", first.value, first), ("abc", "running", State.RUNNING),
                         ("abc", "destroyed", State.DESTROYED)]
        assert reg.get("abc").state is State.DESTROYED
    finally:
        reg.close()


def test_the_cluster_publisher_notes_the_state_a_transition_left() -> None:
    noted: list[tuple[str, State]] = []
    publisher = Publisher.__new__(Publisher)  # only its listener is under test
    publisher.changed = lambda sid, state: noted.append((sid, state))  # type: ignore[method-assign]
    publisher.heard(Transition(7, "sb1", "t", "running", "suspended", "suspend", "idle", 1.0))
    assert noted == [("sb1", State.SUSPENDED)]
