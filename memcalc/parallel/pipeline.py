"""Pipeline parallel: the split of the transformer layers into stages and what the schedule keeps in flight.

Pipeline stages hold L/p layers each when p divides L; otherwise (and always for FSDP2, as torchtitan
splits) the embedding and the head count as one layer each and the first and last stages take one layer
fewer (torchtitan/distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part); first_layers and
last_layers set the end stages as Megatron-LM's --decoder-first/last-pipeline-num-layers do.
A mixture of experts splits its layers the same way, consecutive layers a stage, its dense and MoE layers
counted apart (moe_split). Under 1F1B, and interleaved with v virtual stages, a stage keeps the activations of the
micro-batches its warm-up ran (held_layers); the bubble is the pipeline's idle share (bubble_fraction).
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.errors import InputError
from memcalc.model.layout import Layout
from memcalc.model.shape import ModelShape, is_moe_layer

from .engines import ENGINES


def layers_per_stage(layout: Layout, n_layers: int, engine: str = "none") -> tuple[int, ...]:
    """The transformer layers on each pipeline stage's GPU, first to last: under the interleaved schedule the
    sum of its v model chunks (chunk_layers)."""
    if layout.vpp == 1:
        return stage_layers(layout.pp, layout.first_layers, layout.last_layers, n_layers, ENGINES[engine].weighted_split)
    chunks, p = chunk_layers(layout, n_layers, engine), layout.pp
    return tuple(sum(chunks[i::p]) for i in range(p))


def chunk_layers(layout: Layout, n_layers: int, engine: str = "none") -> tuple[int, ...]:
    """The layers of each of the p·v model chunks of the interleaved schedule, chunk j on stage j mod p
    (Narayanan et al. 2021, sec. 2.2). Megatron-LM needs p·v to divide the layers (L/(p·v) each); torchtitan
    splits into p·v stages as it splits into p, the embedding and the head weighed as a layer each
    (_generate_llm_fqn_per_model_part with num_stages = p·v): Llama 3.1 405B's 126 layers go 3, 4, ..., 4, 3
    over PP 16 x v 2 (torchtitan/distributed/pipeline_parallel.py pipeline_llm, num_virtual_stages)."""
    p, v = layout.pp, layout.vpp
    if layout.first_layers or layout.last_layers:
        raise InputError("uneven first and last stages (--pp-layers) run the 1F1B schedule here, not the interleaved "
                         "one: drop --vpp or --pp-layers")  # fmt: skip
    if ENGINES[engine].weighted_split:
        return stage_layers(p * v, 0, 0, n_layers, True)
    if n_layers % (p * v):
        raise InputError(f"pipeline {p} x virtual stages {v} must divide the {n_layers} layers (Megatron-LM's "
                         "interleaved schedule; torchtitan's, --stack fsdp2, splits a dense model's unevenly)")  # fmt: skip
    return (n_layers // (p * v),) * (p * v)


@lru_cache(maxsize=4096)
def stage_layers(pp: int, first: int, last: int, n_layers: int, weighted: bool = False) -> tuple[int, ...]:
    """Layers per stage. first/last given: Megatron-LM's uneven split, the middle stages sharing the rest
    evenly (megatron/core/transformer/transformer_block.py get_num_layers_to_build). Else L/p each when p
    divides L and the split is not weighted; else torchtitan's: the embedding and the head weigh one layer
    each, L + 2 are dealt out evenly, the first stages taking the remainder, and the end stages give up one
    layer each for them (torchtitan/distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part)."""
    if pp == 1:
        return (n_layers,)
    if first or last:
        return megatron_split(pp, first, last, n_layers)
    if not weighted and n_layers % pp == 0:
        return (n_layers // pp,) * pp
    base, extra = divmod(n_layers + 2, pp)
    counts = [base + (i < extra) - (i == 0) - (i == pp - 1) for i in range(pp)]
    if min(counts) < 1:
        raise InputError(f"pipeline {pp} leaves a stage without layers: {n_layers} layers, with the embedding and "
                         f"the head counted as one layer each, give fewer than 2 per stage")  # fmt: skip
    return tuple(counts)


def megatron_split(pp: int, first: int, last: int, n_layers: int) -> tuple[int, ...]:
    """--decoder-first-pipeline-num-layers F, --decoder-last-pipeline-num-layers L: the stages between share
    what is left evenly (Megatron-LM asserts it divides)."""
    ends = (first > 0) + (last > 0)
    rest, middle = n_layers - first - last, pp - ends
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest // middle == 0)):
        given = " and ".join(x for x in (f"{first} layers on the first stage" if first else "",
                                         f"{last} on the last" if last else "") if x)  # fmt: skip
        raise InputError(f"{given}: the other {middle} stages cannot share the remaining {rest} of the {n_layers} "
                         "layers evenly (Megatron-LM's uneven pipeline split)")  # fmt: skip
    each = rest // middle if middle else 0
    return tuple(first if i == 0 and first else last if i == pp - 1 and last else each for i in range(pp))


@lru_cache(maxsize=4096)
def moe_split(shape: ModelShape, pp: int, stage: int) -> tuple[int, int]:
    """(dense layers, MoE layers) of one pipeline stage's consecutive layers: L/p each, or where p does not
    divide L the split stage_layers deals (DeepSeek-V3's 61 layers over PP 16: 3, 4, ..., 4, 2)."""
    counts = stage_layers(pp, 0, 0, shape.n_layers)
    start = sum(counts[:stage])
    moe = sum(is_moe_layer(shape, i) for i in range(start, start + counts[stage]))
    return counts[stage] - moe, moe


def held_layers(layout: Layout, stage: int, micro_batches: int, n_layers: int, layers: int | None = None,
                engine: str = "none") -> int:  # fmt: skip
    """Layer-micro-batches whose activations a stage keeps at its peak (Korthikanti et al. 2022, sec. 4.2.3).

    1F1B: stage i runs min(p − i, m) forwards before its first backward, so stage 0 holds p micro-batches
    of its L/p layers: L layers' worth, whatever p. Interleaved with v virtual stages: Megatron-LM's
    warm-up of 2(p − i − 1) + (v − 1)·p chunk forwards + 1, the k-th on the stage's chunk (k // p) mod v
    (schedules.py get_model_chunk_id: p micro-batches a chunk, in turn); with L/(p·v) layers a chunk, stage
    0 holds L·(1 + (p − 1)/(p·v)) layers' worth, Korthikanti's interleaving factor. layers: this stage's
    (1F1B); interleaved, each chunk's own (chunk_layers, by the engine's split).
    """
    p, v, m = layout.pp, layout.vpp, micro_batches
    if v == 1:
        return min(p - stage, m) * (n_layers // p if layers is None else layers)
    mine = chunk_layers(layout, n_layers, engine)[stage::p]
    forwards = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    return sum(mine[(k // p) % v] for k in range(forwards))


def bubble_fraction(layout: Layout, micro_batches: int) -> float:
    """Pipeline idle over busy time: (p − 1)/m, and (p − 1)/(v·m) interleaved (Narayanan et al. 2021, sec. 2.2)."""
    return (layout.pp - 1) / (layout.vpp * micro_batches)
