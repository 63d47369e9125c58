"""Fit the roofline's matmul shape parameter (calibration matmul_dim) per GPU generation on the fitting part
of the published corpus only; print the error of both parts without it and at the fitted value.

    python benchmarks/published/fit.py

`matmul` stays as measured (bf16 8192³ on one H200, h200.json): the fit learns only how much less a
smaller, thinner or TP-split matmul sustains, d / (d + matmul_dim) relative to 8192³ (d the harmonic mean
of its dimensions). The objective is the median |log(predicted / published)| over the generation's fitting
runs; the held-out runs are never used by the fit, only printed beside it. A value is worth shipping in
memcalc/time/calibrations/ only if the held-out error falls too (docs/step-time.md says what was found).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import FIT, load, rows, summary  # noqa: E402

from memcalc.time.calibration import calibration_for  # noqa: E402

GENERATIONS = {"A100": ("a100-40gb", "a100-80gb"), "H100": ("h100-sxm", "h100-hbm2e", "h800")}
GRID = (0, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def objective(group) -> float:
    logs = [abs(math.log(r.ratio)) for r in group if r.ratio is not None]
    return statistics.median(logs) if logs else math.inf


def at(dim: float, gpus: tuple[str, ...], runs) -> tuple[list, list]:
    """The generation's (fitting, held-out) rows with every GPU of it at matmul_dim = dim."""
    got = rows({g: replace(calibration_for(g), matmul_dim=float(dim)) for g in gpus}, runs)
    return [r for r in got if r.part == "fit"], [r for r in got if r.part != "fit"]


def main() -> None:
    print(f"fitting part: {', '.join(FIT)}; the rest held out")
    print(f"{'GPUs':5} {'matmul_dim':>10} {'fitting runs':>12} {'median |err|':>12} {'held-out runs':>13} {'median |err|':>12}")
    for generation, gpus in GENERATIONS.items():
        runs = [r for r in load() if r.gpu in gpus]
        best = min(GRID, key=lambda d: objective(at(d, gpus, runs)[0]))
        for dim in sorted({0, best}):
            fit, held = (summary(part) for part in at(dim, gpus, runs))
            print(f"{generation:5} {dim:10} {fit['compared']:12} {pct(fit['median_abs_error']):>12} {held['compared']:13} "
                  f"{pct(held['median_abs_error']):>12}{'  <- fitted' if dim == best else ''}")  # fmt: skip


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


if __name__ == "__main__":
    main()
