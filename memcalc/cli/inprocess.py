"""One `memcalc` command run inside this process, as the shell would run it, and what it printed: how
`memcalc web` answers the page, so the page's numbers and refusals are the command line's own."""

import contextlib
import io
import threading
from functools import lru_cache

from memcalc.web.calls import Printed

LOCK = threading.Lock()  # a command prints to sys.stdout and sys.stderr, which are the process's own


@lru_cache(maxsize=1)
def group():
    """The click group typer builds from the app, built once (it costs a command's start each time)."""
    import typer

    from .commands import app

    return typer.main.get_command(app)


def run(argv: tuple[str, ...]) -> Printed:
    """`memcalc *argv`: its exit code, standard output and standard error."""
    out, err = io.StringIO(), io.StringIO()
    with LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = group().main(args=list(argv), prog_name="memcalc", standalone_mode=False)
        except SystemExit as e:  # a usage error: one line on stderr (commands.OneLineErrors)
            code = e.code
    return Printed(code if isinstance(code, int) else 0, out.getvalue(), err.getvalue())
