"""The registry tells its observers (the cluster's record publisher) about each committed
insert and transition, after the commit; an observer that raises undoes nothing."""

from __future__ import annotations

import pytest

from gateway.sandbox.states import Event, IllegalTransition, State
from gateway.store.registry import Registry
from tests.unit.test_registry import _rec


def test_observers_hear_inserts_and_transitions_after_commit(tmp_path) -> None:
    reg = Registry(tmp_path / "r.sqlite")
    heard: list[tuple[str, State, State]] = []
    reg.observers.append(lambda i, s: heard.append((i, s, reg.get(i).state)))

    def broken(sandbox_id: str, state: State) -> None:
        raise RuntimeError("observer bug")
    reg.observers.append(broken)
    try:
        reg.insert_sandbox(_rec())
        reg.transition("abc", Event.CREATED)
        with pytest.raises(IllegalTransition):
            reg.transition("abc", Event.RESTORED)  # refused: nobody hears anything
        reg.transition("abc", Event.DESTROY)
        first = _rec().state
        # Each observer saw the committed state (it reads back the same).
        assert heard == [("abc", first, first), ("abc", State.RUNNING, State.RUNNING),
                         ("abc", State.DESTROYED, State.DESTROYED)]
        assert reg.get("abc").state is State.DESTROYED
    finally:
        reg.close()
