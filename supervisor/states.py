"""The guard's state machines: for stages, runs, login handoffs and held writes' approvals, one
list of states and one list of the moves between them. The records that move (daemon/runs.py
`Stage.move`, console/handoff.py and daemon/window_handoff.py through `handoff_move`) refuse
any other move with IllegalTransition, a bug of the guard; an approval decided twice is the
caller's conflict (writes/approvals.py, 409). States are compared as these enums, never as
strings. Below every room that keeps such a record (docs/design.md section 3)."""
from __future__ import annotations

from enum import StrEnum

from sfguard.supervisor.errors import IllegalTransition


class StageState(StrEnum):
    PENDING = "pending"            # asked for, not yet leased or launched
    WAITING = "waiting"            # queued behind another run's lease (or the store is away)
    READY = "ready"                # its env works: browser, tab, gate token, session
    RELAUNCHING = "relaunching"    # its browser died; the watchdog is restarting it
    ENDED = "ended"                # torn down with an outcome
    FAILED = "failed"              # its browser could not be had; it keeps the error


#: Every move the guard makes. A stage is re-attached (READY/RELAUNCHING -> PENDING -> READY)
#: when its browser was replaced; any stage not yet ended can be ended.
STAGE_TRANSITIONS: dict[StageState, frozenset[StageState]] = {
    StageState.PENDING: frozenset({StageState.WAITING, StageState.READY, StageState.FAILED,
                                   StageState.ENDED}),
    StageState.WAITING: frozenset({StageState.WAITING, StageState.READY, StageState.FAILED,
                                   StageState.ENDED}),
    StageState.READY: frozenset({StageState.RELAUNCHING, StageState.PENDING, StageState.ENDED}),
    StageState.RELAUNCHING: frozenset({StageState.PENDING, StageState.WAITING, StageState.READY,
                                       StageState.FAILED, StageState.ENDED}),
    StageState.FAILED: frozenset({StageState.ENDED}),
    StageState.ENDED: frozenset(),
}
#: a stage answer that may still change (answered 202 `waiting`)
WAITING_STATES = frozenset({StageState.PENDING, StageState.WAITING, StageState.RELAUNCHING})


class StageOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class RunState(StrEnum):
    ACTIVE = "active"
    ENDING = "ending"
    ENDED = "ended"


class RunOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    ABANDONED = "abandoned"


class HandoffPhase(StrEnum):
    """Where a login handoff (live view or local window) is: open until it ends one way, once.
    (`HandoffState` is the API's answer model that carries it.)"""
    OPEN = "open"
    DONE = "done"              # the person pressed Done (the guard checked the login)
    CANCELLED = "cancelled"    # the person pressed Cancel (its stage fails)
    EXPIRED = "expired"        # nobody finished it before its deadline
    ENDED = "ended"            # its run or stage ended first


HANDOFF_TRANSITIONS: dict[HandoffPhase, frozenset[HandoffPhase]] = {
    HandoffPhase.OPEN: frozenset({HandoffPhase.DONE, HandoffPhase.CANCELLED, HandoffPhase.EXPIRED,
                                  HandoffPhase.ENDED}),
    HandoffPhase.DONE: frozenset(), HandoffPhase.CANCELLED: frozenset(),
    HandoffPhase.EXPIRED: frozenset(), HandoffPhase.ENDED: frozenset(),
}


def handoff_move(current: HandoffPhase, to: str) -> HandoffPhase:
    """The handoff's next state; IllegalTransition for a move the table does not list."""
    new = HandoffPhase(to)
    if new not in HANDOFF_TRANSITIONS[current]:
        raise IllegalTransition(f"handoff: {current} -> {new}")
    return new



class ApprovalState(StrEnum):
    """A held write's approval (writes/approvals.py): pending until decided, once."""
    PENDING = "pending"
    APPROVED = "approved"      # a person released it: sent once, with its original bytes
    DENIED = "denied"          # a person refused it: the page is told
    TIMED_OUT = "timed_out"    # nobody decided in time: a denial
    CANCELLED = "cancelled"    # its stage or run ended first


APPROVAL_TRANSITIONS: dict[ApprovalState, frozenset[ApprovalState]] = {
    ApprovalState.PENDING: frozenset({ApprovalState.APPROVED, ApprovalState.DENIED,
                                      ApprovalState.TIMED_OUT, ApprovalState.CANCELLED}),
    ApprovalState.APPROVED: frozenset(), ApprovalState.DENIED: frozenset(),
    ApprovalState.TIMED_OUT: frozenset(), ApprovalState.CANCELLED: frozenset(),
}
