"""verify/builder_moe.py's mixture of experts and latent attention, op by op, in bytes on memcalc.exact.sim.graph:
the balanced routing tables, the router's scores, the tokens permuted to their experts and combined back,
the shared experts (MoE.forward), and DeepSeek's multi-head latent attention (LatentAttention.forward and
its core, eager or flash).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .layers import apply_rope, dropout, linear, mlp_forward, rms_norm, transpose12

if TYPE_CHECKING:  # only for annotations
    from .model import Block


def routing_tables(g: Graph, tokens: int, s) -> tuple[Tensor, Tensor, Tensor]:
    """balanced_routing: arange of the T·k slots, their experts (remainder), the slots expert by expert (a
    transposed reshape: a copy; a stable sort, values and indices, when E does not divide T·k), each such
    slot's token (a floor division). The arange dies on return."""
    E, k = s.n_experts, s.experts_per_token
    with g.scoped("routing tables"):
        slots = made(g, (tokens * k,), "arange", dtype="int64")
        chosen = g.view(made(g, (tokens * k,), "remainder", slots, dtype="int64"), (tokens, k))
        if tokens * k % E == 0:
            order = made(g, (tokens * k,), "clone", slots, dtype="int64")
        else:
            order = g.empty((tokens * k,), "int64", "sort")  # .indices of torch.sort(..., stable=True)
            values = g.empty((tokens * k,), "int64", "sort")
            g.kernel("sort", (chosen,), (values, order))
            del values
        owner = made(g, (tokens * k,), "div", order, dtype="int64")
        del slots
    return chosen, order, owner


