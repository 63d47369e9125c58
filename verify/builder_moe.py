"""verify's reference mixture of experts and latent attention (DeepSeek-V3's blocks; verify/builder.py
puts them in its blocks where the shape has them): the balanced routing, the router's scores, the MoE MLP as
Megatron-LM's MoELayer runs it on one GPU, and multi-head latent attention. memcalc/exact/builder/moe.py
replays them op by op.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

from .builder_layers import Kernels, RMSNorm, apply_rope, aten_flash_attention, eager_attention, make_mlp


def balanced_routing(tokens: int, shape: ModelShape, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference router's fixed choice, made once per forward: token t's j-th expert is (t·k + j) mod E,
    so that every expert gets T·k/E tokens (one more for the first T·k mod E when E does not divide T·k) and
    every shape is known on meta. Returns the chosen experts (T, k), the slots s = t·k + j expert by expert
    (T·k,), and each such slot's token (T·k,)."""
    E, k = shape.n_experts, shape.experts_per_token
    slots = torch.arange(tokens * k, device=device)
    chosen = (slots % E).view(tokens, k)
    if tokens * k % E == 0:
        order = slots.view(-1, E).t().reshape(-1)  # slot e, e + E, e + 2E, ... for expert e
    else:
        order = torch.sort(chosen.view(-1), stable=True).indices  # the same order, sorted by expert
    return chosen, order, torch.div(order, k, rounding_mode="floor")


def expert_counts(routed: int, n_experts: int) -> list[int]:
    """Tokens of each expert under balanced_routing: expert e has the slots e, e + E, ... below T·k."""
    return [(routed - e + n_experts - 1) // n_experts for e in range(n_experts)]


def router_scores(shape: ModelShape, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's fp32 scores (T, E): softmax over the experts (Mixtral, Qwen3-MoE: F.softmax(dtype=float)),
    or sigmoid (DeepSeek-V3, whose gate multiplies fp32 copies of x and W: modeling_deepseek_v3.py
    DeepseekV3TopkRouter)."""
    logits = F.linear(x.float(), weight.float()) if shape.router_fp32 else F.linear(x, weight)
    logits = logits.float()  # the fp32 copy the softmax makes (none when the logits are fp32 already)
    return logits.softmax(-1) if shape.router == "softmax" else logits.sigmoid()


class MoE(nn.Module):
    """A mixture-of-experts MLP laid out as Megatron-LM's MoELayer runs it on one GPU
    (megatron/core/transformer/moe/moe_utils.py permute and unpermute): the router's scores, the chosen
    experts' weights gathered (and renormalised), every token copied to its experts (permute), each expert's
    MLP on its contiguous tokens, the outputs weighted and added back to their tokens (unpermute), plus the
    shared experts. The choice is the fixed balanced one of balanced_routing; the router is still trained
    through the gathered scores, as DeepSeek-V3's gate is (its top-k indices carry no gradient)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.gate = nn.Linear(shape.hidden, shape.n_experts, bias=False)
        self.experts = nn.ModuleList(make_mlp(shape, shape.routed_ffn) for _ in range(shape.n_experts))
        self.shared = make_mlp(shape, shape.shared_ffn) if shape.n_shared_experts else None

    def forward(self, x: torch.Tensor, routing) -> torch.Tensor:
        B, T, h = x.shape
        chosen, order, owner = routing
        flat = x.view(B * T, h)
        weights = router_scores(self.shape, flat, self.gate.weight).gather(1, chosen)  # (T, k) fp32
        if self.shape.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype).view(-1).index_select(0, order)  # (T·k,) expert by expert
        permuted = flat.index_select(0, owner)  # (T·k, h): each token once per expert it goes to
        parts = permuted.split(expert_counts(owner.numel(), self.shape.n_experts))
        y = torch.cat([expert(part) for expert, part in zip(self.experts, parts)]) * weights.unsqueeze(-1)
        out = flat.new_zeros(B * T, h)
        out.index_add_(0, owner, y)  # each token's expert outputs summed back
        out = out.view(B, T, h)
        return out if self.shared is None else out + self.shared(x)


class LatentAttention(nn.Module):
    """Multi-head latent attention as modeling_deepseek_v3.py's DeepseekV3Attention (rope_interleave off):
    Q from a q_lora_rank latent (or one W_q), K's and V's heads decompressed from a kv_lora_rank latent,
    the rotary part of K one head wide and shared by all heads. The flash kernel needs V as wide as Q and K:
    V is padded and the output cut back, as Transformers does for flash_attention_2."""

    def __init__(self, shape: ModelShape, kernels: Kernels):
        super().__init__()
        h, H, rq, rkv = shape.hidden, shape.n_heads, shape.q_lora_rank, shape.kv_lora_rank
        self.shape, self.kernels = shape, kernels
        if rq:
            self.q_a = nn.Linear(h, rq, bias=False)
            self.q_a_norm = RMSNorm(rq)
            self.q_b = nn.Linear(rq, H * shape.head_dim, bias=False)
        else:
            self.wq = nn.Linear(h, H * shape.head_dim, bias=False)
        self.kv_a = nn.Linear(h, rkv + shape.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(rkv)
        self.kv_b = nn.Linear(rkv, H * (shape.qk_nope_head_dim + shape.v_head_dim), bias=False)
        self.wo = nn.Linear(H * shape.v_head_dim, h, bias=False)

    def core(self, q, k, v, future) -> torch.Tensor:
        p, kind = (self.shape.dropout if self.training else 0.0), self.kernels.attention
        if kind == "eager":
            return eager_attention(q, k, v, future, p, self.kernels.dropout, self.training)
        if kind != "aten-flash":
            raise InputError("latent attention's reference runs eager or aten-flash attention")
        d, dv = q.size(-1), v.size(-1)
        return aten_flash_attention(q, k, F.pad(v, [0, d - dv]), p)[..., :dv]

    def forward(self, x, cos, sin, future) -> torch.Tensor:
        s = self.shape
        B, T, _ = x.shape
        H, nope, rope, dv = s.n_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
        q = self.q_b(self.q_a_norm(self.q_a(x))) if s.q_lora_rank else self.wq(x)
        q_pass, q_rot = torch.split(q.view(B, T, H, nope + rope).transpose(1, 2), [nope, rope], dim=-1)
        k_pass, k_rot = torch.split(self.kv_a(x), [s.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(k_pass)).view(B, T, H, nope + dv).transpose(1, 2)
        k_pass, v = torch.split(kv, [nope, dv], dim=-1)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot.view(B, 1, T, rope), cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)  # (B, H, T, d_qk)
        k = torch.cat((k_pass, k_rot.expand(B, H, T, rope)), dim=-1)
        if self.kernels.recompute == "selective":
            y = checkpoint(self.core, q, k, v, future, use_reentrant=False)
        else:
            y = self.core(q, k, v, future)  # (B, H, T, d_v)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * dv))
