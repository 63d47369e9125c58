"""--sweep ... --png PATH: the sweep as a PNG, where matplotlib is installed (pip install 'memcalc[plot]')."""

from __future__ import annotations

from pathlib import Path

from memcalc.errors import InputError
from memcalc.engine.sweep import Sweep

from .units import UNITS


def check_png(path: str) -> str:
    """Where --png may write: a file ending in .png, in a folder that exists. (matplotlib would pick
    another format from another suffix, or add .png to a name without one, a folder's name included.)"""
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise InputError(f"--png writes a PNG file: give a path ending in .png, got {path!r}")
    if p.is_dir():
        raise InputError(f"--png {path} is a folder: give a file path, e.g. {p / 'sweep.png'}")
    if not p.parent.is_dir():
        raise InputError(f"--png {path}: the folder {p.parent} does not exist")
    return path


def save_png(sw: Sweep, path: str, units: str = "gb") -> None:
    """Two panels against the swept value: peak memory per GPU (with the usable line) and step time."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--png needs matplotlib: pip install 'memcalc[plot]'") from None
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
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
