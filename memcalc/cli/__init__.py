"""The `memcalc` command line: typer commands (commands) that turn options into engine inputs (inputs),
run the engine through a view per mode (views, verify_runs) and hand the result to memcalc.report.

May import: everything in memcalc. Nothing imports it but memcalc.__main__ and the `memcalc` script.
"""

from .commands import app, main

__all__ = ["app", "main"]
