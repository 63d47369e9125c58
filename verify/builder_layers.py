"""The plain PyTorch layers of verify's reference model (verify/builder.py assembles them): the kernel
switch (Kernels), dropout, RMSNorm and LayerNorm, rotary tables, the attention kernels (eager, SDPA's flash
backend, the aten flash op, flash-attn), attention, and the GPT and gated MLPs. memcalc/exact/builder/layers.py
replays them op by op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

ATTENTION_KERNELS = ("eager", "sdpa-flash", "flash-attn", "aten-flash")
DROPOUT_KERNELS = ("functional", "native")
RECOMPUTES = ("none", "selective", "full", "op")
ROPE_THETA = 10000.0  # Su et al. 2021; the base does not change memory or FLOPs
NORM_EPS = 1e-5


@dataclass(frozen=True)
class Kernels:
    """What runs the parts of a layer whose saved tensors depend on the kernel."""

    attention: str = "eager"  # eager: softmax(QKᵀ)V with the s×s matrix materialised
    dropout: str = "functional"  # native: aten.native_dropout, what F.dropout runs on CUDA
    recompute: str = "none"  # selective: the attention core only; full: each block (or each Nth); op: sac
    ckpt_every: int = 1  # with full: checkpoint every Nth block (torchtitan's selective_ac_option = N)
    fp8: str = ""  # torchao float8 training of the blocks' linears: tensorwise | rowwise (verify/float8.py)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            known = ", ".join(ATTENTION_KERNELS)
            raise InputError(f"unknown attention kernel {self.attention!r}; known: {known}")
        if self.dropout not in DROPOUT_KERNELS:
            raise InputError(f"unknown dropout kernel {self.dropout!r}; known: {', '.join(DROPOUT_KERNELS)}")
        if self.recompute not in RECOMPUTES:
            raise InputError(f"unknown recompute {self.recompute!r}; known: {', '.join(RECOMPUTES)}")
        if self.ckpt_every < 1 or (self.ckpt_every > 1 and self.recompute != "full"):
            raise InputError(f"ckpt_every {self.ckpt_every} needs recompute full and a whole number >= 1")

    @property
    def flash(self) -> bool:
        return self.attention != "eager"

    def checkpointed(self, block: int) -> bool:
        """Whether block `block` (from 0) runs under torch.utils.checkpoint as a whole. torchtitan's
        _apply_layer_sac counts the blocks from 1 and checkpoints when count % N == 0."""
        return self.recompute == "op" or (self.recompute == "full" and (block + 1) % self.ckpt_every == 0)


def dropout(x: torch.Tensor, p: float, kernel: str, training: bool) -> torch.Tensor:
    """Dropout as CUDA runs it; p = 0 is the identity, as in F.dropout (no mask is made)."""
    if p == 0.0 or not training:
        return x
    if kernel == "native":
        return torch.ops.aten.native_dropout(x, p, True)[0]  # saves a bool mask, as on CUDA
    return F.dropout(x, p, True)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as plain ops, statistics in fp32, as Llama's reference model.py."""

    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # a 4-byte copy in the 16-bit recipes, x itself in fp32
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * rstd).type_as(x) * self.weight


def make_norm(shape: ModelShape, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=NORM_EPS) if shape.norm == "layernorm" else RMSNorm(dim)


def rope_tables(seq_len: int, head_dim: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (T, hs) in the activation dtype (Su et al. 2021; HF Llama)."""
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) rotated by position; cos and sin broadcast over batch and heads."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, nkv, T, hs) -> (B, nkv·groups, T, hs), a copy, as HF's eager attention does for GQA."""
    if groups == 1:
        return x
    B, nkv, T, hs = x.shape
    return x[:, :, None].expand(B, nkv, groups, T, hs).reshape(B, nkv * groups, T, hs)


def eager_attention(q, k, v, future, p: float, dropout_kernel: str, training: bool) -> torch.Tensor:
    """softmax(QKᵀ/√hs)V with the (B, nh, T, T) matrix materialised; the nanoGPT/HF eager path."""
    groups = q.size(1) // k.size(1)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, nh, T, hs)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, T)
    att = att.masked_fill(future, float("-inf"))  # saves the mask: a view of the model's buffer
    att = F.softmax(att, dim=-1)
    att = dropout(att, p, dropout_kernel, training)
    return att @ v  # (B, nh, T, hs)


def aten_flash_attention(q, k, v, p: float) -> torch.Tensor:
    """The op SDPA's flash backend calls on CUDA, called directly so meta measures what CUDA runs."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, True, False)[0]  # (B, nh, T, hs)


def sdpa_flash_attention(q, k, v, p: float) -> torch.Tensor:
    """F.scaled_dot_product_attention restricted to the flash backend: an error if it cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=k.size(1) != q.size(1))


