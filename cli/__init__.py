"""The `lctrain` command line (thin: it parses, then calls the trainer or the planner)."""
