"""How fast memcalc starts and computes.

    python benchmarks/speed.py

1. Whole-process wall time of `memcalc estimate --params 8e9 --seq 8192` against a bare
   `python -c "import typer, rich.console, rich.table"` (goal: at most 1.3x), with compiled bytecode as an
   installed package has it. The two run in turn, RUNS times each, so that both see the same load on a
   shared machine; the medians are compared.
2. Engine estimates per second in-process, one trick set (bf16+flash+ckpt) per call, all of memory, FLOPs
   and time (goal: at least 50,000/s on both), the best of WINDOWS half-second windows (what the engine
   does, less what other work on the machine takes from it):
   - the default 8B job (`--params 8e9 --seq 8192`), the same inputs every call;
   - llama3-70b with inputs that differ call to call: a cycle of 64 sequence lengths x 128 micro-batches,
     8,192 setups, each asked once per cycle, more than any cache of the engine holds (the largest keeps
     4,096 entries), so that nothing keyed on a whole job answers: every estimate is computed. What does
     not depend on the micro-batch is kept per sequence length (the kernels' FLOPs per token,
     memcalc.exact.kernels.step_flops: tracing a new length is a simulation, milliseconds, not an
     estimate); it is traced once before the clock starts.
   And the whole five-row progression per call on the 8B job.
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import time

RUNS = 15
WINDOWS = 6
SEQS = tuple(range(2048, 2048 + 64 * 512, 512))  # 64 sequence lengths, 2k to 34k
MICRO_BATCHES = tuple(range(1, 129))


def walls(*cmds: list[str]) -> list[float]:
    """Median wall time of each command over RUNS runs, the commands taking turns, after a warm-up run."""
    # compiled bytecode, as an installed package has it (any value of PYTHONDONTWRITEBYTECODE disables it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times: list[list[float]] = [[] for _ in cmds]
    for i in range(RUNS + 1):
        for cmd, kept in zip(cmds, times):
            start = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True, env=env)
            if i:
                kept.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def per_second(fn, seconds: float = 0.5) -> float:
    """Calls of fn per second: the best of WINDOWS windows of `seconds` each."""
    best = 0.0
    for _ in range(WINDOWS):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(1000):
                fn()
            n += 1000
        best = max(best, n / (time.perf_counter() - start))
    return best


def cycling(model, gpu, tricks) -> tuple:
    """estimate() over the llama3-70b cycle: every (micro-batch, sequence) pair once, the sequence changing
    every call; each sequence length traced once beforehand."""
    from memcalc.memory.estimate import Setup, estimate

    setups = [Setup(seq_len=s, micro_batch=b) for b in MICRO_BATCHES for s in SEQS]
    for setup in setups[: len(SEQS)]:
        estimate(model, setup, gpu, tricks)
    ring = itertools.cycle(setups)
    return len(setups), lambda: estimate(model, next(ring), gpu, tricks)


def main() -> None:
    from memcalc.memory.estimate import Setup, estimate
    from memcalc.model.gpus import gpu
    from memcalc.model.presets import canonical_model, preset_model
    from memcalc.model.tricks import PROGRESSION, parse_tricks

    baseline, ours = walls([sys.executable, "-c", "import typer, rich.console, rich.table"],
                           [sys.executable, "-m", "memcalc", "estimate", "--params", "8e9", "--seq", "8192"])  # fmt: skip
    print(f"import typer, rich.console, rich.table: {baseline * 1e3:6.1f} ms")
    print(f"memcalc estimate --params 8e9 --seq 8192: {ours * 1e3:6.1f} ms  ({ours / baseline:.2f}x, goal <= 1.3x)")

    model, setup, h100 = canonical_model(8_000_000_000), Setup(seq_len=8192), gpu("h100-sxm")
    one = (parse_tricks("bf16,flash,ckpt"),)
    rate = per_second(lambda: estimate(model, setup, h100, one))
    print(f"engine, one trick set per estimate: {rate:,.0f} estimates/s (goal >= 50,000)")
    n, call = cycling(preset_model("llama3-70b"), h100, one)
    rate70 = per_second(call)
    print(f"engine, llama3-70b, {n:,} setups in a cycle: {rate70:,.0f} estimates/s (goal >= 50,000)")
    rate5 = per_second(lambda: estimate(model, setup, h100, PROGRESSION))
    print(f"engine, the five-row progression:   {rate5:,.0f} estimates/s")


if __name__ == "__main__":
    main()
