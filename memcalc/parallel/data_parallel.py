"""The data-parallel and offload traffic of one GPU per step: ZeRO's gradient and weight collectives over
dp × cp, hybrid shard's gradient all-reduce across nodes (dp_comm), the share of the gradients an engine
reduces after the last backward (gradient_tail; FSDP2's largest unit, unit_fraction), and offload's PCIe
traffic and CPU Adam time (offload_comm). memcalc.parallel.comm adds them to the step of a layout."""

from __future__ import annotations

from functools import lru_cache

from memcalc.model.layout import Layout
from memcalc.model.shape import ModelShape

from .engines import DEEPSPEED_DEFAULTS, megatron_bucket_size, reshards_after_forward
from .links import Assumptions, Comm, Fabric, MicroBatch, link_for, ring, send
from .params import stage_shape_params, tp_layer_params


@lru_cache(maxsize=1024)
def unit_fraction(shape: ModelShape, tp: int, pp: int) -> float:
    """The share of a stage's weights in its largest unit (a block, or the vocab-split embedding): what
    FSDP2 gathers first and reduces last, with no compute left to hide behind."""
    vocab = -(-shape.vocab // tp) * shape.hidden
    whole = max(stage_shape_params(shape, tp, pp, 0), 1)
    return min(1.0, max(tp_layer_params(shape, tp), vocab) / whole)


def dp_comm(layout: Layout, params: int, w: int, gw: int, m: int, fabric: Fabric, assume: Assumptions,
            mb: MicroBatch, engine: str = "none", unit: float = 0.0,
            gathered: int | None = None) -> list[Comm]:  # fmt: skip
    """Gradient and weight traffic over dp × cp, P the weights on one GPU (Rajbhandari et al. 2019, sec. 7);
    gradients of gw bytes (the engine's reduce dtype), weights of w:
      ZeRO 0   all-reduce the gradients once per step (2Ψ)
      ZeRO 1   reduce-scatter the gradients, all-gather the updated weights, once per step (2Ψ)
      ZeRO 2   the reduce-scatter every micro-batch (gradients live sharded), the all-gather once
      ZeRO 3   all-gather the weights in forward and again in backward, reduce-scatter the gradients,
               every micro-batch (3Ψ per micro-batch)
    FSDP2 without resharding after forward skips the backward all-gather; with pipeline parallel
    (torch.distributed.pipelining: requires_gradient_sync and reshard_after_backward off until the last
    micro-batch) it gathers once and reduce-scatters once per step, after the last backward.
    Hybrid shard: these inside the node, then an all-reduce of each gradient shard across nodes.
    Windows: gradient traffic hides behind backward, weight gathers behind forward; an engine's last
    gradient bucket stays exposed (tail): Megatron-LM's bucket_size, DeepSpeed's reduce_bucket_size,
    FSDP2's last unit (and its first all-gather). gathered: the bytes ZeRO-3 all-gathers where they are not
    P·w (LoRA: the frozen base gathered beside the P adapters that reduce their gradients).
    """
    n, z, d = layout.shard_ranks, layout.zero, assume.overlap_dp
    if n == 1:
        return []
    size, grads, g = params * w, params * gw, "dp×cp"
    tail = gradient_tail(engine, params, n, unit)
    if z == 0:
        link = link_for(fabric, layout.tp * n, layout.gpus_per_node, n)
        return [ring("DP gradient all-reduce", g, n, link, 1, 2, grads, f"2(n−1)/n · P·{gw}", assume, d,
                     mb.backward_window, tail)]  # fmt: skip
    k = layout.shard_group
    link = link_for(fabric, layout.tp * k, layout.gpus_per_node, k)
    each, each_g = f"(n−1)/n · P·{w}", f"(n−1)/n · P·{gw}"
    if z == 3 and engine == "fsdp2" and layout.pp > 1:
        out = [
            ring("FSDP2 weight all-gather, first micro-batch", g, k, link, 1, 1, size, each, assume, d,
                 mb.forward, unit),
            ring("FSDP2 gradient reduce-scatter after the last backward", g, k, link, 1, 1, grads, each_g, assume,
                 d, 0.0),
        ]  # fmt: skip
    elif z == 3:
        size = size if gathered is None else gathered
        out = [ring("ZeRO-3 weight all-gather, forward", g, k, link, m, 1, size, "m · " + each, assume, d,
                    m * mb.forward, unit if engine == "fsdp2" else 0.0)]  # fmt: skip
        if engine != "fsdp2" or reshards_after_forward(layout):
            out.append(ring("ZeRO-3 weight all-gather, backward", g, k, link, m, 1, size, "m · " + each, assume, d,
                            m * mb.backward_window / 2))  # fmt: skip
        out.append(ring("ZeRO-3 gradient reduce-scatter", g, k, link, m, 1, grads, "m · " + each_g, assume, d,
                        m * mb.backward_window / 2, tail))  # fmt: skip
    else:
        calls = m if z == 2 else 1
        scatter = ("m · " if z == 2 else "") + each_g
        out = [
            ring(f"ZeRO-{z} gradient reduce-scatter", g, k, link, calls, 1, grads, scatter, assume, d,
                 calls * mb.backward_window, tail),
            ring(f"ZeRO-{z} weight all-gather", g, k, link, 1, 1, size, each, assume, d, mb.forward),
        ]  # fmt: skip
    if layout.hybrid and n > k:
        calls = 1 if z == 1 or (engine == "fsdp2" and layout.pp > 1) else m
        formula = ("m · " if calls > 1 else "") + f"2(r−1)/r · P·{gw}/k"
        out.append(ring("hybrid: gradient shard all-reduce across nodes", g, n // k, fabric.inter, calls, 2,
                        grads // k, formula, assume, d, calls * mb.backward_window))  # fmt: skip
    return out



def tied_embedding_comm(layout: Layout, shape: ModelShape, gw: int, engine: str, fabric: Fabric,
                        assume: Assumptions) -> list[Comm]:  # fmt: skip
    """Megatron-LM's pipeline keeps the tied word embedding on the first stage and its copy on the last, and
    all-reduces their gradients between the two once per step, after the data-parallel reduction and before
    the optimizer, nothing left to hide behind (megatron/core/distributed/finalize_model_grads.py
    _allreduce_word_embedding_grads @ d98e8a64ddf34856e74b24714e3bedb2f5a39553): vocab/t · h gradients, two
    ranks a whole pipeline apart."""
    if engine != "megatron" or layout.pp == 1 or not shape.tied_embeddings:
        return []
    grads = -(-shape.vocab // layout.tp) * shape.hidden * gw
    link = link_for(fabric, layout.tp * layout.cp * layout.dp * layout.pp, layout.gpus_per_node)
    return [ring("tied embedding gradient all-reduce, first and last stage", "pp", 2, link, 1, 2, grads,
                 f"2(n−1)/n · V/t·h·{gw}, n = 2", assume, 0.0, 0.0)]  # fmt: skip

def gradient_tail(engine: str, params: int, ranks: int, unit: float) -> float:
    """The share of the gradients reduced after the last backward compute: Megatron-LM's last bucket
    (megatron_bucket_size parameters), DeepSpeed's last reduce bucket (5e8 elements, deepspeed/runtime/zero/
    config.py), FSDP2's last unit; memcalc's generic layouts assume all of it overlaps."""
    if engine == "megatron":
        return min(1.0, megatron_bucket_size(ranks) / params)
    if engine == "deepspeed":
        return min(1.0, DEEPSPEED_DEFAULTS.reduce_bucket_size / params)
    if engine == "fsdp2":
        return unit
    return 0.0


def offload_comm(layout: Layout, params: int, w: int, gw: int, m: int, fabric: Fabric, assume: Assumptions,
                 mb: MicroBatch) -> tuple[list[Comm], float]:  # fmt: skip
    """PCIe traffic and CPU Adam time of offload (Ren et al. 2021, ZeRO-Offload; FSDP CPUOffload).

    Optimizer offload: once per step the gradient shard goes to the host and the updated weights come back.
    Parameter offload: every micro-batch the weight shard comes up for forward and again for backward,
    and the gradient shard goes down.
    """
    if not layout.offload_optimizer:
        return [], 0.0
    shard = -(-params // layout.shard_group)  # parameters this GPU updates
    size, grads, link, o = shard * w, shard * gw, fabric.host, assume.overlap_offload
    if layout.offload_params:
        out = [
            send("weights host→GPU, forward and backward", "host", 1, link, 2 * m, 2 * m * size, f"2m · P/n·{w}",
                 assume, o, m * mb.seconds),
            send("gradients GPU→host", "host", 1, link, m, m * grads, f"m · P/n·{gw}", assume, o,
                 m * mb.backward_window),
        ]  # fmt: skip
    else:
        out = [
            send("gradients GPU→host", "host", 1, link, 1, grads, f"P/n·{gw}", assume, o, mb.backward_window),
            send("updated weights host→GPU", "host", 1, link, 1, size, f"P/n·{w}", assume, o, mb.forward),
        ]
    return out, cpu_adam_seconds(layout, params, assume)


def cpu_adam_seconds(layout: Layout, params: int, assume: Assumptions) -> float:
    """The CPU's Adam over this GPU's shard of `params` under optimizer offload, on the step's critical path
    (no delayed parameter update); the node's GPUs share one host (Ren et al. 2021)."""
    shard = -(-params // layout.shard_group)
    return shard / (assume.cpu_adam_params_per_s / layout.gpus_per_node)
