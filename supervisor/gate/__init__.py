"""The CDP gate: the relay between a browser's pipe and the stages' token URLs, and its rules."""
