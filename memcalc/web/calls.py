"""The commands the page may run, what they printed, kept while the server runs, and the page's next
moves run ahead of it in a second process.

A command's answer depends on its arguments and on memcalc's code, which does not change while the server
runs, so what it printed is kept by its arguments (the most recent, up to KEPT_BYTES). Ahead of the page, the commands
its sliders would send next run in a `memcalc` process of their own, one at a time, on the other core: they
leave their replays in memcalc's disk cache (memcalc.exact.base.cache), where this process finds them when
the slider gets there.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from memcalc.errors import InputError

COMMANDS = ("estimate", "fit", "presets", "gpus")  # what the page asks for
FILES = ("--from", "--png", "--svg", "--snapshot", "--trace")  # write files, or read a recipe: the page sends none
KEPT_BYTES = 256 << 20  # what the commands printed, kept up to this many characters (an 8B timeline's is 1.4 MB)
AHEAD_SECONDS = 300  # one command ahead that takes longer is given up


@dataclass(frozen=True)
class Printed:
    """What one command printed, and its exit code (0; 2 for input it refuses)."""

    code: int
    out: str
    err: str

    @property
    def error(self) -> str:
        """The refusal's one line, without the 'error: ' the terminal shows."""
        line = self.err.strip().splitlines()[-1] if self.err.strip() else f"exit code {self.code}"
        return line.removeprefix("error: ")


def checked(argv: object) -> tuple[str, ...]:
    """The page's argument list, if it is one the page may run: a command of COMMANDS, strings, no files."""
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise InputError("a command is a list of strings")
    if argv[0] not in COMMANDS:
        raise InputError(f"the page runs {', '.join(COMMANDS)}, not {argv[0]!r}")
    named = [a for a in argv if a.split("=", 1)[0] in FILES]
    if named:
        raise InputError(f"the page writes and reads no files of its own: {named[0].split('=', 1)[0]} is refused")
    return tuple(argv)


class Calls:
    """Runs the page's commands through run (memcalc.cli.inprocess.run), each once while it is kept."""

    def __init__(self, run: Callable[[tuple[str, ...]], Printed]):
        self.run, self.kept, self.lock = run, OrderedDict(), threading.Lock()
        self.kept_bytes = 0
        self.ahead = Ahead()

    def __call__(self, argv: tuple[str, ...]) -> Printed:
        with self.lock:
            if argv in self.kept:
                self.kept.move_to_end(argv)
                return self.kept[argv]
        printed = self.run(argv)
        with self.lock:
            if argv not in self.kept:
                self.kept[argv] = printed
                self.kept_bytes += len(printed.out)
            while self.kept_bytes > KEPT_BYTES and len(self.kept) > 1:
                self.kept_bytes -= len(self.kept.popitem(last=False)[1].out)
        return printed


class Ahead:
    """Commands run in a second `memcalc` process, newest wish first: each call of want() replaces the list."""

    def __init__(self):
        self.pending: list[tuple[str, ...]] = []
        self.done: set[tuple[str, ...]] = set()
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.running = False

    def want(self, argvs: list[tuple[str, ...]]) -> int:
        """Queue these (those not run before); returns how many were queued. Nothing where the disk cache is
        off: a second process would keep its replays to itself."""
        from memcalc.exact.base.cache import folder

        if folder() is None:
            return 0
        with self.wake:
            self.pending = [a for a in argvs if a not in self.done]
            if self.thread is None:
                self.thread = threading.Thread(target=self.loop, name="memcalc-ahead", daemon=True)
                self.thread.start()
            self.wake.notify()
            return len(self.pending)

    def status(self) -> dict:
        with self.wake:
            return {"pending": len(self.pending), "running": self.running}

    def loop(self) -> None:
        while True:
            with self.wake:
                self.running = False
                while not self.pending:
                    self.wake.wait()
                argv = self.pending.pop(0)
                self.done.add(argv)
                self.running = True
            try:
                subprocess.run([sys.executable, "-m", "memcalc", *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=AHEAD_SECONDS, check=False)  # fmt: skip
            except (OSError, subprocess.TimeoutExpired):
                pass