def flash_attn_attention(q, k, v, p: float) -> torch.Tensor:
    """Dao's flash-attn package; it takes (B, T, nh, hs) and handles GQA itself."""
    from flash_attn import flash_attn_func

    y = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p, causal=True)
    return y.transpose(1, 2)  # (B, nh, T, hs)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, kernels: Kernels):
        super().__init__()
        h, qd, kvd = shape.hidden, shape.q_dim, shape.kv_dim
        qkv_bias = shape.linear_bias or shape.qkv_bias
        self.shape, self.kernels = shape, kernels
        self.wq = nn.Linear(h, qd, bias=qkv_bias)
        self.wk = nn.Linear(h, kvd, bias=qkv_bias)
        self.wv = nn.Linear(h, kvd, bias=qkv_bias)
        self.wo = nn.Linear(qd, h, bias=shape.linear_bias)
        self.q_norm = RMSNorm(shape.head_dim) if shape.qk_norm else None  # Qwen3: per head, before RoPE
        self.k_norm = RMSNorm(shape.head_dim) if shape.qk_norm else None

    def core(self, q, k, v, future) -> torch.Tensor:
        """The attention core: what selective recompute rebuilds in backward."""
        p, kind = (self.shape.dropout if self.training else 0.0), self.kernels.attention
        if kind == "eager":
            return eager_attention(q, k, v, future, p, self.kernels.dropout, self.training)
        if kind == "aten-flash":
            return aten_flash_attention(q, k, v, p)
        if kind == "sdpa-flash":
            return sdpa_flash_attention(q, k, v, p)
        return flash_attn_attention(q, k, v, p)

    def forward(self, x, cos, sin, future) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, h)
        nh, nkv, hs = self.shape.n_heads, self.shape.n_kv_heads, self.shape.head_dim
        q = self.wq(x).view(B, T, nh, hs)
        k = self.wk(x).view(B, T, nkv, hs)
        v = self.wv(x).view(B, T, nkv, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, hs)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kernels.recompute == "selective":
            y = checkpoint(self.core, q, k, v, future, use_reentrant=False)
        else:
            y = self.core(q, k, v, future)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, nh * hs))


def activation(shape: ModelShape, x: torch.Tensor) -> torch.Tensor:
    """silu (Llama, Qwen), or the tanh GELU GPT-2 and Gemma use."""
    return F.silu(x) if shape.activation == "silu" else F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """GPT-2/3: W_out(gelu(W_in x)); width: an expert's (default: shape.ffn)."""

    def __init__(self, shape: ModelShape, width: int | None = None):
        super().__init__()
        self.shape, f = shape, shape.ffn if width is None else width
        self.fc = nn.Linear(shape.hidden, f, bias=shape.linear_bias)
        self.proj = nn.Linear(f, shape.hidden, bias=shape.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(activation(self.shape, self.fc(x)))


class SwiGLU(nn.Module):
    """Llama: W_down(silu(W_gate x) * (W_up x)) (Shazeer 2020); Gemma's GeGLU with gelu; width: an expert's."""

    def __init__(self, shape: ModelShape, width: int | None = None):
        super().__init__()
        self.shape, f = shape, shape.ffn if width is None else width
        self.gate = nn.Linear(shape.hidden, f, bias=shape.linear_bias)
        self.up = nn.Linear(shape.hidden, f, bias=shape.linear_bias)
        self.down = nn.Linear(f, shape.hidden, bias=shape.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(activation(self.shape, self.gate(x)) * self.up(x))


def make_mlp(shape: ModelShape, width: int | None = None) -> nn.Module:
    return SwiGLU(shape, width) if shape.gated_mlp else MLP(shape, width)
