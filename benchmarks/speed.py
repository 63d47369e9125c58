"""How fast memcalc starts and computes.

    python benchmarks/speed.py

1. Whole-process wall time of `memcalc estimate --params 8e9 --seq 8192` against a bare
   `python -c "import typer, rich.console, rich.table"` (goal: at most 1.3x).
2. Engine estimates per second in-process: one model, one setup, one trick set per call, all of
   memory, FLOPs and time (goal: at least 50,000/s); and the whole five-row progression per call.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

RUNS = 15


def wall(cmd: list[str]) -> float:
    """Median wall time of a command over RUNS runs, after one warm-up run."""
    # compiled bytecode, as an installed package has it (any value of PYTHONDONTWRITEBYTECODE disables it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(cmd, capture_output=True, check=True, env=env)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_second(fn, seconds: float = 2.0) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            fn()
        n += 1000
    return n / (time.perf_counter() - start)


def main() -> None:
    from memcalc.memory.estimate import Setup, estimate
    from memcalc.model.gpus import gpu
    from memcalc.model.presets import canonical_model
    from memcalc.model.tricks import PROGRESSION, parse_tricks

    baseline = wall([sys.executable, "-c", "import typer, rich.console, rich.table"])
    ours = wall([sys.executable, "-m", "memcalc", "estimate", "--params", "8e9", "--seq", "8192"])
    print(f"import typer, rich.console, rich.table: {baseline * 1e3:6.1f} ms")
    print(f"memcalc estimate --params 8e9 --seq 8192: {ours * 1e3:6.1f} ms  ({ours / baseline:.2f}x, goal <= 1.3x)")

    model, setup, h100 = canonical_model(8_000_000_000), Setup(seq_len=8192), gpu("h100-sxm")
    one = (parse_tricks("bf16,flash,ckpt"),)
    rate = per_second(lambda: estimate(model, setup, h100, one))
    print(f"engine, one trick set per estimate: {rate:,.0f} estimates/s (goal >= 50,000)")
    rate5 = per_second(lambda: estimate(model, setup, h100, PROGRESSION))
    print(f"engine, the five-row progression:   {rate5:,.0f} estimates/s")


if __name__ == "__main__":
    main()
