"""Options several commands share, written once."""
from __future__ import annotations

import argparse

#: where a guard home is when `--home` is not given
HOME_DEFAULT = "$SFGUARD_HOME or ~/.stageflow/guard"
#: what the policy commands do with a home: check its live policy
POLICY_HOME_HELP = (f"guard home whose policy to use (default {HOME_DEFAULT}): the policy its running guard "
                    "enforces, else its sites.yaml; the file used is named on stderr")


def add_home(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str | None = None) -> None:
    """`--home DIR`: the guard home (default $SFGUARD_HOME or ~/.stageflow/guard)."""
    parser.add_argument("--home", metavar="DIR", default=None, help=help or f"guard home (default {HOME_DEFAULT})")
