"""`CliError`: what every command raises for a problem the user can fix.

cli/main.py prints it as one line (`sfguard COMMAND: error: MESSAGE`) and exits with its code;
stage-exec's fast entry prints it the same way. A module of its own, importing nothing heavy:
the fast entry (`python -I -S`, no argparse, no site-packages) raises and catches this class too.
"""
from __future__ import annotations

from sfguard.errors import SfguardError


class CliError(SfguardError):
    """A problem the user can fix; printed without a traceback, exit code 2 unless given."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
