"""torchtune's decoder modules, op by op in bytes on memcalc.exact.sim.graph, as pytorch/torchtune @ v0.6.1 writes
them (torchtune/modules/*.py; the installed wheel torchtune 0.6.1 is the same code):

  rms_norm.py           RMSNorm.forward: F.rms_norm(x.float(), weight=scale).to(x.dtype); F.rms_norm runs its
                        composite (aten/native/layer_norm.cpp rms_norm_symint, as meta and CPU run it): pow, mean,
                        add_, rsqrt, x * rstd, * scale (the bf16 scale promoted), so it saves x in fp32 twice
                        (pow's input, and the normed product the scale multiplies)
  position_embeddings   RotaryPositionalEmbeddings.forward (Llama3ScaledRoPE's is the same): x.float() reshaped
                        into pairs, four products with the fp32 cache (each select's gradient a zero-filled pair
                        tensor), a stack, .type_as(x)
  attention.py          MultiHeadAttention.forward: q, k, v projected and viewed per head, RoPE, transposed; k and
                        v expanded to every head (unsqueeze, expand, flatten: a copy) when grouped; SDPA causal
  feed_forward.py       FeedForward.forward: w2(silu(w1(x)) * w3(x))
  transformer.py        TransformerSelfAttentionLayer.forward: its attn_out and mlp_out locals live until it returns
  peft/lora.py          LoRALinear.forward: F.linear (or linear_nf4), then alpha / rank * lora_b(lora_a(dropout(x))),
                        the adapters in the model's dtype (the recipe builds them under set_default_dtype)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import aten
from ..aten.operands import made
from ..builder.layers import transpose12
from ..hf.attention import sdpa_flash_forward
from ..hf.lora import dropout
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .nf4 import linear_nf4

if TYPE_CHECKING:
    from .model import TTModel


def rms_norm(g: Graph, x: Tensor, scale: Tensor, where: str) -> Tensor:
    """RMSNorm.forward: F.rms_norm(x.float(), (dim,), scale, eps).to(x.dtype), the composite's ops."""
    with g.scoped(where):
        x_fp32 = aten.to(g, x, "fp32")
        squared = aten.pow2(g, x_fp32)  # rsqrt(pow(x, 2).mean(-1, keepdim).add_(eps)): one C++ expression, whose
        variance = aten.mean_last(g, squared)  # temporaries live until it ends
        rstd = aten.rsqrt(g, add_scalar_(g, variance))
        del squared, variance
        normed = aten.mul(g, x_fp32, rstd)
        product = aten.mul(g, normed, scale)  # * weight (bf16, promoted to fp32)
        del x_fp32, rstd, normed  # x.float() and the composite's locals go as F.rms_norm returns
        return aten.to(g, product, x.dtype)


def add_scalar_(g: Graph, a: Tensor) -> Tensor:
    """a.add_(eps) in place (AddBackward1 on a's rebased history): no bytes; the gradient passes through."""
    node = g.begin("add_", [a], lambda gs: [gs[0]])
    g.kernel("add_", (a,), (a,))
    g.end(node, [a])
    return a


def select_last(g: Graph, x: Tensor) -> Tensor:
    """x[..., i] on a last dim of 2 (SelectBackward0): a view; backward is select_backward, a zero tensor of x's
    shape with the gradient copied in."""
    shape = x.shape

    def rule(gs):
        return [made(g, shape, "select_backward", gs[0], dtype=gs[0].dtype)]

    node = g.begin("select", [x], rule)
    out = g.view(x, shape[:-1])
    g.end(node, [out])
    return out


