"""The sandbox lifecycle state machine.

Theory of operation: a sandbox is always in exactly one ``State``. Things that
happen to it are ``Event``s; the only legal moves are the rows of
``TRANSITIONS``. The registry writes every transition (with its cause and a
timestamp) *before* the gateway acts on it, so after a crash the recorded state
says what was in progress: a sandbox found in SUSPENDING or RESTORING was
mid-operation and is rolled forward or back by reconciliation.

::

    CREATING --created--> RUNNING --suspend--> SUSPENDING --suspended--> SUSPENDED
        |                  ^  |                    |                        |
        |                  |  +--crashed--> FAILED <--suspend_failed (VM lost)
        |                  |                   |                            |
        |                  +------restored---- RESTORING <-------wake-------+
        |                                      |  (restore_failed -> SUSPENDED: not cached)
        +--create_failed--> FAILED --wake--> RESTORING (retry from the last good snapshot)

    RUNNING --pause--> PAUSED --unpause--> RUNNING      (vCPUs stopped, VMM alive)
                       PAUSED --suspend--> SUSPENDING   (paused long enough, or memory needed)
                       PAUSED --crashed--> FAILED

    any state but DESTROYED --destroy--> DESTROYED

This module does no I/O: it is plain data and one function, tested in
microseconds.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"  # vCPUs stopped, VMM alive and holding its RAM
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    RESTORING = "restoring"
    FAILED = "failed"
    DESTROYED = "destroyed"


class Event(enum.Enum):
    CREATED = "created"
    CREATE_FAILED = "create_failed"
    SUSPEND = "suspend"
    SUSPENDED = "suspended"
    SUSPEND_ABORTED = "suspend_aborted"  # the VM kept running (e.g. a request cancelled it)
    SUSPEND_FAILED = "suspend_failed"  # the VM is lost
    WAKE = "wake"
    RESTORED = "restored"
    RESTORE_FAILED = "restore_failed"  # snapshot still good: retry on the next request
    SNAPSHOT_LOST = "snapshot_lost"  # snapshot unusable: nothing left to restore
    CRASHED = "crashed"
    PAUSE = "pause"
    UNPAUSE = "unpause"
    DESTROY = "destroy"


S, E = State, Event

TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.CREATING, E.CREATED): S.RUNNING,
    (S.CREATING, E.CREATE_FAILED): S.FAILED,
    (S.RUNNING, E.SUSPEND): S.SUSPENDING,
    (S.RUNNING, E.CRASHED): S.FAILED,
    (S.SUSPENDING, E.SUSPENDED): S.SUSPENDED,
    (S.SUSPENDING, E.SUSPEND_ABORTED): S.RUNNING,
    (S.SUSPENDING, E.SUSPEND_FAILED): S.FAILED,
    (S.SUSPENDED, E.WAKE): S.RESTORING,
    (S.RESTORING, E.RESTORED): S.RUNNING,
    (S.RESTORING, E.RESTORE_FAILED): S.SUSPENDED,
    (S.RESTORING, E.SNAPSHOT_LOST): S.FAILED,
    (S.SUSPENDED, E.SNAPSHOT_LOST): S.FAILED,  # found missing or used at start-up
    (S.FAILED, E.WAKE): S.RESTORING,
    # Pause before snapshot: recorded before the VMM is stopped or continued.
    (S.RUNNING, E.PAUSE): S.PAUSED,
    (S.PAUSED, E.UNPAUSE): S.RUNNING,
    (S.PAUSED, E.SUSPEND): S.SUSPENDING,
    (S.PAUSED, E.CRASHED): S.FAILED,
}
for _state in State:
    if _state is not S.DESTROYED:
        TRANSITIONS[(_state, E.DESTROY)] = S.DESTROYED


class IllegalTransition(Exception):
    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"cannot {event.value} a sandbox that is {state.value}")
        self.state = state
        self.event = event


def next_state(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


def mermaid() -> str:
    """The table as a Mermaid diagram (for docs)."""
    lines = ["stateDiagram-v2"]
    for (src, ev), dst in TRANSITIONS.items():
        lines.append(f"    {src.name} --> {dst.name}: {ev.value}")
    return "\n".join(lines)
