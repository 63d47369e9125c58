"""Transformers' GPT-NeoX decoder (Pythia), op by op, in bytes on memcalc.exact.sim.graph:
  models/gpt_neox/modeling_gpt_neox.py  GPTNeoXModel (embed_in, emb_dropout, the rotary tables over
                                        rope_dim, final_layer_norm), GPTNeoXLayer (LayerNorms with biases;
                                        use_parallel_residual: x + attn(ln1(x)) + mlp(ln2(x)), else
                                        sequential), GPTNeoXAttention (one query_key_value laid out per head
                                        as [q | k | v], chunked; partial RoPE as Phi-3's: the rotated part
                                        cat with the part passed), GPTNeoXMLP (dense_h_to_4h, gelu,
                                        dense_4h_to_h, biased), the two dropouts on the branches
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
from .attention import arange_plus, attention_interface, causal_mask, dropout
from .family import NORM_EPS, Family, decoder_config, rope_buffers
from .gpt2 import layer_norm
from .llama import decoder_layers, linear, rotary_embedding, rotate_half
from .lora import embedded
from .phi3 import rotary_part

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel


def neox_params(s: ModelShape) -> list[tuple[str, tuple]]:
    """GPTNeoXForCausalLM's named_parameters(): GPTNeoXLayer registers its two LayerNorms before the
    attention (query_key_value: 3·hidden rows, then dense) and the MLP; every Linear and LayerNorm has a
    bias; lm_head last (untied by default: tie_word_embeddings False)."""
    check_neox(s)
    h, f = s.hidden, s.ffn
    out = [("gpt_neox.embed_in.weight", (s.vocab, h))]
    for i in range(s.n_layers):
        n = f"gpt_neox.layers.{i}."
        for name, rows, cols in (("input_layernorm", h, 0), ("post_attention_layernorm", h, 0),
                                 ("attention.query_key_value", 3 * h, h), ("attention.dense", h, h),
                                 ("mlp.dense_h_to_4h", f, h), ("mlp.dense_4h_to_h", h, f)):  # fmt: skip
            out += [(n + name + ".weight", (rows, cols) if cols else (rows,)), (n + name + ".bias", (rows,))]
    out += [("gpt_neox.final_layer_norm.weight", (h,)), ("gpt_neox.final_layer_norm.bias", (h,))]
    return out + ([] if s.tied_embeddings else [("lm_head.weight", (s.vocab, h))])


def check_neox(s: ModelShape) -> None:
    """What modeling_gpt_neox.py fixes: LayerNorm pre-norms, biases everywhere (attention_bias), an
    ungated MLP, one head size hidden // num_attention_heads for q, k and v (no GQA), no window."""
    wiring = (s.norm, s.norm_layout, s.qk_norm, s.linear_bias, s.gated_mlp, s.n_kv_heads, s.head_dim * s.n_heads,
              bool(s.sliding_window), s.attn_softcap, s.logit_softcap)  # fmt: skip
    if wiring != ("layernorm", "pre", False, True, False, s.n_heads, s.hidden, False, 0.0, 0.0):
        raise InputError(f"Transformers' gpt_neox builds LayerNorm pre-norms, biases, an ungated MLP and "
                         f"hidden/heads-sized heads for q, k and v; {s.name}'s shape differs")  # fmt: skip


def neox_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """GPTNeoXModel.forward: embed_in; the DynamicCache; position_ids (arange + past length, unsqueezed);
    create_causal_mask; emb_dropout; the rotary tables (cast to the model's dtype); the layers, each given
    position_ids and the forward's **kwargs; final_layer_norm."""
    cfg, p = m.cfg, m.cfg.shape.dropout
    B, T = input_ids.shape
    with g.scoped("embedding"):
        inputs_embeds = embedded(g, m, aten.embedding(g, m.p["gpt_neox.embed_in.weight"], input_ids))
        dynamic_cache.construct(g, m)
        position_ids = arange_plus(g, T)
    causal = causal_mask(g, cfg, B, T, position_ids, inputs_embeds.dtype)
    with g.scoped("embedding dropout"):
        hidden_states = dropout(g, inputs_embeds, p)
    with g.scoped("rope tables"):
        cos, sin = rotary_embedding(g, m, position_ids, T, hidden_states.dtype)
    hidden_states = decoder_layers(g, m, neox_layer, hidden_states, causal, cos, sin, (position_ids,) + kwargs)
    with g.scoped("final norm"):
        hidden_states = layer_norm(g, m, "gpt_neox.final_layer_norm", hidden_states)
    del inputs_embeds, position_ids, causal, cos, sin
    return hidden_states


