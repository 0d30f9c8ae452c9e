"""The `tokenfleet` command: a thin dispatcher above every package (`tokenfleet.cli`).

`python -m tokenfleet up|check|simulate|bench ...` is the same command as the console script.
"""
