"""How fast `memcalc plan` searches.

    python benchmarks/plan_speed.py

For a few jobs: the layouts searched, and the wall time of the whole search (goal: under one second),
with the engine's caches cleared before each run so that every run starts cold.
"""

from __future__ import annotations

import statistics
import time

RUNS = 5
JOBS = [  # model, GPU, GPUs, seq, global batch
    ("llama3-70b", "h100-sxm", 64, 8192, 512),  # the job
    ("gpt3-175b", "a100-80gb", 64, 2048, 64),  # Korthikanti et al. 2022, Table 5
    ("llama3.1-405b", "h100-sxm", 1024, 8192, 2048),
    ("llama3-8b", "h100-sxm", 8, 8192, 64),
]


def clear_caches() -> None:
    """Every cache the search fills, the roofline's traces included: each run starts cold."""
    from memcalc.exact import kernels
    from memcalc.model import moe_mla
    from memcalc.parallel import activations, buffers, comm, data_parallel, params, pipeline
    from memcalc.time import stages

    for fn in (params.gpu_params, params.sharded_state, activations.layer_activations, buffers.zero3_buffers,
               buffers.cp_buffers, buffers.logits_terms, pipeline.stage_layers, pipeline.moe_split, comm.tp_shape,
               data_parallel.unit_fraction, comm.matmul_weights, kernels.step_flops, moe_mla.moe_layer_count,
               stages.kernel_parts, stages.kernel_table, stages.stage_kernels, stages.moe_kernels, stages.moe_parts,
               stages.block_kernels_of_one, stages.block_lower_bound):  # fmt: skip
        fn.cache_clear()
    kernels.TRACES.clear()


def main() -> None:
    from memcalc.model.gpus import gpu
    from memcalc.model.presets import preset_model
    from memcalc.parallel.plan import plan

    for name, key, gpus, seq, batch in JOBS:
        model, card = preset_model(name), gpu(key)
        times = []
        for _ in range(RUNS):
            clear_caches()
            start = time.perf_counter()
            result = plan(model, card, gpus, seq, batch)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        rate = result.searched / t
        print(f"{name} on {gpus} x {key}, seq {seq}, batch {batch}: {result.searched:,} layouts, "
              f"{result.fitting:,} fit, {t * 1e3:.0f} ms ({rate:,.0f} layouts/s; goal < 1 s)")  # fmt: skip


if __name__ == "__main__":
    main()
