"""--sweep ... --png PATH: the sweep as a PNG, where matplotlib is installed (pip install 'memcalc[plot]');
the paths --png and --svg may write (memcalc.report.files), and matplotlib imported only when a figure is
drawn (memcalc.report.timeline_plot draws --timeline's)."""

from __future__ import annotations

import io
from pathlib import Path

from memcalc.engine.sweep import Sweep
from memcalc.errors import InputError

from .files import check_path, write_file
from .units import UNITS


def check_image(path: str, suffix: str) -> str:
    """Where --png or --svg may write (memcalc.report.files.check_path). matplotlib would pick another format
    from another suffix, or add one to a name without it, a folder's included."""
    kind = suffix[1:].upper()
    return check_path(path, suffix, "--" + suffix[1:], f"a{'n' if kind == 'SVG' else ''} {kind} file")


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
    Drawn in memory first: the PNG writer seeks, which a pipe cannot. An SVG keeps its text as text, not as
    glyph paths (rcParams["svg.fonttype"] = "none": matplotlib/mpl-data/matplotlibrc, svg.fonttype)."""
    import matplotlib
    import matplotlib.pyplot as plt

    drawn = io.BytesIO()
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):
            fig.savefig(drawn, format=Path(path).suffix[1:].lower(), dpi=120)
    finally:
        plt.close(fig)
    write_file(path, drawn.getvalue())


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
