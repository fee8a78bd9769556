"""sfguard: a security appliance that lends pipeline stages a guarded, logged-in browser.

Everything installs under this one namespace; the repository keeps a folder per part
(pyproject.toml maps each onto a sub-package):

- `sfguard.policy`       (policy/)       the site policy: pure decisions with reasons
- `sfguard.proxy_addons` (proxy_addons/) the mitmproxy addons of a run's filtering proxy
- `sfguard.supervisor`   (supervisor/)   the guard: profiles, browsers, gate, stages, daemon
- `sfguard.cli`          (cli/)          the `sfguard` command
- `sfguard.fixtures`     (fixtures/)     the fixture login site (tests and `sfguard demo`)

Imports point one way: cli -> supervisor -> proxy_addons -> policy (docs/design.md). Below
them all, `sfguard.errors` holds `SfguardError`, the root of every sfguard exception.
"""
