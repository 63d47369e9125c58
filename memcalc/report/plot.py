"""--sweep ... --png PATH: the sweep as a PNG, where matplotlib is installed (pip install 'memcalc[plot]');
the paths --png and --svg may write, and matplotlib imported only when a figure is drawn (memcalc.report
.timeline_plot draws --timeline's)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

from memcalc.engine.sweep import Sweep
from memcalc.errors import InputError

from .units import UNITS


def check_image(path: str, suffix: str) -> str:
    """Where --png or --svg may write: a new file, a file or a named pipe, ending in the suffix, in a folder
    that exists. (matplotlib would pick another format from another suffix, or add one to a name without it,
    a folder's included.) Nothing is opened here: opening a pipe tells its reader the data begins (save)."""
    p, flag, kind = Path(path), "--" + suffix[1:], suffix[1:].upper()
    if p.suffix.lower() != suffix:
        raise InputError(f"{flag} writes a{'n' if kind == 'SVG' else ''} {kind} file: give a path ending in {suffix}, "
                         f"got {path!r}")  # fmt: skip
    if p.is_dir():
        raise InputError(f"{flag} {path} is a folder: give a file path, e.g. {p / ('timeline' + suffix)}")
    if not p.parent.is_dir():
        raise InputError(f"{flag} {path}: the folder {p.parent} does not exist")
    if p.exists() and not (p.is_file() or p.is_fifo()):
        raise InputError(f"{flag} {path} is not a file: give a file path or a named pipe")
    return path


def pyplot(flag: str = "--png"):
    """matplotlib's pyplot on the Agg backend (no display), or one line saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(f"{flag} needs matplotlib: pip install 'memcalc[plot]'") from None
    return plt


def save(fig, path: str) -> None:
    """Write the figure (its format from the suffix) and close it; a path that cannot be written is bad input.
    Drawn in memory first: the PNG writer seeks, which a pipe cannot."""
    import matplotlib.pyplot as plt

    drawn = io.BytesIO()
    try:
        fig.savefig(drawn, format=Path(path).suffix[1:].lower(), dpi=120)
    finally:
        plt.close(fig)
    try:
        write_out(path, drawn.getvalue())
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def write_out(path: str, data: bytes) -> None:
    """data into the file at path, or into the named pipe there when a process reads it. A pipe is opened
    without waiting (open(2) of a FIFO for writing blocks until a reader opens it; with O_NONBLOCK it fails
    at once with ENXIO when none has: fifo(7)), then written whole, waiting on a slow reader."""
    if not Path(path).is_fifo():
        Path(path).write_bytes(data)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, "no process is reading this named pipe (start its reader first)") from None
        raise
    with os.fdopen(fd, "wb") as pipe:
        os.set_blocking(fd, True)
        pipe.write(data)


def save_png(sw: Sweep, path: str, units: str = "gb") -> None:
    """Two panels against the swept value: peak memory per GPU (with the usable line) and step time."""
    plt = pyplot("--png")
    scale, unit = UNITS[units]
    fig, (mem, time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(p.tricks.label for p in sw.points):
        points = [p for p in sw.points if p.tricks.label == label]
        xs = [p.value for p in points]
        mem.plot(xs, [p.memory_bytes / scale for p in points], marker="o", label=label)
        time.plot(xs, [p.step_seconds for p in points], marker="o", label=label)
    mem.axhline(sw.usable_bytes / scale, color="black", linestyle="--", linewidth=1, label=f"{sw.gpu} usable")
    for ax, ylabel in ((mem, f"peak memory per GPU ({unit})"), (time, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(sw.name)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    mem.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
