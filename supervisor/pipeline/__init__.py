"""Pipeline files: validation with line numbers, routes and stage facts."""
