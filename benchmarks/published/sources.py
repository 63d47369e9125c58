"""What each source of benchmarks/published/ states and what it leaves unsaid, as report.py reads them: the
split into a fitting and a held-out part, the memcalc engine standing in for each stack, what a stack did
that its source does not say (each with its reason), the FP8 recipes, and how each source counts the FLOPs
its TFLOP/s or MFU stands on."""

from __future__ import annotations

from corpus import Run

# Chosen by source before any fit: Megatron on A100 and H100, FSDP on A100 and H100 (llm-foundry), so that
# each stack and generation the held-out part holds is also seen here. Everything else is held out.
FIT = ("narayanan2021", "megatron_lm_readme", "llm_foundry")
HELD_OUT = ("korthikanti2022", "megatron_lm_readme_2020", "torchtitan_performance", "torchtitan_performance_2024_08",
            "torchtitan_asynctp_h100", "torchtitan_h200_trainy", "llama3", "bloom", "opt", "deepseek_v3")  # fmt: skip
# The memcalc engine that shards as the run's stack did: Megatron-DeepSpeed (BLOOM) ran ZeRO-1 beside Megatron's
# TP and PP; llm-foundry is PyTorch FSDP (FULL_SHARD as FSDP2; SHARD_GRAD_OP, ZeRO-2, as DeepSpeed's engine runs it).
STACK = {"megatron": "megatron", "megatron-deepspeed": "megatron", "deepspeed": "deepspeed", "torchtitan": "fsdp2",
         "llm-foundry": "fsdp2"}  # fmt: skip
# What a source leaves unsaid but its stack did at the time, with the reason. Unlisted: no flash, no SP, v = 1.
TORCHTITAN = {"flash": True, "sequence_parallel": True,  # SDPA's flash backend; TP always with SP (parallelize_llama)
              "seq": 8192,  # train_configs/llama3_{8b,70b,405b}.toml seq_len = 8192 at each commit these pages cite
              "selective": "selective-op"}  # the same files: selective_ac_option = 'op', torchtitan's per-op SAC
SOURCE_DEFAULTS = {
    # Megatron-Core r0.8 runs attention in Transformer Engine's fused (flash) kernel, SP on with TP; the README
    # says TP (--tp-comm-overlap) and PP communication overlap with compute, and names --overlap-param-gather,
    # which runs only with the distributed optimizer (megatron/training/arguments.py @ f2e5db4: "assert
    # args.use_distributed_optimizer"): ZeRO-1
    "megatron_lm_readme": {"flash": True, "sequence_parallel": True, "zero": 1,
                           "assume": {"overlap_tp": 1.0, "overlap_pp": 1.0}},
    # Megatron-LM in 2020 reduces gradients with its `local` DDP after the whole forward-backward: train_step
    # calls model.allreduce_params() once backward_step has returned (megatron/training.py @ 50a4b5f), nothing
    # overlaps. At the README's commit (5281919) it has --fp16 and no bf16 (megatron/arguments.py), and every
    # GPT-2 example script passes --checkpoint-activations (examples/pretrain_gpt2*.sh): without it none of the
    # twelve jobs fits (memcalc: 43-80 GB a GPU on 32 and 40 GB cards; with it 21-28 GB)
    "megatron_lm_readme_2020": {"assume": {"overlap_dp": 0.0}, "recompute": "full", "precision": "fp16"},
    "torchtitan_performance": TORCHTITAN,
    "torchtitan_performance_2024_08": TORCHTITAN,
    "torchtitan_asynctp_h100": TORCHTITAN,
    "torchtitan_h200_trainy": TORCHTITAN,
    "llm_foundry": {"flash": True},  # its tables are of attn_impl flash (or triton)
    # Megatron-DeepSpeed pipelines through DeepSpeed's PipelineEngine: its TrainSchedule reduces the gradients
    # over the data-parallel ranks after the last micro-batch's backward, then steps (ReduceGrads, OptimizerStep:
    # microsoft/DeepSpeed deepspeed/runtime/pipe/schedule.py @ 077e6740178eba4ccff1b3ea9a7981578d3d42e4)
    # and its cluster (the source's README): 4 Omni-Path links of 100 Gb/s per node of 8 GPUs, 6.25 GB/s a GPU,
    # on which NCCL reached 40.5 Gb/s of bus bandwidth, 40.5% of a link: a 4 GB all-reduce over 32 ranks on 4 of
    # the run's gpu_p5 nodes, NCCL 2.10.3, both of its channels on one link into and one out of each node
    # (experiments/bandwidth/all_reduce_bench-a100-n4.txt @ 358e3c8fec24285ccefef0e1ad6a77d189fd8933; the
    # folder's README: "an issue with nccl that doesn't fully utilize Intel OPA full bandwidth")
    "bloom": {"assume": {"overlap_dp": 0.0, "inter_node_gb_per_s": 4 * 12.5 / 8, "inter_node_efficiency": 40.5 / 100}},
    # Llama 3 (Dubey et al. 2024, sec. 3.3.2): TP with SP, flash attention, PyTorch FSDP that keeps the weights
    # gathered from forward to backward, an interleaved pipeline schedule with v not given and one layer fewer
    # on the first and last stages: torchtitan's FSDP2 engine (Meta's public form of that stack) runs the same,
    # FSDP2 not resharding after forward under PP (reshards_after_forward) and splitting 126 layers unevenly
    "llama3": {"flash": True, "sequence_parallel": True, "stack": "fsdp2", "interleaved": True},
    # Narayanan et al. 2021 sec. 5.1: Table 1 runs the interleaved schedule, v not given: the fastest v is taken;
    # eq. 3, by which every TFLOP/s of the paper (Tables 1 and 2) is counted, assumes full recompute
    "narayanan2021": {"interleaved": True, "recompute": "full"},
}
RECOMPUTE = {None: "none", "none": "none", "full": "full", "selective": "selective", "selective-op": "op"}
GENERATION = {"v100-16gb": "V100", "v100-32gb": "V100", "a100-40gb": "A100", "a100-80gb": "A100", "h100-sxm": "H100",
              "h100-pcie": "H100", "h100-hbm2e": "H100", "h800": "H100", "h200": "H200", "b200": "B200"}  # fmt: skip

