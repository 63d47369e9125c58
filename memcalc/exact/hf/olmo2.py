"""Transformers' OLMo 2 decoder, op by op, in bytes on memcalc.exact.sim.graph:
  models/olmo2/modeling_olmo2.py    Olmo2RMSNorm ((weight * x).to(input_dtype): the product in fp32),
                                    Olmo2RotaryEmbedding (cos and sin left fp32), apply_rotary_pos_emb
                                    (q and k promoted to fp32 by cos and sin, cast back .to(q_type)),
                                    Olmo2Attention (q_norm, k_norm over the whole projections, before the
                                    view), Olmo2MLP (LlamaMLP's), Olmo2DecoderLayer (no input norm: a
                                    post-norm on each branch before its residual add), Olmo2Model
The mask, the attention interface and the MLP are Llama's (memcalc.exact.hf.llama, hf_attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

from .. import aten
from ..builder.layers import transpose12
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .attention import grad_copies
from .family import Family, decoder_config, decoder_params, rope_buffers
from .llama import decoder_forward, linear, llama_mlp, rotate_half, self_attention

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel


def olmo2_params(s: ModelShape) -> list[tuple[str, tuple]]:
    """Olmo2ForCausalLM's named_parameters(): Olmo2Attention registers q, k, v, o_proj, then q_norm
    (q_dim) and k_norm (kv_dim); Olmo2DecoderLayer self_attn, mlp, post_attention_layernorm,
    post_feedforward_layernorm."""
    check_olmo2(s)
    h, f = s.hidden, s.ffn
    return decoder_params(s, lambda n: [
        (n + "self_attn.q_proj.weight", (s.q_dim, h)), (n + "self_attn.k_proj.weight", (s.kv_dim, h)),
        (n + "self_attn.v_proj.weight", (s.kv_dim, h)), (n + "self_attn.o_proj.weight", (h, s.q_dim)),
        (n + "self_attn.q_norm.weight", (s.q_dim,)), (n + "self_attn.k_norm.weight", (s.kv_dim,)),
        (n + "mlp.gate_proj.weight", (f, h)), (n + "mlp.up_proj.weight", (f, h)), (n + "mlp.down_proj.weight", (h, f)),
        (n + "post_attention_layernorm.weight", (h,)), (n + "post_feedforward_layernorm.weight", (h,))])  # fmt: skip


def check_olmo2(s: ModelShape) -> None:
    """What modeling_olmo2.py fixes: post-norms, q/k norms over the whole projections, RoPE over all of
    each head (Olmo2RotaryEmbedding.compute_default_rope_parameters: dim = head_dim), no biases
    (attention_bias would put one on o_proj too; Olmo2MLP has none), no sliding window."""
    wiring = (s.norm_layout, s.qk_norm, s.qk_norm_over, s.rotary_fraction, s.qkv_bias, s.linear_bias,
              s.sliding_window, s.parallel_residual, s.attn_softcap, s.logit_softcap)  # fmt: skip
    if wiring != ("post", True, "all", 1.0, False, False, 0, False, 0.0, 0.0) or not s.gated_mlp:
        raise InputError(f"Transformers' olmo2 builds post-norms with q/k norms over the whole projections, full "
                         f"rotary positions, a gated MLP and no biases or window; {s.name}'s shape differs")


def olmo2_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """Olmo2Model.forward: LlamaModel's ops, but the rotary tables stay fp32 (Olmo2RotaryEmbedding: no
    .to(x.dtype)) and the norms are Olmo2RMSNorm."""
    return decoder_forward(g, m, input_ids, kwargs, decoder_layer, rms_norm, "fp32")


def rms_norm(g: Graph, x: Tensor, w: Tensor, scope: str) -> Tensor:
    """Olmo2RMSNorm.forward: to fp32; variance = pow(2).mean(-1); x * rsqrt(variance + eps); then
    (weight * hidden_states).to(input_dtype): the product in fp32 (the weight promoted), then cast."""
    with g.scoped(scope):
        input_dtype = x.dtype
        hidden_states = aten.to(g, x, "fp32")
        variance = aten.mean_last(g, aten.pow2(g, hidden_states))
        hidden_states = aten.mul(g, hidden_states, aten.rsqrt(g, aten.add_scalar(g, variance)))
        out = aten.to(g, aten.mul(g, w, hidden_states), input_dtype)
        del hidden_states, variance
        return out


def decoder_layer(g: Graph, m: HFModel, i: int, hidden_states: Tensor, causal, cos, sin, kwargs) -> Tensor:
    """Olmo2DecoderLayer.forward: residual + post_attention_layernorm(self_attn(x)), then residual +
    post_feedforward_layernorm(mlp(h)); kwargs go on to the attention interface."""
    n = f"model.layers.{i}."
    residual = hidden_states
    with g.scoped("attention"):
        hidden_states, _ = self_attention(g, m, n + "self_attn.", hidden_states, causal, cos, sin, kwargs,
                                          projections, apply_rotary_pos_emb)  # fmt: skip
    hidden_states = rms_norm(g, hidden_states, m.p[n + "post_attention_layernorm.weight"], "norm1")
    hidden_states = aten.add(g, residual, hidden_states)
    residual = hidden_states
    with g.scoped("mlp"):
        hidden_states = llama_mlp(g, m, n + "mlp.", hidden_states)
    hidden_states = rms_norm(g, hidden_states, m.p[n + "post_feedforward_layernorm.weight"], "norm2")
    hidden_states = aten.add(g, residual, hidden_states)
    del residual, _
    return hidden_states


def projections(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal) -> tuple[Tensor, Tensor, Tensor]:
    """Olmo2Attention.forward: q_norm(q_proj(x)), k_norm(k_proj(x)), v_proj(x); then each viewed per head
    and transposed (RoPE, the cache, the interface and o_proj are Llama's: hf_llama.self_attention)."""
    s = m.cfg.shape
    B, T, _ = hidden_states.shape
    q_copies, k_copies, v_copies = grad_copies(m.cfg, m.cfg.flash and causal is not None)  # a window's mask
    query_states = rms_norm(g, linear(g, m, n + "q_proj", hidden_states), m.p[n + "q_norm.weight"], "attention")
    key_states = rms_norm(g, linear(g, m, n + "k_proj", hidden_states), m.p[n + "k_norm.weight"], "attention")
    value_states = linear(g, m, n + "v_proj", hidden_states)
    query_states = transpose12(g, aten.view(g, query_states, (B, T, s.n_heads, s.head_dim), q_copies))
    key_states = transpose12(g, aten.view(g, key_states, (B, T, s.n_kv_heads, s.head_dim), k_copies))
    value_states = transpose12(g, aten.view(g, value_states, (B, T, s.n_kv_heads, s.head_dim), v_copies))
    return query_states, key_states, value_states


def apply_rotary_pos_emb(g: Graph, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """modeling_olmo2.py apply_rotary_pos_emb: q_type, k_type kept; cos.unsqueeze(1), sin.unsqueeze(1)
    (views); q * cos + rotate_half(q) * sin and k likewise (fp32 where q is 16-bit: cos is fp32); then
    q_embed.to(q_type), k_embed.to(k_type), both fp32 results alive until it returns."""
    q_type, k_type = q.dtype, k.dtype
    cos, sin = g.view(cos, (1, 1) + cos.shape[1:]), g.view(sin, (1, 1) + sin.shape[1:])
    q_embed = aten.add(g, aten.mul(g, q, cos), aten.mul(g, rotate_half(g, q), sin))
    k_embed = aten.add(g, aten.mul(g, k, cos), aten.mul(g, rotate_half(g, k), sin))
    out = aten.to(g, q_embed, q_type), aten.to(g, k_embed, k_type)
    del q_embed, k_embed
    return out


OLMO2 = Family(olmo2_params, rope_buffers, olmo2_model, "model.embed_tokens.weight",
               lambda s, t: decoder_config(s, t, hidden_act="silu", attention_bias=False), lora=True)
