"""`swallowed`: a best-effort step's failure is logged with why, never dropped silently, and only
the kinds named are swallowed (anything else, a bug included, goes on up)."""
from __future__ import annotations

import logging

import pytest

from sfguard.supervisor.errors import swallowed

log = logging.getLogger("sfguard.test.swallowed")


def test_a_swallowed_failure_is_logged_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger=log.name), swallowed(log, "closing the thing"):
        raise OSError("disk gone")
    (rec,) = caplog.records
    assert rec.getMessage() == "closing the thing failed (left as it is): OSError: disk gone"


def test_only_the_named_kinds_are_swallowed():
    with pytest.raises(KeyError), swallowed(log, "saving", (OSError,)):
        raise KeyError("a bug")


def test_nothing_is_logged_when_the_step_works(caplog):
    with caplog.at_level(logging.INFO, logger=log.name), swallowed(log, "closing"):
        pass
    assert caplog.records == []
