"""Expert parallel's traffic and imbalance on one GPU of a layout: the all-to-alls of a mixture of
experts, the routed experts' gradients over their expert-data-parallel group, and the extra work the
busiest GPU's experts receive (memcalc.model.moe.routed_tokens)."""

from __future__ import annotations

from functools import lru_cache

from memcalc.memory.estimate import Setup
from memcalc.model.layout import Layout
from memcalc.model.moe import routed_tokens
from memcalc.model.shape import Model, ModelShape, is_moe_layer

from .links import Assumptions, Comm, Fabric, MicroBatch, exposed, link_for, ring
from .pipeline import stage_layers


def moe_tokens(model: Model, setup: Setup, layout: Layout) -> tuple[int, int]:
    """(T, R): the tokens one GPU routes per MoE layer and micro-batch ((s/c)·b, split over tp by sequence
    parallel), and those its experts receive from the ep group (memcalc.model.moe.routed_tokens)."""
    T = setup.seq_len // layout.cp * setup.micro_batch // (layout.tp if layout.sp else 1)
    return T, routed_tokens(model.shape, T, setup.routing, layout.ep)


def stage_moe_layers(model: Model, layout: Layout) -> int:
    """MoE layers on the busiest stage (the last, with the MTP module's block)."""
    return last_stage_moe_layers(model.shape, layout.pp)


@lru_cache(maxsize=1024)
def last_stage_moe_layers(shape: ModelShape, pp: int) -> int:
    """MoE layers among the last of pp stages' blocks (pipeline.stage_layers), and the MTP module's if it is one."""
    first = shape.n_layers - stage_layers(pp, 0, 0, shape.n_layers)[-1]
    mtp = shape.mtp_layers if is_moe_layer(shape, shape.n_layers - 1) else 0
    return sum(is_moe_layer(shape, i) for i in range(first, shape.n_layers)) + mtp


def busiest_experts_flops(model: Model, setup: Setup, layout: Layout) -> int:
    """The expert FLOPs (forward + backward) the busiest GPU runs beyond its balanced share, per micro-batch:
    R − T·k extra routed tokens through a SwiGLU expert (6·3·h·f_e each), in each MoE layer of its stage."""
    shape = model.shape
    if not shape.is_moe:
        return 0
    T, R = moe_tokens(model, setup, layout)
    per_token = 6 * (3 if shape.gated_mlp else 2) * shape.hidden * shape.routed_ffn
    return max(0, R - T * shape.experts_per_token) * per_token * stage_moe_layers(model, layout)


def ep_comm(layout, model, setup, tricks, fabric, assume, mb) -> list[Comm]:
    """Expert parallel's all-to-alls (Lepikhin et al. 2021; Megatron-LM MoEAlltoAllTokenDispatcher): per MoE
    layer, the dispatch and the combine in forward, both again for the gradients in backward, and the forward's
    again under full recompute. Each sends this GPU's T·k token copies bound for other GPUs, (ep − 1)/ep of them,
    and receives the R its experts get likewise: the busier direction sets the time. An EP group of etp · ep
    consecutive ranks wider than a node crosses InfiniBand for the share of its peers outside the node.
    With expert TP, each expert's tokens are all-gathered and its output reduce-scattered over etp. Per micro-batch."""
    ep, etp = layout.ep, layout.etp
    if ep == 1 and etp == 1:
        return []
    T, R = moe_tokens(model, setup, layout)
    k, h, act = model.shape.experts_per_token, model.shape.hidden, tricks.act_bytes
    calls = (4 + (2 if tricks.recompute == "full" else 0)) * stage_moe_layers(model, layout)
    out = []
    if ep > 1:
        busier = max(T * k, R) * (ep - 1) // ep * h * act
        local = max(1, min(ep, layout.gpus_per_node // etp))  # group members in this GPU's node
        inter = busier * (ep - local) // (ep - 1)
        link = fabric.inter if inter else fabric.intra
        seconds = max(inter / fabric.inter.reached(assume),
                      (busier - inter) / fabric.intra.reached(assume))  # NVLink and NICs at once
        formula = f"{calls // stage_moe_layers(model, layout)}·L_moe · (ep−1)/ep · max(T·k, R)·h·{act}"
        out.append(Comm("EP all-to-all dispatch + combine", "ep", ep, link.key, calls, calls * busier, formula,
                        calls * seconds, exposed(calls * seconds, assume.overlap_ep, mb.seconds)))  # fmt: skip
    if etp > 1:
        link = link_for(fabric, etp, layout.gpus_per_node, etp)
        out.append(ring("ETP all-gather + reduce-scatter of expert tokens", "ep", etp, link, calls, 1,
                        R * h * act, f"{calls // stage_moe_layers(model, layout)}·L_moe · (e−1)/e · R·h·{act}",
                        assume, assume.overlap_tp, mb.seconds))  # fmt: skip
    return out


def expert_dp_comm(layout: Layout, params: int, w: int, gw: int, m: int, fabric: Fabric, assume: Assumptions,
                   mb: MicroBatch) -> list[Comm]:  # fmt: skip
    """The routed experts' gradients over their edp group, as dp_comm does for the rest: an all-reduce once per
    step without ZeRO, a reduce-scatter (every micro-batch with ZeRO-2 and 3) and an all-gather of the updated
    weights with it. The group's ranks are etp · ep apart: it spans the stage's tp · cp · dp GPUs."""
    n, z, d = layout.expert_shard_ranks, layout.zero, assume.overlap_dp
    if not params or n == 1:
        return []
    g, grads, weights = "edp", params * gw, params * w
    link = link_for(fabric, layout.tp * layout.cp * layout.dp, layout.gpus_per_node, n)
    if z == 0:
        return [ring("expert gradient all-reduce", g, n, link, 1, 2, grads, f"2(n−1)/n · P_e·{gw}", assume, d,
                     mb.backward_window)]  # fmt: skip
    calls = 1 if z == 1 else m
    return [
        ring("expert gradient reduce-scatter", g, n, link, calls, 1, grads,
             ("m · " if calls > 1 else "") + f"(n−1)/n · P_e·{gw}", assume, d, calls * mb.backward_window),
        ring("expert weight all-gather", g, n, link, calls if z == 3 else 1, 1, weights, f"(n−1)/n · P_e·{w}",
             assume, d, mb.forward),
    ]  # fmt: skip
