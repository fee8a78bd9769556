"""The stage and run states and outcomes are one list each (sfguard.supervisor.daemon.runs),
and the API models document exactly those; a stage moves only along STAGE_TRANSITIONS."""
from __future__ import annotations

import typing

import pytest

from sfguard.supervisor import models
from sfguard.supervisor.daemon.runs import (
    STAGE_TRANSITIONS,
    IllegalTransition,
    RunOutcome,
    RunState,
    Stage,
    StageOutcome,
    StageState,
)


def literal_values(model: type, field: str) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


@pytest.mark.parametrize("model,field,enum", [
    (models.RunStageInfo, "state", StageState),
    (models.RunInfo, "state", RunState),
    (models.StageEnd, "outcome", StageOutcome),
    (models.RunEnd, "outcome", RunOutcome),
])
def test_the_api_documents_exactly_the_guards_states_and_outcomes(model, field, enum):
    assert literal_values(model, field) == {e.value for e in enum}


def test_every_state_has_its_moves_and_ended_is_final():
    assert set(STAGE_TRANSITIONS) == set(StageState)
    assert STAGE_TRANSITIONS[StageState.ENDED] == frozenset()
    assert all(StageState.ENDED in moves for s, moves in STAGE_TRANSITIONS.items() if s != StageState.ENDED)


@pytest.mark.parametrize("path,allowed", [
    ((StageState.WAITING, StageState.READY, StageState.RELAUNCHING, StageState.PENDING, StageState.READY,
      StageState.ENDED), True),
    ((StageState.FAILED, StageState.ENDED), True),
    ((StageState.ENDED, StageState.READY), False),
    ((StageState.FAILED, StageState.READY), False),
    ((StageState.READY, StageState.WAITING), False),
])
def test_a_stage_moves_only_along_the_table(path, allowed):
    stage = Stage("r", "s", 1, models.BrowserField(), headed=False)
    refused = None
    for to in path:
        before = stage.state
        try:
            stage.move(to)
        except IllegalTransition:
            refused = (before, to)
            assert stage.state == before     # a refused move changes nothing
            break
    assert (refused is None) == allowed, refused
    if allowed:
        assert stage.state == path[-1]


@pytest.mark.parametrize("end", ["done", "cancelled", "expired", "ended"])
def test_a_handoff_ends_once_and_only_from_open(end):
    from sfguard.supervisor.errors import IllegalTransition
    from sfguard.supervisor.states import HandoffPhase, handoff_move
    assert handoff_move(HandoffPhase.OPEN, end) == end
    for again in ("open", "done", "cancelled", "expired", "ended"):
        with pytest.raises(IllegalTransition):
            handoff_move(HandoffPhase(end), again)
