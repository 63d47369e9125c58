"""The layouts `memcalc plan` searches: every (layout, micro-batch b, micro-batches m) the stack's engine runs
for a job on N GPUs (TP inside a node, dividing the heads, KV heads and MLP width; PP by the engine's stage
split; interleaving v dividing each stage's layers; CP with flash; DP the rest; the ZeRO stages, hybrid
shard and offloads the engine runs), and each once per expert-parallel size for a mixture of experts.

May import: memcalc.model, memcalc.errors and this package's layout and engines.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from memcalc.errors import InputError
from memcalc.model.layout import Layout
from memcalc.model.shape import Model

from .engines import ENGINES
from .pipeline import stage_layers

MAX_MICRO_BATCH = 16  # sequences per micro-batch the search tries, in powers of two
MAX_VPP = 8  # virtual stages per GPU the search tries
# What the search can be told to leave out (plan --without): the features a stack did not have, as a 2021
# Megatron-LM run had no sequence parallelism (Korthikanti et al. 2022) and no distributed optimizer
WITHOUT = {"sp": "sequence parallel", "interleave": "the interleaved schedule", "cp": "context parallel",
           "zero": "ZeRO stages 1-3 (plain data parallel only)",
           "hybrid": "hybrid shard", "offload": "CPU offload"}  # fmt: skip


def check_without(without: tuple[str, ...]) -> None:
    unknown = sorted(set(without) - set(WITHOUT))
    if unknown:
        raise InputError(f"--without takes {', '.join(WITHOUT)}; got {', '.join(unknown)}")


def layouts(model: Model, gpus: int, gpus_per_node: int, seq_len: int, global_batch: int, flash: bool,
            offload: bool, engine: str = "none", without: tuple[str, ...] = ()) -> Iterator[tuple[Layout, int, int]]:  # fmt: skip
    """Every valid (layout, micro-batch b, micro-batches m) the engine runs for this job, without the
    features named in `without` (WITHOUT's keys)."""
    shape = model.shape
    offload = offload and "offload" not in without
    for tp in divisors(gpus):
        if tp > gpus_per_node or shape.n_heads % tp or shape.n_kv_heads % tp or shape.ffn % tp:
            continue
        for pp in divisors(gpus // tp):
            if not splits_layers(pp, shape.n_layers, engine):
                continue
            for cp in divisors(gpus // (tp * pp)):
                if cp > 1 and (not flash or seq_len % (2 * cp) or "cp" in without):
                    continue
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                yield from splits(tp, pp, cp, dp, shape.n_layers, seq_len, global_batch // dp, gpus_per_node, offload,
                                  engine, without)  # fmt: skip


def splits_layers(pp: int, n_layers: int, engine: str) -> bool:
    """Whether the engine's stage split gives every one of pp stages a layer."""
    try:
        stage_layers(pp, 0, 0, n_layers, ENGINES[engine].weighted_split)
    except InputError:
        return False
    return True


def interleaves(pp: int, v: int, n_layers: int, engine: str) -> bool:
    """Whether v model chunks a stage are worth trying: p·v divides the layers, or, where the engine splits as
    torchtitan does (the embedding and the head a layer each), the layers and those two (balanced chunks)."""
    if ENGINES[engine].weighted_split:  # torchtitan's split of p·v chunks: every chunk a layer
        return (n_layers % (pp * v) == 0 or (n_layers + 2) % (pp * v) == 0) and splits_layers(pp * v, n_layers, engine)
    return n_layers % (pp * v) == 0


def splits(tp: int, pp: int, cp: int, dp: int, n_layers: int, seq_len: int, per_replica: int, gpus_per_node: int,
           offload: bool, engine: str = "none", without: tuple[str, ...] = ()) -> Iterator[tuple[Layout, int, int]]:  # fmt: skip
    vpps = [1] + ([v for v in range(2, MAX_VPP + 1) if interleaves(pp, v, n_layers, engine)]
                  if pp > 1 and "interleave" not in without else [])  # fmt: skip
    sps = [False] + ([True] if tp > 1 and (seq_len // cp) % tp == 0 and "sp" not in without else [])
    batches = [b for b in (1 << k for k in range(5)) if b <= MAX_MICRO_BATCH and per_replica % b == 0]
    shardings = [(z, h, o, p) for z, h, o, p in sharding_options(tp, pp, dp * cp, gpus_per_node, offload, engine)
                 if not (z and "zero" in without) and not (h and "hybrid" in without)]  # fmt: skip
    for v in vpps:
        for sp in sps:
            # one Layout per sharding, whatever the micro-batch (building one validates it)
            built = [Layout(tp, pp, cp, dp, zero, hybrid, sp, v, opt, params, gpus_per_node)
                     for zero, hybrid, opt, params in shardings]  # fmt: skip
            for b in batches:
                m = per_replica // b
                if v > 1 and m % pp:
                    continue
                for layout in built:
                    yield layout, b, m


def sharding_options(
    tp: int, pp: int, shard_ranks: int, gpus_per_node: int, offload: bool, engine: str = "none"
) -> Iterator[tuple[int, bool, bool, bool]]:
    """(zero, hybrid, offload optimizer, offload params) that are valid for the engine and not duplicates of
    each other."""
    e = ENGINES[engine]
    stages = (0,) if shard_ranks == 1 else e.zero_with_pp if pp > 1 else e.zero
    if engine == "fsdp2" and shard_ranks > 1:
        stages = (3,)  # torchtitan shards whenever dp_shard · cp > 1
    node = gpus_per_node // tp if gpus_per_node % tp == 0 else 0
    for zero in stages:
        hybrids = [False] + ([True] if zero and 1 < node < shard_ranks and shard_ranks % node == 0 else [])
        for hybrid in hybrids:
            yield zero, hybrid, False, False
            if offload and (zero or shard_ranks == 1) and engine != "fsdp2":
                yield zero, hybrid, True, False
            if offload and zero == 3:
                yield zero, hybrid, True, True
    if offload and shard_ranks == 1 and pp == 1 and 3 in e.zero:
        yield 3, False, True, True  # one rank: ZeRO-3 only to stream the offloaded weights in (ZeRO-Infinity)


def expert_layouts(model: Model, found: Iterator[tuple[Layout, int, int]]) -> Iterator[tuple[Layout, int, int]]:
    """Each layout once per expert-parallel size for a mixture of experts: ep dividing the experts and the
    stage's tp · cp · dp GPUs (MoE parallel folding), expert TP 1; a dense model's layouts as they are.
    With tp > 1 MoE layers need sequence parallel (check_experts)."""
    shape = model.shape
    if not shape.is_moe:
        yield from found
        return
    for layout, b, m in found:
        if layout.tp > 1 and not layout.sp:  # check_experts would refuse it
            continue
        for ep in divisors(layout.tp * layout.cp * layout.dp):
            if shape.n_experts % ep == 0:
                yield replace(layout, ep=ep), b, m


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
