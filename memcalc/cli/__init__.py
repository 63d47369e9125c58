"""The `memcalc` command line: typer commands (commands) that turn options into engine inputs (inputs),
run the engine through a view per mode (views, verify_runs) and hand the result to memcalc.report.

May import: everything in memcalc. Nothing imports it but memcalc.__main__ and the `memcalc` script.
"""

import gc

__all__ = ["app", "main"]


def main() -> None:
    """The `memcalc` script and `python -m memcalc`. Importing typer, rich and the commands makes some
    100,000 objects and frees none: the collector's passes over them were a twentieth of the start-up
    (valgrind), so it waits until they are imported, and then leaves them alone (they live as long as the
    process); the command itself runs with it on, save inside the engine's no_collection blocks, whose
    survivors it freezes as well (memcalc.exact.base.collection.FREEZE)."""
    gc.disable()
    try:
        from memcalc.exact.base import collection

        from .commands import main as run
    finally:
        gc.freeze()
        gc.enable()
    collection.FREEZE = True  # one command, then the process ends: what the engine's blocks keep, it keeps
    run()


def __getattr__(name: str):
    if name != "app":
        raise AttributeError(f"module 'memcalc.cli' has no attribute {name!r}")
    from .commands import app

    return app