def sub(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a - b of equal shapes (SubBackward0): saves nothing; a's gradient is the incoming one, b's its negation."""

    def rule(gs):
        return [gs[0], made(g, gs[0].shape, "neg", gs[0], dtype=gs[0].dtype)]

    node = g.begin("sub", [a, b], rule)
    out = made(g, a.shape, "sub", a, b, dtype=a.dtype)
    g.end(node, [out])
    return out


def stack_last(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """torch.stack([a, b], -1) (StackBackward0): saves nothing; backward unbinds the gradient (views)."""
    shape = a.shape
    node = g.begin("stack", [a, b], lambda gs: [g.view(gs[0], shape), g.view(gs[0], shape)])
    out = made(g, a.shape + (2,), "stack", a, b, dtype=a.dtype)
    g.end(node, [out])
    return out


def rope(g: Graph, m: TTModel, x: Tensor) -> Tensor:
    """RotaryPositionalEmbeddings.forward with input_pos None: rope_cache = cache[:seq_len] (a view); xshaped =
    x.float().reshape(..., -1, 2); x_out = stack([x0 * c0 - x1 * s, x1 * c0 + x0 * s], -1).flatten(3);
    x_out.type_as(x). Each product saves the cache's slice (a buffer's storage), the x's pairs need no saving."""
    B, T, n, d = x.shape
    cache = g.view(m.rope_cache, (1, T, 1, d // 2, 2))  # rope_cache.view(-1, xshaped.size(1), 1, size(3), 2)
    cos, sin = g.view(cache, (1, T, 1, d // 2)), g.view(cache, (1, T, 1, d // 2))  # rope_cache[..., 0], [..., 1]
    xshaped = aten.view(g, aten.to(g, x, "fp32"), (B, T, n, d // 2, 2))
    real = sub(g, aten.mul(g, select_last(g, xshaped), cos), aten.mul(g, select_last(g, xshaped), sin))
    imag = aten.add(g, aten.mul(g, select_last(g, xshaped), cos), aten.mul(g, select_last(g, xshaped), sin))
    x_out = aten.view(g, stack_last(g, real, imag), (B, T, n, d))  # .flatten(3)
    del real, imag
    out = aten.to(g, x_out, x.dtype)  # .type_as(x)
    del xshaped, x_out
    return out


def linear(g: Graph, m: TTModel, name: str, x: Tensor) -> Tensor:
    """nn.Linear, FrozenNF4Linear (linear_nf4) or LoRALinear, as the builder made the module."""
    weight = m.p.get(name + ".weight")
    base = linear_nf4(g, x, m.quant[name]) if name in m.quant else aten.linear(g, x, weight, None)
    if name + ".lora_a.weight" not in m.p:
        return base
    a, b = m.p[name + ".lora_a.weight"], m.p[name + ".lora_b.weight"]
    dropped = dropout(g, x, m.cfg.finetune.lora_dropout)  # nn.Identity at 0, else nn.Dropout
    lora_out = aten.linear(g, dropped, a, None)
    del dropped
    lora_out = aten.mul_scalar(g, aten.linear(g, lora_out, b, None))  # self.alpha / self.rank * lora_b(...)
    return aten.add(g, base, lora_out)  # out + lora_out


def attention(g: Graph, m: TTModel, n: str, x: Tensor) -> Tensor:
    """MultiHeadAttention.forward(x, x) with no mask, no cache: is_causal, so SDPA's flash kernel in 16 bits."""
    s = m.cfg.shape
    B, T, _ = x.shape
    q = aten.view(g, linear(g, m, n + "q_proj", x), (B, T, s.n_heads, s.head_dim))
    q = transpose12(g, rope(g, m, q))
    k = aten.view(g, linear(g, m, n + "k_proj", x), (B, T, s.n_kv_heads, s.head_dim))
    grouped = s.n_heads != s.n_kv_heads  # v's gradient comes back transposed from the expand's sum: its view copies
    v = aten.view(g, linear(g, m, n + "v_proj", x), (B, T, s.n_kv_heads, s.head_dim), grouped)
    k = transpose12(g, rope(g, m, k))
    v = transpose12(g, v)
    if grouped:  # k.unsqueeze(2).expand(b, n_kv, q_per_kv, -1, d).flatten(1, 2): a copy
        k = expand_heads(g, k, s.n_heads)  # the unexpanded k dies as k is rebound
        v = expand_heads(g, v, s.n_heads)
    output = sdpa_flash_forward(g, q, k, v, m.cfg.device == "cpu")  # transpose(1, 2): laid out (B, T, n, d)
    output = aten.view(g, output, (B, T, s.q_dim))  # .contiguous().view(b, s_x, -1)
    out = linear(g, m, n + "output_proj", output)
    del q, k, v, output
    return out


def expand_heads(g: Graph, t: Tensor, heads: int) -> Tensor:
    """t.unsqueeze(2).expand(B, n_kv, q_per_kv, T, d).flatten(1, 2): a view, an expand (backward sums the
    copies), and a reshape that cannot view (a clone)."""
    B, kv, T, d = t.shape
    wide = aten.expand(g, aten.view(g, t, (B, kv, 1, T, d)), (B, kv, heads // kv, T, d))
    return aten.reshape_copy(g, wide, (B, heads, T, d))


def feed_forward(g: Graph, m: TTModel, n: str, x: Tensor) -> Tensor:
    """FeedForward.forward: h = silu(w1(x)); h = h * w3(x); w2(h)."""
    h = aten.silu(g, linear(g, m, n + "w1", x))
    h = aten.mul(g, h, linear(g, m, n + "w3", x))
    return linear(g, m, n + "w2", h)


def layer(g: Graph, m: TTModel, i: int, x: Tensor) -> Tensor:
    """TransformerSelfAttentionLayer.forward: its locals h, attn_out, mlp_out live until it returns."""
    n = f"layers.{i}."
    h = rms_norm(g, x, m.p[n + "sa_norm.scale"], "norm1")
    with g.scoped("attention"):
        attn_out = attention(g, m, n + "attn.", h)
    h = aten.add(g, attn_out, x)  # self.sa_scale(attn_out) + x (nn.Identity)
    mlp_in = rms_norm(g, h, m.p[n + "mlp_norm.scale"], "norm2")
    with g.scoped("mlp"):
        mlp_out = feed_forward(g, m, n + "mlp.", mlp_in)
    del mlp_in
    out = aten.add(g, h, mlp_out)
    del h, attn_out, mlp_out
    return out