# torchao's float8 recipes (memcalc's fp8, fp8:rowwise); "fp8-torchao" unqualified is torchtitan's default,
# tensorwise (torchtitan/components/quantization/float8.py: recipe_name None -> Float8LinearConfig's defaults).
# Transformer Engine's delayed scaling (fp8:te): "fp8-te" unqualified is llm-foundry's amp_fp8, which is Composer's
# DelayedScaling (composer/core/precision.py @ v0.16.3: Format.HYBRID, amax_history_len 16, amax_compute_algo max)
FP8 = {"fp8-torchao": "tensorwise", "fp8-torchao-tensorwise": "tensorwise", "fp8-torchao-rowwise": "rowwise",
       "fp8-te": "te", "fp8-te-delayed": "te"}  # fmt: skip


# --- the FLOPs per token each source's figure counts ----------------------------------------------------


def megatron_flops_per_token(run: Run) -> float:
    """Megatron-Core's num_floating_point_operations / tokens (NVIDIA/Megatron-LM megatron/training/training.py
    lines 73-108 @ f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4): 12·L·h²·((1 + g/a + s/h)·(a·d/h) + f/h·k·(3/2 if
    SwiGLU) + V/(2·L·h)); the attention term s/h is non-causal."""
    L, h, s, v = run.layers, run.hidden, run.seq, run.vocab
    a, g, f = run.heads, run.kv_heads or run.heads, run.ffn or 4 * run.hidden
    gated = 1.5 if run.gated_mlp else 1.0
    return 12 * L * h * h * ((1 + g / a + s / h) * 1.0 + f / h * gated + v / (2 * L * h))


def narayanan_flops_per_token(run: Run) -> float:
    """Narayanan et al. 2021 eq. 3 / (B·s): 96·l·h²·(1 + s/6h + V/16lh), recompute's forward included."""
    L, h, s, v = run.layers, run.hidden, run.seq, run.vocab
    return 96 * L * h * h * (1 + s / (6 * h) + v / (16 * L * h))


def korthikanti_model_flops_per_token(run: Run) -> float:
    """Korthikanti et al. 2022 sec. 6.3: model FLOPs 72·L·h²·(1 + s/6h + v/12hL) per token."""
    L, h, s, v = run.layers, run.hidden, run.seq, run.vocab
    return 72 * L * h * h * (1 + s / (6 * h) + v / (12 * h * L))


def palm_flops_per_token(run: Run) -> float:
    """Chowdhery et al. 2022 (PaLM) App. B: 6N + 12·L·h·s (model FLOPs, non-causal attention)."""
    return 6 * run.params + 12 * run.layers * run.hidden * run.seq


def bloom_flops_per_token(run: Run) -> float:
    """bigscience math/README.md "Calculate TFLOPs": model_size · 4 · 2 per token (recompute counted)."""
    return 8 * run.params


# How each source's TFLOP/s or MFU becomes FLOPs per token; where a source states none, it is not converted.
CONVENTION = {"narayanan2021": narayanan_flops_per_token, "megatron_lm_readme": megatron_flops_per_token,
              "korthikanti2022": korthikanti_model_flops_per_token, "llama3": palm_flops_per_token,
              "bloom": bloom_flops_per_token}  # fmt: skip
