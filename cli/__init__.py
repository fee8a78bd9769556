"""`sfguard` commands. Thin: parse arguments, call supervisor or policy, print."""
