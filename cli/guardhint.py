"""Messages that send the user to another command keep the --home the user gave."""
from __future__ import annotations

import shlex

from sfguard.cli.errors import CliError
from sfguard.cli.main import EXIT_NO_GUARD


def with_home(command: str, home_flag: str | None) -> str:
    """`sfguard start` -> `sfguard start --home DIR` when the user passed --home DIR."""
    return f"{command} --home {shlex.quote(home_flag)}" if home_flag else command


def no_guard(home, home_flag: str | None) -> CliError:
    """The one answer for "no guard runs on this home" (exit 3)."""
    return CliError(f"no guard is running on {home}: start it with "
                    f"`{with_home('sfguard start', home_flag)}`", EXIT_NO_GUARD)
