"""Transformers' Phi-3 decoder, op by op, in bytes on memcalc.exact.sim.graph:
  models/phi3/modeling_phi3.py      Phi3MLP (one gate_up_proj, chunked: up * act(gate)), Phi3RotaryEmbedding
                                    (partial_rotary_factor: rope_dim of each head; cos and sin cast to the
                                    model's dtype), apply_rotary_pos_emb (q[..., :rotary_dim] rotated, the rest
                                    passed, both cat back), Phi3Attention (one qkv_proj, q, k, v its slices),
                                    Phi3RMSNorm (LlamaRMSNorm's), Phi3DecoderLayer (resid_attn_dropout and
                                    resid_mlp_dropout on the branches), Phi3Model (the sliding-window causal
                                    mask where config.sliding_window is set)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

from .. import aten
from ..builder.layers import transpose12
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import dynamic_cache
from .attention import attention_interface, dropout, grad_copies
from .family import Family, decoder_config, decoder_params, rope_buffers
from .llama import decoder_forward, linear, rms_norm, rotate_half

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel


def phi3_params(s: ModelShape) -> list[tuple[str, tuple]]:
    """Phi3ForCausalLM's named_parameters(): Phi3Attention registers o_proj before qkv_proj (q_dim +
    2 kv_dim rows); Phi3MLP gate_up_proj (2 ffn rows), down_proj; then input_layernorm,
    post_attention_layernorm."""
    check_phi3(s)
    h, f = s.hidden, s.ffn
    return decoder_params(s, lambda n: [
        (n + "self_attn.o_proj.weight", (h, s.q_dim)), (n + "self_attn.qkv_proj.weight", (s.q_dim + 2 * s.kv_dim, h)),
        (n + "mlp.gate_up_proj.weight", (2 * f, h)), (n + "mlp.down_proj.weight", (h, f)),
        (n + "input_layernorm.weight", (h,)), (n + "post_attention_layernorm.weight", (h,))])  # fmt: skip


def check_phi3(s: ModelShape) -> None:
    """What modeling_phi3.py fixes: pre-norms, no q/k norms, no biases (qkv_proj, o_proj and gate_up_proj
    are bias=False), one window for every layer (create_sliding_window_causal_mask)."""
    wiring = (s.norm_layout, s.qk_norm, s.qkv_bias, s.linear_bias, s.global_layers, s.parallel_residual,
              s.attn_softcap, s.logit_softcap)  # fmt: skip
    if wiring != ("pre", False, False, False, (), False, 0.0, 0.0) or not s.gated_mlp:
        raise InputError(f"Transformers' phi3 builds pre-norms, a gated MLP, no q/k norms, no biases and one "
                         f"window for all layers; {s.name}'s shape differs")  # fmt: skip


def phi3_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """Phi3Model.forward: LlamaModel's ops (the mask create_sliding_window_causal_mask where
    config.sliding_window is set, the rotary tables over rope_dim), with Phi-3's layers."""
    return decoder_forward(g, m, input_ids, kwargs, decoder_layer, rms_norm)


def decoder_layer(g: Graph, m: HFModel, i: int, hidden_states: Tensor, causal, cos, sin, kwargs) -> Tensor:
    """Phi3DecoderLayer.forward: residual + resid_attn_dropout(self_attn(input_layernorm(x))), then
    residual + resid_mlp_dropout(mlp(post_attention_layernorm(h))) (nn.Dropout(resid_pdrop): F.dropout);
    each branch's output, bound to hidden_states, lives until the sum replaces it."""
    n, p = f"model.layers.{i}.", m.cfg.shape.dropout
    residual = hidden_states
    hidden_states = rms_norm(g, hidden_states, m.p[n + "input_layernorm.weight"], "norm1")
    with g.scoped("attention"):
        hidden_states, self_attn_weights = self_attention(g, m, n + "self_attn.", hidden_states, causal, cos, sin,
                                                          kwargs)  # fmt: skip
        dropped = dropout(g, hidden_states, p)
    hidden_states = aten.add(g, residual, dropped)
    del dropped
    residual = hidden_states
    hidden_states = rms_norm(g, hidden_states, m.p[n + "post_attention_layernorm.weight"], "norm2")
    with g.scoped("mlp"):
        hidden_states = phi3_mlp(g, m, n + "mlp.", hidden_states)
        dropped = dropout(g, hidden_states, p)
    hidden_states = aten.add(g, residual, dropped)
    del dropped, residual, self_attn_weights
    return hidden_states