def expert_counts(routed: int, n_experts: int) -> list[int]:
    """verify/builder.py expert_counts: expert e has the slots e, e + E, ... below T·k."""
    return [(routed - e + n_experts - 1) // n_experts for e in range(n_experts)]


def router_scores(g: Graph, cfg: StepConfig, x: Tensor, weight: Tensor) -> Tensor:
    """verify/builder.py router_scores: logits (from fp32 copies of x and W for DeepSeek-V3's gate), their fp32
    copy, softmax or sigmoid."""
    s = cfg.shape
    with g.scoped("router"):  # the fp32 copies are temporaries: kept only where the matmul saves them
        if s.router_fp32:
            logits = linear2d(g, aten.to(g, x, "fp32"), aten.to(g, weight, "fp32"), "linear")
        else:
            logits = linear2d(g, x, weight, "linear")
        logits = aten.to(g, logits, "fp32")
        return aten.softmax(g, logits) if s.router == "softmax" else aten.sigmoid(g, logits)


def linear2d(g: Graph, x: Tensor, w: Tensor, kind: str) -> Tensor:
    """F.linear of a 2-D input without bias: matmul(x, w.t()) runs mm directly (no fold)."""
    return aten.mm(g, x, aten.t(g, w), kind)


def mixture(g: Graph, cfg: StepConfig, b: Block, x: Tensor, routing) -> Tensor:
    """MoE.forward line by line (its locals live until it returns, as Python keeps them): route, permute,
    each expert on its tokens, weight, add back, plus the shared experts."""
    s, e = cfg.shape, b.experts
    B, T, h = x.shape
    chosen, order, owner = routing
    with g.scoped("mlp"):
        flat = aten.view(g, x, (B * T, h))
        with g.scoped("router"):
            weights = aten.gather(g, router_scores(g, cfg, flat, e.gate), chosen)  # (T, k) fp32
            if s.norm_topk_prob:
                weights = aten.div(g, weights, aten.sum_keepdim(g, weights))
            n = weights.shape[0] * weights.shape[1]
            weights = aten.index_select(g, aten.view(g, aten.to(g, weights, x.dtype), (n,)), order)
        with g.scoped("dispatch"):
            permuted = aten.index_select(g, flat, owner)  # (T·k, h)
            parts = aten.split(g, permuted, [(tokens, copies) for _, copies, tokens in e.groups], 0)
        with g.scoped("experts"):
            outs = []  # the list comprehension's: each expert in turn, a group's simulated once
            for w, part, (name, copies, _) in zip(e.experts, parts, e.groups):
                with g.repeated(name, copies):
                    outs.append(mlp_forward(g, cfg, w, part))
            del w, part
        with g.scoped("combine"):
            y = aten.cat(g, outs, 0)
            del outs  # the list comprehension's list: a temporary
            y = aten.mul(g, y, aten.view(g, weights, (n, 1)))
            out = made(g, (B * T, h), "new_zeros", dtype=x.dtype)
            out = aten.index_add_(g, out, owner, y)
            out = aten.view(g, out, (B, T, h))
        if e.shared is None:
            return out
        with g.scoped("shared experts"):
            return aten.add(g, out, mlp_forward(g, cfg, e.shared, x))


def latent(g: Graph, cfg: StepConfig, b: Block, x, cos, sin, future) -> Tensor:
    with g.scoped("attention"):
        return latent_attention(g, cfg, b, x, cos, sin, future)


def latent_attention(g: Graph, cfg: StepConfig, b: Block, x, cos, sin, future) -> Tensor:
    """LatentAttention.forward (verify/builder.py) line by line: its locals live until it returns. The
    gradients reaching the q and kv views come from transposes: copied back to (B, T, H·d) unless one of
    H and T is 1."""
    s, w = cfg.shape, b.latent
    B, T, _ = x.shape
    H, nope, rope, dv = s.n_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
    copies = H > 1 and T > 1
    q = linear(g, rms_norm(g, linear(g, x, w["q_a"]), w["q_a_norm"][0]), w["q_b"]) if s.q_lora_rank else linear(g, x, w["wq"])
    q_pass, q_rot = aten.split(g, transpose12(g, aten.view(g, q, (B, T, H, nope + rope), grad_copies=copies)), [nope, rope], 3)
    k_pass, k_rot = aten.split(g, linear(g, x, w["kv_a"]), [s.kv_lora_rank, rope], 2)
    kv = transpose12(g, aten.view(g, linear(g, rms_norm(g, k_pass, w["kv_a_norm"][0]), w["kv_b"]), (B, T, H, nope + dv),
                                  grad_copies=copies))  # fmt: skip
    k_pass, v = aten.split(g, kv, [nope, dv], 3)
    q_rot, k_rot = apply_rope(g, q_rot, cos, sin), apply_rope(g, aten.view(g, k_rot, (B, 1, T, rope)), cos, sin)
    q = aten.cat_last(g, q_pass, q_rot)  # (B, H, T, d_qk)
    k = aten.cat_last(g, k_pass, aten.expand(g, k_rot, (B, H, T, rope)))
    if cfg.recompute == "selective":
        y = g.checkpoint(lambda q, k, v, future: latent_core(g, cfg, q, k, v, future), q, k, v, future)
    else:
        y = latent_core(g, cfg, q, k, v, future)  # (B, H, T, d_v)
    return linear(g, aten.reshape_copy(g, transpose12(g, y), (B, T, H * dv)), w["wo"])


def latent_core(g: Graph, cfg: StepConfig, q, k, v, future) -> Tensor:
    """LatentAttention.core: eager attention (q and k contiguous from their cats, v a view that merges B and H
    only when B = 1), or the flash kernel on V padded to d_qk, its output cut back to d_v."""
    with g.scoped("attention core"):
        B = q.shape[0]
        if cfg.flash:
            return aten.narrow_last(g, aten.flash_attention(g, q, k, aten.pad_last(g, v, q.shape[3])), v.shape[3])
        kt = aten.view(g, k, k.shape[:2] + (k.shape[3], k.shape[2]))  # eager_attention line by line
        att = aten.mul_scalar(g, aten.matmul4(g, q, kt, False, False, False))
        att = aten.masked_fill(g, att, future)
        att = aten.softmax(g, att)
        att = dropout(g, att, cfg.shape.dropout)
        return aten.matmul4(g, att, v, False, B > 1, B > 1)
