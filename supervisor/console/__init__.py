"""The operator console: a small web server the guard runs on loopback (issue 16).

* `auth`     one-time login links, session cookies, CSRF tokens (nothing on disk)
* `liveview` a live view of one login tab: CDP screencast frames out, the person's input in
* `handoff`  the guard's side of a `live_view` login handoff (open, state, done, cancel)
* `server`   the aiohttp app: overview, decisions, profiles, audit, live view, SSE updates
* `pages`, `approvals_page`, `runs_page`  what each page shows; held writes (approve, deny);
             the runs, a run's record, its read-only watch and controls
* `view`     ConsoleView: all the console reads of the guard and the few actions it may take
* `listen`   `sfguard start`'s console options checked; `reach` where it listens and who may
             reach it (Host, Origin, peer, TLS, a trusted proxy)

Everything the browser gets ships in this package (templates/, static/): no CDN, no inline
script, a strict Content-Security-Policy; it works offline.
"""
