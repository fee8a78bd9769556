"""Browsers: launching Chromium, agent-browser, the browser user, login check, handoff."""
