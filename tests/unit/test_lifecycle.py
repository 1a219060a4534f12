import pytest

from gateway.sandbox.states import TRANSITIONS, Event, IllegalTransition, State, mermaid, next_state


def test_happy_path_through_suspend_and_wake():
    s = State.CREATING
    for ev in (Event.CREATED, Event.SUSPEND, Event.SUSPENDED, Event.WAKE, Event.RESTORED):
        s = next_state(s, ev)
    assert s is State.RUNNING


def test_restore_failure_is_not_cached():
    # A failed restore returns to SUSPENDED so the next request retries.
    assert next_state(State.RESTORING, Event.RESTORE_FAILED) is State.SUSPENDED
    assert next_state(State.SUSPENDED, Event.WAKE) is State.RESTORING


@pytest.mark.parametrize("state", [s for s in State if s is not State.DESTROYED])
def test_everything_but_destroyed_can_be_destroyed(state):
    assert next_state(state, Event.DESTROY) is State.DESTROYED


@pytest.mark.parametrize("state,event", [
    (State.DESTROYED, Event.DESTROY), (State.SUSPENDED, Event.SUSPEND),
    (State.RUNNING, Event.WAKE), (State.CREATING, Event.SUSPEND), (State.SUSPENDED, Event.RESTORED),
])
def test_illegal_transitions_raise(state, event):
    with pytest.raises(IllegalTransition, match=event.value):
        next_state(state, event)


def test_destroyed_is_terminal():
    assert not [k for k in TRANSITIONS if k[0] is State.DESTROYED]


def test_mermaid_lists_every_transition():
    assert mermaid().count("-->") == len(TRANSITIONS)
