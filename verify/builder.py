"""memcalc's two model families in plain PyTorch, built from a memcalc ModelShape.

gpt    the textbook GPT-2/3 layer (Korthikanti et al. 2022, sec. 4.1): MHA, LayerNorm, 4h GELU
       MLP, dropout on the attention probabilities and on both residual branches.
llama  the Llama/Qwen layer: GQA, RMSNorm, SwiGLU, RoPE, no dropout.
The family only picks the MLP (shape.gated_mlp); every other ModelShape field is honoured as given
(norm, biases, qk_norm, tied embeddings, learned or rotary positions, dropout), so the parameter
count equals memcalc.model.shape.param_counts(shape) for any shape.

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
    """GPT-2/3: W_out(gelu(W_in x))."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(shape.hidden, shape.ffn, bias=shape.linear_bias)
        self.proj = nn.Linear(shape.ffn, shape.hidden, bias=shape.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(activation(self.shape, self.fc(x)))


class SwiGLU(nn.Module):
    """Llama: W_down(silu(W_gate x) * (W_up x)) (Shazeer 2020); Gemma's GeGLU with gelu."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.gate = nn.Linear(shape.hidden, shape.ffn, bias=shape.linear_bias)
        self.up = nn.Linear(shape.hidden, shape.ffn, bias=shape.linear_bias)
        self.down = nn.Linear(shape.ffn, shape.hidden, bias=shape.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(activation(self.shape, self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, shape: ModelShape, kernels: Kernels):
        super().__init__()
        self.shape, self.kernels = shape, kernels
        self.norm1 = make_norm(shape, shape.hidden)
        self.attn = Attention(shape, kernels)
        self.norm2 = make_norm(shape, shape.hidden)
        self.mlp = SwiGLU(shape) if shape.gated_mlp else MLP(shape)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.shape.dropout, self.kernels.dropout, self.training)

    def forward(self, x, cos, sin, future) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin, future))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer(nn.Module):
    """Token ids and targets in, mean cross-entropy out (the logits never leave forward)."""

    def __init__(self, shape: ModelShape, kernels: Kernels, seq_len: int):
        super().__init__()
        check_positions(shape, seq_len)
        self.shape, self.kernels, self.seq_len = shape, kernels, seq_len
        self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
        self.pos_emb = nn.Embedding(shape.max_positions, shape.hidden) if shape.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(shape, kernels) for _ in range(shape.n_layers))
        self.norm = make_norm(shape, shape.hidden)
        self.lm_head = None if shape.tied_embeddings else nn.Linear(shape.hidden, shape.vocab, bias=False)
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
            cos, sin = rope_tables(T, self.shape.head_dim, x.dtype, idx.device)  # (T, hs) each
        future = self.future[:T, :T] if self.future is not None else None
        for i, block in enumerate(self.blocks):
            if self.kernels.recompute == "op":  # torchtitan's per-op selective AC
                context = lambda: sac_contexts(self.sac_observer)
                x = checkpoint(block, x, cos, sin, future, use_reentrant=False, context_fn=context)
            elif self.kernels.checkpointed(i):  # full AC, or per-layer selective AC (every Nth block)
                x = checkpoint(block, x, cos, sin, future, use_reentrant=False)
            else:
                x = block(x, cos, sin, future)
        x = self.norm(x)
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)  # (B, T, V) in the activation dtype
        return F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))  # fp32 upcast for the loss


def build(shape: ModelShape, kernels: Kernels, seq_len: int, dtype: torch.dtype) -> Transformer:
    """The model on the meta device, parameters in dtype: nothing is allocated."""
    with torch.device("meta"):
        model = Transformer(shape, kernels, seq_len)
    return model.to(dtype)


@torch.no_grad()
def init_weights(model: Transformer) -> None:
    """GPT-2's initialisation (normal, std 0.02; norms one; biases zero) and the causal mask."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
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
