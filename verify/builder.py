"""memcalc's two model families in plain PyTorch, built from a memcalc ModelShape.

gpt    the textbook GPT-2/3 layer (Korthikanti et al. 2022, sec. 4.1): MHA, LayerNorm, 4h GELU
       MLP, dropout on the attention probabilities and on both residual branches.
llama  the Llama/Qwen layer: GQA, RMSNorm, SwiGLU, RoPE, no dropout.
moe    a mixture of experts in place of the MLP (MoE), and latent attention (LatentAttention) in place of
       attention where the shape has them: the reference blocks memcalc.exact mirrors (issue 13).
The family only picks the MLP (shape.gated_mlp); every other ModelShape field is honoured as given
(norm, biases, qk_norm, tied embeddings, learned or rotary positions, dropout), so the parameter
count equals memcalc.model.params.param_counts(shape) for any shape.

The model is built on the meta device (nothing allocated) and materialised where it is measured.
Which kernel runs attention and dropout is an explicit, documented switch (Kernels), because on
meta and CPU stock PyTorch takes code paths that CUDA does not:
  F.dropout on CPU/meta multiplies by a mask of the input dtype (2 bytes in bf16); on CUDA it is
  the fused aten.native_dropout, which saves a 1-byte bool mask. dropout="native" calls that op.
  SDPA on meta always takes the math path (s×s materialised); on CUDA its flash backend calls
  aten._scaled_dot_product_flash_attention. attention="aten-flash" calls that op directly.
(A TorchFunctionMode shim would do the same invisibly, but it breaks checkpoint recompute.)

Checkpointing (Kernels.recompute): selective wraps the attention core in torch.utils.checkpoint; full
wraps every block, or with ckpt_every = N every Nth (torchtitan's per-layer selective AC); op wraps
every block with torchtitan's per-op policy through create_selective_checkpoint_contexts. torchtitan
calls torch.utils.checkpoint through ptd_checkpoint_wrapper(module, preserve_rng_state=False); here
it is called directly (non-reentrant, the wrapper's default), and preserve_rng_state stays True: the
RNG state it stashes is a CPU tensor, nothing on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memcalc.errors import InputError
from memcalc.model.moe_mla import is_moe_layer, moe_layer_count
from memcalc.model.shape import ModelShape, check_positions

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


# torchtitan's per-op selective AC, as torchtitan v0.1.0 applies it (commit
# f7084fc78567f865d0c411f2c7b9bbbef6b155ac, torchtitan/models/llama3/infra/parallelize.py,
# _save_list and _apply_ac_to_transformer_block): the same ops, the same rule, written here.
# (Later torchtitan moved it to torchtitan/distributed/activation_checkpoint.py, per model.)
SAC_SAVE_OPS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,  # float8's amax
})  # fmt: skip


def sac_policy(counts: dict, observe: Callable | None = None):
    """MUST_SAVE the outputs of SAC_SAVE_OPS except every second aten.mm (counts: this checkpointed
    call's mm count, forward and recompute apart), PREFER_RECOMPUTE everything else. observe (verify's
    instrument, not torchtitan's) is shown the tensors of every output kept."""

    def policy(ctx, func, *args, **kwargs):
        pass_ = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[pass_] += 1
        keep = func in SAC_SAVE_OPS and not (func == torch.ops.aten.mm.default and counts[pass_] % 2 == 0)
        if keep and observe is not None:
            observe([t for t in tree_leaves(ctx.op_output) if isinstance(t, torch.Tensor)])
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_contexts(observe: Callable | None = None):
    """context_fn for torch.utils.checkpoint: a fresh mm count for each checkpointed call."""
    return create_selective_checkpoint_contexts(sac_policy(defaultdict(int), observe))


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


class Block(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); moe: its MLP a mixture of experts."""

    def __init__(self, shape: ModelShape, kernels: Kernels, moe: bool = False):
        super().__init__()
        self.shape, self.kernels = shape, kernels
        self.norm1 = make_norm(shape, shape.hidden)
        self.attn = LatentAttention(shape, kernels) if shape.is_mla else Attention(shape, kernels)
        self.norm2 = make_norm(shape, shape.hidden)
        self.mlp = MoE(shape) if moe else make_mlp(shape)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.shape.dropout, self.kernels.dropout, self.training)

    def forward(self, x, cos, sin, future, *routing) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin, future))
        if isinstance(self.mlp, MoE):
            return x + self.drop(self.mlp(self.norm2(x), routing))
        return x + self.drop(self.mlp(self.norm2(x)))


MTP_WEIGHT = 0.3  # the MTP loss's weight, lambda (DeepSeek-V3 report sec. 4.2: 0.3, later 0.1): no bytes depend on it


class MTP(nn.Module):
    """A multi-token prediction module (DeepSeek-V3 report sec. 2.2; Megatron-LM multi_token_prediction.py):
    the model's last hidden state and the next token's embedding, each normalised, concatenated and projected
    (2h -> h), one block (MoE when the model's last is), a final norm; the embedding and the output head are
    the model's own. It predicts the token after next from every position (the last wraps around: same shapes)."""

    def __init__(self, shape: ModelShape, kernels: Kernels, moe: bool):
        super().__init__()
        self.hnorm = make_norm(shape, shape.hidden)
        self.enorm = make_norm(shape, shape.hidden)
        self.proj = nn.Linear(2 * shape.hidden, shape.hidden, bias=False)
        self.block = Block(shape, kernels, moe)
        self.norm = make_norm(shape, shape.hidden)


class Transformer(nn.Module):
    """Token ids and targets in, mean cross-entropy out (the logits never leave forward)."""

    def __init__(self, shape: ModelShape, kernels: Kernels, seq_len: int):
        super().__init__()
        check_positions(shape, seq_len)
        self.shape, self.kernels, self.seq_len = shape, kernels, seq_len
        self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
        self.pos_emb = nn.Embedding(shape.max_positions, shape.hidden) if shape.positions == "learned" else None
        if shape.mtp_layers > 1:
            raise InputError("verify's reference model builds one multi-token prediction module (DeepSeek-V3's)")
        self.blocks = nn.ModuleList(Block(shape, kernels, is_moe_layer(shape, i)) for i in range(shape.n_layers))
        self.norm = make_norm(shape, shape.hidden)
        self.lm_head = None if shape.tied_embeddings else nn.Linear(shape.hidden, shape.vocab, bias=False)
        last_is_moe = is_moe_layer(shape, shape.n_layers - 1)
        self.mtp = MTP(shape, kernels, last_is_moe) if shape.mtp_layers else None
        # Eager attention's causal mask, (T, T) bool, True above the diagonal; one buffer for all layers.
        future = None if kernels.flash else torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)
        self.sac_observer: Callable | None = None  # verify's: shown the outputs per-op selective AC keeps

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok_emb(idx)  # (B, T, h)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        cos = sin = None
        if self.shape.positions == "rope":
            cos, sin = rope_tables(T, self.shape.rope_dim, x.dtype, idx.device)  # (T, hs) each
        future = self.future[:T, :T] if self.future is not None else None
        routing = balanced_routing(B * T, self.shape, idx.device) if moe_layer_count(self.shape) else ()
        for i, block in enumerate(self.blocks):
            if self.kernels.recompute == "op":  # torchtitan's per-op selective AC
                context = lambda: sac_contexts(self.sac_observer)
                x = checkpoint(block, x, cos, sin, future, *routing, use_reentrant=False, context_fn=context)
            elif self.kernels.checkpointed(i):  # full AC, or per-layer selective AC (every Nth block)
                x = checkpoint(block, x, cos, sin, future, *routing, use_reentrant=False)
            else:
                x = block(x, cos, sin, future, *routing)
        last = x if self.mtp is not None else None  # the MTP module's input: the hidden state before the final norm
        x = self.norm(x)
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)  # (B, T, V) in the activation dtype
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))  # fp32 upcast for the loss
        if self.mtp is None:
            return loss
        return loss + MTP_WEIGHT * self.mtp_loss(last, idx, targets, weight, cos, sin, future, routing)

    def mtp_loss(self, x, idx, targets, weight, cos, sin, future, routing) -> torch.Tensor:
        """The MTP module's cross-entropy against the token after next."""
        B, T = idx.shape
        m = self.mtp
        nxt = self.tok_emb(idx.roll(-1, 1))  # the next token's embedding
        y = m.proj(torch.cat((m.hnorm(x), m.enorm(nxt)), dim=-1))
        if self.kernels.recompute == "full":
            y = checkpoint(m.block, y, cos, sin, future, *routing, use_reentrant=False)
        else:
            y = m.block(y, cos, sin, future, *routing)
        logits = F.linear(m.norm(y), weight)
        return F.cross_entropy(logits.float().view(B * T, -1), targets.roll(-1, 1).view(B * T))


def build(shape: ModelShape, kernels: Kernels, seq_len: int, dtype: torch.dtype) -> Transformer:
    """The model on the meta device, parameters in dtype: nothing is allocated."""
    with torch.device("meta"):
        model = Transformer(shape, kernels, seq_len)
    model = model.to(dtype)
    if kernels.fp8:
        from .float8 import convert

        convert(model, kernels.fp8)
    return model


@torch.no_grad()
def init_weights(model: Transformer) -> None:
    """GPT-2's initialisation (normal, std 0.02; norms one; biases zero) and the causal mask."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, RMSNorm)):  # (MoE's gate is an nn.Linear: normal, std 0.02)
            nn.init.ones_(module.weight)
        if isinstance(module, nn.LayerNorm) and module.bias is not None:
            nn.init.zeros_(module.bias)
    if model.future is not None:
        model.future.copy_(torch.ones_like(model.future).triu(1))


def materialise(model: Transformer, device: str | torch.device) -> Transformer:
    """Allocate the meta model's tensors on device and initialise them."""
    model.to_empty(device=device)
    init_weights(model)
    return model
