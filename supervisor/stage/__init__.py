"""Stage containment: the bubblewrap sandbox and its bridges (the guard's side of
`sfguard stage-exec` is daemon/stage_exec.py)."""
