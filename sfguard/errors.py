"""`SfguardError`: the root of every exception sfguard defines.

policy/, proxy_addons/, supervisor/ and cli/ derive all their error classes from it, directly
or through a family (`GuardError`, `ProfileError`), so `except SfguardError` catches any of
them. Catch the narrowest class that means what you handle: the root also covers
`IllegalTransition`, a bug in the guard.

Why here, in the namespace package, and not in policy/ (the lowest part, which every other part
may import)? Importing `sfguard.policy.errors` first runs policy/__init__.py, which loads the whole
policy and its third-party packages (idna, yaml, pydantic). stage-exec's fast entry
(cli/stage_exec_entry.py) runs `python -I -S`, without site-packages, and imports only
cli/stage_exec_cmd.py, cli/errors.py and supervisor/stage/sandbox.py: their errors need a root it
can import. This module imports nothing, so every part may import it (tests/test_layout.py).
"""


class SfguardError(Exception):
    """An error raised on purpose by sfguard: a refusal or a failure it can name."""
