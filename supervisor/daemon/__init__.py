"""The guard daemon: runs and stages, run proxies, the control API, the sweep."""
