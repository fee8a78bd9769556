"""A real web application for the real-site tests: Django's own admin site (its CSRF-protected
login form, session cookie, `next=` redirects and logout), served over HTTPS by hypercorn."""
