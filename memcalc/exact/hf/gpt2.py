"""Transformers' GPT-2 decoder, op by op, in bytes on memcalc.exact.sim.graph:
  models/gpt2/modeling_gpt2.py      GPT2Model, GPT2Block, GPT2Attention (the fused c_attn split), GPT2MLP,
                                    three dropouts
  pytorch_utils.py                  Conv1D (addmm on a (in, out) weight)
  activations.py                    NewGELU ("gelu_new", written out in eight ops)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import aten
from ..builder.layers import transpose12
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import dynamic_cache
from .attention import arange_plus, attention_interface, causal_mask, dropout, grad_copies
from .lora import embedded, lora_linear

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel


def gpt2_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """GPT2Model.forward: token and position embeddings added, the mask, embedding dropout (embd_pdrop),
    the blocks, ln_f, a view. The embeddings and the mask live until it returns."""
    cfg, s = m.cfg, m.cfg.shape
    B, T = input_ids.shape
    p = s.dropout
    with g.scoped("embedding"):
        inputs_embeds = embedded(g, m, aten.embedding(g, m.p["transformer.wte.weight"], input_ids))
        position_ids = arange_plus(g, T)
        position_embeds = aten.embedding(g, m.p["transformer.wpe.weight"], g.view(position_ids, (1, T)))
        hidden_states = aten.add(g, inputs_embeds, position_embeds)
    causal = causal_mask(g, cfg, B, T, position_ids, inputs_embeds.dtype)
    with g.scoped("embedding dropout"):
        hidden_states = dropout(g, hidden_states, p)
    for i in range(s.n_layers):
        g.layer = i
        if cfg.recompute == "full":  # the mask is a positional argument: a checkpoint input
            hidden_states = m.checkpoint(g)(lambda x, mask, i=i, kw=(position_ids,) + kwargs:
                                            gpt2_block(g, m, i, x, mask, kw), hidden_states, causal)  # fmt: skip
        else:
            hidden_states = gpt2_block(g, m, i, hidden_states, causal, (position_ids,) + kwargs)
    g.layer = None
    with g.scoped("final norm"):
        hidden_states = layer_norm(g, m, "transformer.ln_f", hidden_states)
    hidden_states = aten.view(g, hidden_states, hidden_states.shape)  # .view(output_shape)
    del position_ids, inputs_embeds, position_embeds, causal
    return hidden_states


def layer_norm(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """nn.LayerNorm: F.layer_norm with the module's weight and bias."""
    return aten.layer_norm(g, x, m.p[name + ".weight"], m.p[name + ".bias"], m.cfg.device == "cpu")


def conv1d(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """pytorch_utils.py Conv1D.forward: addmm(bias, x.view(-1, in), weight) on a (in, out) weight, viewed back;
    PEFT's LoRA Linear around it where it wraps the module (memcalc.exact.hf.lora.lora_linear)."""
    if name + ".lora_A.weight" in m.p:
        return lora_linear(g, m, name, x, lambda x: conv1d_base(g, m, name, x))
    return conv1d_base(g, m, name, x)


def conv1d_base(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """Conv1D.forward itself."""
    w = m.p[name + ".weight"]
    x2 = aten.view(g, x, (x.numel // x.shape[-1], x.shape[-1]))
    y = aten.addmm(g, m.p[name + ".bias"], x2, w)
    return aten.view(g, y, x.shape[:-1] + (w.shape[1],))


def gpt2_block(g: Graph, m: HFModel, i: int, hidden_states: Tensor, causal, kwargs: tuple) -> Tensor:
    """GPT2Block.forward: ln_1, attention, + residual; ln_2, MLP, + residual. Both branches' outputs
    live until it returns."""
    n = f"transformer.h.{i}."
    residual = hidden_states
    with g.scoped("norm1"):
        hidden_states = layer_norm(g, m, n + "ln_1", hidden_states)
    with g.scoped("attention"):
        attn_output, _ = gpt2_attention(g, m, n + "attn.", hidden_states, causal, kwargs)
    hidden_states = aten.add(g, attn_output, residual)
    residual = hidden_states
    with g.scoped("norm2"):
        hidden_states = layer_norm(g, m, n + "ln_2", hidden_states)
    with g.scoped("mlp"):
        feed_forward_hidden_states = gpt2_mlp(g, m, n + "mlp.", hidden_states)
    hidden_states = aten.add(g, residual, feed_forward_hidden_states)
    del residual, attn_output, _, feed_forward_hidden_states
    return hidden_states


def gpt2_attention(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal, kwargs: tuple):
    """GPT2Attention.forward: c_attn, split into q, k, v (views of one tensor), each viewed per head
    and transposed (k, v, then q); the interface; reshape (a copy after eager's transpose, a view
    after flash); c_proj; resid_dropout."""
    cfg, s = m.cfg, m.cfg.shape
    B, T, h = hidden_states.shape
    q_copies, k_copies, v_copies = grad_copies(cfg)
    query_states, key_states, value_states = aten.split_last(g, conv1d(g, m, n + "c_attn", hidden_states), h)
    shape = (B, T, s.n_heads, s.head_dim)
    key_states = transpose12(g, aten.view(g, key_states, shape, k_copies))
    value_states = transpose12(g, aten.view(g, value_states, shape, v_copies))
    query_states = transpose12(g, aten.view(g, query_states, shape, q_copies))
    key_states, value_states = dynamic_cache.update(g, m, key_states, value_states)
    attn_output, attn_weights = attention_interface(g, cfg, query_states, key_states, value_states, causal, kwargs)
    if cfg.flash:
        attn_output = aten.view(g, attn_output, (B, T, h))
    else:  # (B, T, n, d) transposed: reshape copies
        attn_output = aten.reshape_copy(g, attn_output, (B, T, h))
    attn_output = conv1d(g, m, n + "c_proj", attn_output)
    with g.scoped("attention dropout"):
        attn_output = dropout(g, attn_output, s.dropout)
    del query_states, key_states, value_states
    return attn_output, attn_weights


def gpt2_mlp(g: Graph, m: HFModel, n: str, x: Tensor) -> Tensor:
    """GPT2MLP.forward: c_fc, act (gelu_new), c_proj, dropout (resid_pdrop)."""
    hidden_states = new_gelu(g, conv1d(g, m, n + "c_fc", x))
    hidden_states = conv1d(g, m, n + "c_proj", hidden_states)
    with g.scoped("mlp dropout"):
        return dropout(g, hidden_states, m.cfg.shape.dropout)


def new_gelu(g: Graph, x: Tensor) -> Tensor:
    """activations.py NewGELUActivation: 0.5 * x * (1.0 + tanh(sqrt(2/π) * (x + 0.044715 * x³))),
    evaluated left to right: eight ops, five (B, T, f) tensors saved (x, 0.5·x, tanh, 1 + tanh, and
    the product, by c_proj) where F.gelu saves one."""
    half = aten.mul_scalar(g, x)  # 0.5 * x, evaluated first, held until the last product
    inner = aten.add(g, x, aten.mul_scalar(g, aten.pow_scalar(g, x, 3)))  # x + 0.044715 * x³
    scaled_inner = aten.mul_scalar(g, inner)  # sqrt(2/π) * (...)
    del inner  # each temporary dies as soon as the next op has used it
    th = aten.tanh(g, scaled_inner)
    del scaled_inner
    one_plus = aten.add_scalar(g, th)  # 1.0 + tanh(...)
    del th
    return aten.mul(g, half, one_plus)
