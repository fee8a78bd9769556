"""Stage containment: the bubblewrap sandbox, its bridges and `sfguard stage-exec`."""
