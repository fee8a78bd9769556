"""The appliance: profiles, keys and sealing, leases, runs and stages, anchors, per-run
proxies, the CDP gate, login check, handoff, audit, redaction, orphan sweep, control API."""