def neox_layer(g: Graph, m: HFModel, i: int, hidden_states: Tensor, causal, cos, sin, kwargs) -> Tensor:
    """GPTNeoXLayer.forward: attention(input_layernorm(x)) (the norm's output, an argument, dies with the
    call), post_attention_dropout; parallel: mlp(post_attention_layernorm(x)), post_mlp_dropout, then
    mlp_output + attn_output + x (the first sum a temporary); sequential: attn_output + x, then
    mlp(post_attention_layernorm(that)) + it."""
    n, p = f"gpt_neox.layers.{i}.", m.cfg.shape.dropout
    with g.scoped("norm1"):
        normed = layer_norm(g, m, n + "input_layernorm", hidden_states)
    with g.scoped("attention"):
        attn_output, attn_weights = neox_attention(g, m, n + "attention.", normed, causal, cos, sin, kwargs)
        del normed
        attn_output = dropout(g, attn_output, p)
    if not m.cfg.shape.parallel_residual:
        attn_output = aten.add(g, attn_output, hidden_states)
    with g.scoped("norm2"):
        normed = layer_norm(g, m, n + "post_attention_layernorm", hidden_states if m.cfg.shape.parallel_residual
                            else attn_output)  # fmt: skip
    with g.scoped("mlp"):
        mlp_output = neox_mlp(g, m, n + "mlp.", normed)
        del normed  # the norm's output, an argument, dies with the call
        mlp_output = dropout(g, mlp_output, p)
    if m.cfg.shape.parallel_residual:
        both = aten.add(g, mlp_output, attn_output)
        hidden_states = aten.add(g, both, hidden_states)
        del both
    else:
        hidden_states = aten.add(g, mlp_output, attn_output)
    del attn_output, attn_weights, mlp_output
    return hidden_states


def neox_mlp(g: Graph, m: HFModel, n: str, x: Tensor) -> Tensor:
    """GPTNeoXMLP.forward: dense_4h_to_h(act(dense_h_to_4h(x))), act ACT2FN["gelu"] (F.gelu: its input saved)."""
    return linear(g, m, n + "dense_4h_to_h", aten.gelu(g, linear(g, m, n + "dense_h_to_4h", x)))


def neox_attention(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal, cos, sin, kwargs):
    """GPTNeoXAttention.forward: qkv = query_key_value(x).view(B, T, n, 3d).transpose(1, 2) (views: the
    gradient arriving through the chunks' cat is contiguous (B, n, T, 3d), so reshaping it back copies
    where there is more than one head); q, k, v = qkv.chunk(3, -1); partial RoPE (q and k come out
    contiguous from its cat); the cache's update; the attention interface; reshape(B, T, -1) (a view of the
    interface's contiguous output); dense."""
    s, cfg = m.cfg.shape, m.cfg
    B, T, _ = hidden_states.shape
    qkv = linear(g, m, n + "query_key_value", hidden_states)
    qkv = transpose12(g, aten.view(g, qkv, (B, T, s.n_heads, 3 * s.head_dim), s.n_heads > 1))
    query_states, key_states, value_states = aten.split_last(g, qkv, s.head_dim)  # chunk(3, dim=-1)
    query_states, key_states = apply_rotary_pos_emb(g, query_states, key_states, cos, sin)
    key_states, value_states = dynamic_cache.update(g, m, key_states, value_states)
    attn_output, attn_weights = attention_interface(g, cfg, query_states, key_states, value_states, causal, kwargs,
                                                    contiguous_qk=True)  # fmt: skip
    attn_output = aten.view(g, attn_output, (B, T, s.hidden))
    attn_output = linear(g, m, n + "dense", attn_output)
    del qkv, query_states, key_states, value_states
    return attn_output, attn_weights


def apply_rotary_pos_emb(g: Graph, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """modeling_gpt_neox.py apply_rotary_pos_emb: cos.unsqueeze(1), sin.unsqueeze(1) (views); q_rot, q_pass
    = q[..., :rotary_dim], q[..., rotary_dim:] and k's alike; both rotated parts computed (q_rot * cos +
    rotate_half(q_rot) * sin, then k's), then each cat with the part it passes (Phi-3's cats q's before
    rotating k)."""
    cos, sin = g.view(cos, (1, 1) + cos.shape[1:]), g.view(sin, (1, 1) + sin.shape[1:])
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = rotary_part(g, q, rotary_dim), aten.slice_last(g, q, rotary_dim, q.shape[-1])
    k_rot, k_pass = rotary_part(g, k, rotary_dim), aten.slice_last(g, k, rotary_dim, k.shape[-1])
    q_embed = aten.add(g, aten.mul(g, q_rot, cos), aten.mul(g, rotate_half(g, q_rot), sin))
    k_embed = aten.add(g, aten.mul(g, k_rot, cos), aten.mul(g, rotate_half(g, k_rot), sin))
    q_embed = aten.cat_last(g, q_embed, q_pass)
    k_embed = aten.cat_last(g, k_embed, k_pass)
    del q_rot, q_pass, k_rot, k_pass
    return q_embed, k_embed


GPT_NEOX = Family(neox_params, rope_buffers, neox_model, "gpt_neox.embed_in.weight",
                  lambda s, t: decoder_config(s, t, hidden_act="gelu", rotary_pct=s.rotary_fraction,
                                              use_parallel_residual=s.parallel_residual, layer_norm_eps=NORM_EPS,
                                              hidden_dropout=s.dropout, attention_bias=True, bos_token_id=None,
                                              eos_token_id=None), lora=True)  # fmt: skip
