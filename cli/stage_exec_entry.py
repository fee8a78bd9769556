"""stage-exec's fast entry, the script of the guard's `exec_prefix` (`python -I -S
.../cli/stage_exec_entry.py --home HOME --run RUN --stage STAGE -- COMMAND...`).

A few lines on purpose: Python compiles the script it runs on every start (only imported modules
come from cached bytecode), so the command lives in stage_exec_cmd.py, imported from here.
-S loads no site-packages and so no editable-install finder: the sfguard namespace is set up by
hand, for a checkout (its folders are sfguard's sub-packages, pyproject's package-dir) and for
an installed wheel (<site-packages>/sfguard/cli/stage_exec_entry.py).
"""
import os
import sys

_up = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_up, "supervisor")) and os.path.isfile(os.path.join(_up, "sfguard", "__init__.py")):
    sys.path.insert(0, _up)
    import sfguard
    sfguard.__path__.append(_up)
else:
    sys.path.insert(0, os.path.dirname(_up))

from sfguard.cli.stage_exec_cmd import fast_main  # noqa: E402 (after the path set-up)

sys.exit(fast_main(sys.argv[1:]))
