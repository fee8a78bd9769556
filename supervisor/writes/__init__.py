"""Write gates at run time (docs/design.md 3): the writes a guarded browser sends, held for a
person or refused as the effective write mode says (sfguard.policy.writes decides the mode)."""
