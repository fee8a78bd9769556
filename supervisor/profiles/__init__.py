"""Profiles at rest: stores, sealing, keys, leases, audit."""
