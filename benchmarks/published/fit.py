"""Fit the roofline's efficiencies per GPU generation on the fitting part of the published corpus only, and
print the error of both parts with the shipped calibration and at the fitted values.

    python benchmarks/published/fit.py

Fitted: `matmul` (the share of the dense peak a matmul sustains in a training step, at 8192³) and `flash` (the
flash kernel's), over GRID; `matmul_dim` (how much less a smaller or TP-split matmul sustains) is held at 0.
The objective is the median |log(predicted / published)| over the generation's fitting runs; the held-out runs are never used by the fit,
only printed beside it. A value ships in memcalc/time/calibrations/ only where the held-out error falls too
(docs/step-time.md says what was found and what shipped).
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import load, rows, summary  # noqa: E402
from sources import FIT  # noqa: E402

from memcalc.time.calibration import calibration_for  # noqa: E402

# the GPUs of one compute die: a generation is fitted as one (the H200 is a GH100 with HBM3e)
GENERATIONS = {"A100": ("a100-80gb", "a100-40gb"), "H100": ("h100-sxm", "h100-hbm2e", "h800", "h200")}
# matmul_dim stays 0: a shape effect is the kernel's, to be measured by sweeping matmul shapes on a GPU; read off
# whole steps it fits one source's layouts and misses another's on the same GPUs (docs/step-time.md)
GRID = {"matmul": (0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.79, 0.85),
        "flash": (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5), "matmul_dim": (0,)}  # fmt: skip


def objective(group) -> float:
    logs = [abs(math.log(r.ratio)) for r in group if r.ratio is not None]
    return statistics.median(logs) if logs else math.inf


def at(values: dict | None, gpus: tuple[str, ...], runs) -> tuple[list, list]:
    """The generation's (fitting, held-out) rows with its GPUs at these values (None: as shipped)."""
    cals = {g: replace(calibration_for(g), **values) for g in gpus} if values else None
    got = rows(cals, runs)
    return [r for r in got if r.part == "fit"], [r for r in got if r.part != "fit"]


def fitted(gpus: tuple[str, ...], runs) -> dict:
    names = list(GRID)
    points = (dict(zip(names, p)) for p in itertools.product(*GRID.values()))
    return min(points, key=lambda v: objective(at(v, gpus, runs)[0]))


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def main() -> None:
    print(f"fitting part: {', '.join(FIT)}; the rest held out")
    print(f"{'GPUs':5} {'calibration':38} {'fitting runs':>12} {'median |err|':>12} {'held-out runs':>13} "
          f"{'median |err|':>12}")  # fmt: skip
    for generation, gpus in GENERATIONS.items():
        runs = [r for r in load() if r.gpu in gpus]
        best = fitted(gpus, runs)
        shipped = calibration_for(gpus[0])
        for label, values in (("shipped", None), ("fitted", best)):
            v = values or {k: getattr(shipped, k) for k in GRID}
            text = f"{label}: " + ", ".join(f"{k} {v[k]:g}" for k in GRID)
            fit, held = (summary(part) for part in at(values, gpus, runs))
            print(f"{generation:5} {text:38} {fit['compared']:12} {pct(fit['median_abs_error']):>12} "
                  f"{held['compared']:13} {pct(held['median_abs_error']):>12}")  # fmt: skip


if __name__ == "__main__":
    main()