def phi3_mlp(g: Graph, m: HFModel, n: str, x: Tensor) -> Tensor:
    """Phi3MLP.forward: up_states = gate_up_proj(x); gate, up_states = up_states.chunk(2, dim=-1)
    (views of it); up_states * activation_fn(gate) (silu); down_proj of that, gate (a view of the
    gate_up_proj output) still held by the frame."""
    gate, up_states = aten.chunk2(g, linear(g, m, n + "gate_up_proj", x))
    up_states = aten.mul(g, up_states, aten.silu(g, gate))
    out = linear(g, m, n + "down_proj", up_states)
    del gate, up_states
    return out


def self_attention(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal, cos, sin, kwargs):
    """Phi3Attention.forward: qkv = qkv_proj(x); q, k, v its slices along the last dim (views whose
    backward writes qkv-sized zeros), each viewed per head and transposed; RoPE; the cache's update;
    the attention interface (sliding_window among its kwargs: no tensor); o_proj."""
    s, cfg = m.cfg.shape, m.cfg
    B, T, _ = hidden_states.shape
    q_copies, k_copies, v_copies = grad_copies(cfg, cfg.flash and causal is not None)  # a window's mask
    qkv = linear(g, m, n + "qkv_proj", hidden_states)
    query_pos, width = s.q_dim, qkv.shape[-1]
    query_states = aten.slice_last(g, qkv, 0, query_pos)
    key_states = aten.slice_last(g, qkv, query_pos, query_pos + s.kv_dim)
    value_states = aten.slice_last(g, qkv, query_pos + s.kv_dim, width)
    query_states = transpose12(g, aten.view(g, query_states, (B, T, s.n_heads, s.head_dim), q_copies))
    key_states = transpose12(g, aten.view(g, key_states, (B, T, s.n_kv_heads, s.head_dim), k_copies))
    value_states = transpose12(g, aten.view(g, value_states, (B, T, s.n_kv_heads, s.head_dim), v_copies))
    query_states, key_states = apply_rotary_pos_emb(g, query_states, key_states, cos, sin)
    key_states, value_states = dynamic_cache.update(g, m, key_states, value_states)
    attn_output, attn_weights = attention_interface(g, cfg, query_states, key_states, value_states, causal, kwargs,
                                                    contiguous_qk=True)  # apply_rotary_pos_emb's cat  # fmt: skip
    attn_output = aten.view(g, attn_output, (B, T, s.q_dim))  # reshape(*input_shape, -1).contiguous()
    attn_output = linear(g, m, n + "o_proj", attn_output)
    del qkv, query_states, key_states, value_states
    return attn_output, attn_weights


def apply_rotary_pos_emb(g: Graph, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """modeling_phi3.py apply_rotary_pos_emb: cos.unsqueeze(1), sin.unsqueeze(1) (views); rotary_dim =
    cos.shape[-1]; q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:] and k's alike; then
    cat([q_rot * cos + rotate_half(q_rot) * sin, q_pass], -1), and k's."""
    cos, sin = g.view(cos, (1, 1) + cos.shape[1:]), g.view(sin, (1, 1) + sin.shape[1:])
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = rotary_part(g, q, rotary_dim), aten.slice_last(g, q, rotary_dim, q.shape[-1])
    k_rot, k_pass = rotary_part(g, k, rotary_dim), aten.slice_last(g, k, rotary_dim, k.shape[-1])
    q_embed = aten.cat_last(g, aten.add(g, aten.mul(g, q_rot, cos), aten.mul(g, rotate_half(g, q_rot), sin)), q_pass)
    k_embed = aten.cat_last(g, aten.add(g, aten.mul(g, k_rot, cos), aten.mul(g, rotate_half(g, k_rot), sin)), k_pass)
    del q_rot, q_pass, k_rot, k_pass
    return q_embed, k_embed


def rotary_part(g: Graph, x: Tensor, rotary_dim: int) -> Tensor:
    """x[..., :rotary_dim]: x itself where that is all of it (Python indexing returns self for a slice
    over a whole dimension: TensorIndexing.h applySlice), else a slice."""
    return x if rotary_dim == x.shape[-1] else aten.slice_last(g, x, 0, rotary_dim)


PHI3 = Family(phi3_params, rope_buffers, phi3_model, "model.embed_tokens.weight",
              lambda s, t: decoder_config(s, t, hidden_act="silu", resid_pdrop=s.dropout, embd_pdrop=s.dropout,
                                          sliding_window=s.sliding_window or None,
                                          partial_rotary_factor=s.rotary_fraction, pad_token_id=None),
              lora=True)  # fmt: skip
