"""How fast memcalc answers for a mixture of experts, whole process, as a user runs it.

    python benchmarks/moe_speed.py

Each job runs in a fresh process: cold (an empty replay cache, $MEMCALC_CACHE a new folder), then warm
(the same folder, a second run). Printed: the seconds of each (median of RUNS), and the cache's size
after the cold run. Goals (issue 19): DeepSeek-V3's plan on 256 GPUs under 5 s cold and 2 s warm, its
first estimate under 1 s, Qwen3-30B-A3B's plan on 64 GPUs under 3 s, that plan's cache under 10 MB.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = 3
JOBS = [  # name, arguments
    ("deepseek-v3 plan, 256 GPUs", ["plan", "--model", "deepseek-v3", "--gpus", "256", "--seq", "4096",
                                    "--global-batch", "256"]),  # fmt: skip
    ("deepseek-v3 estimate", ["estimate", "--model", "deepseek-v3"]),
    ("qwen3-30b-a3b plan, 64 GPUs", ["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--global-batch", "64",
                                     "--seq", "4096"]),  # fmt: skip
]


def run(args: list[str], cache: Path) -> float:
    """Wall seconds of `memcalc ARGS` with its replay cache in `cache` and bytecode cached."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"MEMCALC_CACHE": str(cache)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "memcalc", *args], capture_output=True, check=True, env=env)
    return time.perf_counter() - start


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    run(["estimate", "--params", "8e9"], Path(tempfile.mkdtemp()))  # bytecode compiled before any timing
    for name, args in JOBS:
        cold, warm, stored = [], [], 0
        for _ in range(RUNS):
            cache = Path(tempfile.mkdtemp(prefix="memcalc-bench-"))
            cold.append(run(args, cache))
            stored = size(cache)
            warm.append(run(args, cache))
            shutil.rmtree(cache, ignore_errors=True)
        print(f"{name}: {statistics.median(cold):.2f} s cold, {statistics.median(warm):.2f} s warm, "
              f"cache {stored / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
