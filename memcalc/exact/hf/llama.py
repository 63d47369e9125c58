"""Transformers' Llama decoder, op by op, in bytes on memcalc.exact.sim.graph:
  models/llama/modeling_llama.py    LlamaRMSNorm (fp32 upcast), LlamaRotaryEmbedding (fp32 inv_freq,
                                    cos and sin cast to the model's dtype), apply_rotary_pos_emb and
                                    rotate_half (slices: their backward writes full-size zeros),
                                    LlamaAttention, LlamaMLP, LlamaDecoderLayer, LlamaModel
  models/qwen3/modeling_qwen3.py    the same, with q_norm and k_norm per head before the transpose
  models/qwen2, models/mistral      the same ops (qwen2: biases on q, k, v)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.errors import InputError

from .. import aten
from ..aten.operands import made
from ..builder.layers import transpose12
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import dynamic_cache, liger
from .attention import arange_plus, attention_interface, decoder_mask, grad_copies
from .lora import embedded, lora_linear
from .qlora import linear4bit, lora_linear4bit

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel


def llama_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """LlamaModel.forward (Qwen2Model, Qwen3Model and MistralModel run the same ops)."""
    if m.cfg.shape.sliding_window and m.arch != "mistral":
        raise InputError(f"the hf stack replays Mistral's sliding window, not {m.arch}'s (Qwen2's use_sliding_window "
                         "layers: not built yet)")  # fmt: skip
    if m.cfg.stack.savers.liger is not None:  # the Trainer's use_liger_kernel (memcalc.exact.hf.liger)
        return decoder_forward(g, m, input_ids, kwargs, decoder_layer, liger.liger_norm(m))
    return decoder_forward(g, m, input_ids, kwargs, decoder_layer, rms_norm)


def decoder_forward(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple, layer, norm,
                    rope_dtype: str = "") -> Tensor:  # fmt: skip
    """LlamaModel.forward's ops, which MistralModel, Phi3Model and Olmo2Model run too: the embedding, the
    DynamicCache, position_ids, the mask (decoder_mask: Mistral's and Phi-3's window where set), the rotary
    tables (cast to the model's dtype; rope_dtype where they stay so, Olmo2RotaryEmbedding's fp32), the
    layers (layer: the family's decoder layer), the final norm (norm: the family's). Each layer gets
    position_ids and the forward's **kwargs (num_items_in_batch): a checkpointed layer's partial, or a
    checkpointed attention core's closure, holds them until its recompute."""
    cfg = m.cfg
    B, T = input_ids.shape
    with g.scoped("embedding"):
        inputs_embeds = embedded(g, m, aten.embedding(g, m.p["model.embed_tokens.weight"], input_ids))
        dynamic_cache.construct(g, m)  # cache = DynamicCache(config=self.config)
        position_ids = arange_plus(g, T) if m.position_ids is None else m.position_ids  # .unsqueeze(0): (1, T)
    causal = decoder_mask(g, cfg, B, T, position_ids, inputs_embeds.dtype, m.mask)
    hidden_states = inputs_embeds
    with g.scoped("rope tables"):
        cos, sin = rotary_embedding(g, m, position_ids, T, rope_dtype or hidden_states.dtype)
    hidden_states = decoder_layers(g, m, layer, hidden_states, causal, cos, sin, (position_ids,) + kwargs)
    hidden_states = norm(g, hidden_states, m.p["model.norm.weight"], "final norm")
    if m.captured is not None:  # capture_outputs: the last hidden state is the normed one
        m.captured.append(hidden_states)
    del position_ids, inputs_embeds, causal, cos, sin  # the frame's locals, in order
    return hidden_states


def decoder_layers(g: Graph, m: HFModel, layer, hidden_states: Tensor, causal, cos, sin, kwargs: tuple) -> Tensor:
    """XModel.forward's loop over its layers (layer: the family's decoder layer), each checkpointed whole
    under full recompute (GradientCheckpointingLayer: checkpoint(partial(forward, **kwargs), hidden_states):
    the lambda's defaults are the partial's kwargs, which live until its recompute)."""
    for i in range(m.cfg.shape.n_layers):
        g.layer = i
        if m.captured is not None:  # output_hidden_states (utils/output_capturing.py): each layer's input
            m.captured.append(hidden_states)
        if m.cfg.recompute == "full":
            hidden_states = m.checkpoint(g)(lambda x, i=i, causal=causal, cos=cos, sin=sin, kw=kwargs:
                                            layer(g, m, i, x, causal, cos, sin, kw), hidden_states)  # fmt: skip
        else:
            hidden_states = layer(g, m, i, hidden_states, causal, cos, sin, kwargs)
    g.layer = None
    return hidden_states


def rotary_embedding(g: Graph, m: HFModel, position_ids: Tensor, T: int, dtype: str) -> tuple[Tensor, Tensor]:
    """LlamaRotaryEmbedding.forward: position_ids[..., None].float() * inv_freq (fp32), cat with itself,
    cos() and sin() each times attention_scaling (1.0: a new tensor), then cast to the model's dtype. Over
    rope_dim: head_dim, or Phi-3's int(head_dim * partial_rotary_factor) (compute_default_rope_parameters:
    inv_freq has rope_dim / 2 entries). The tables have a row per row of position_ids: one in training (an
    arange), each sequence's under generate (memcalc.exact.hf.generate)."""
    half, width = m.cfg.shape.rope_dim // 2, m.cfg.shape.rope_dim
    rows = position_ids.shape[0] if len(position_ids.shape) == 2 else 1  # an arange, unsqueezed: one row
    position = made(g, (rows, T, 1), "_to_copy", position_ids)
    freqs = made(g, (rows, T, half), "mul", position, m.rope[0])
    del position
    emb = made(g, (rows, T, width), "cat", freqs)
    cos = scaled(g, made(g, (rows, T, width), "cos", emb))
    sin = scaled(g, made(g, (rows, T, width), "sin", emb))
    out = cast(g, cos, dtype), cast(g, sin, dtype)
    del freqs, emb, cos, sin
    return out


def scaled(g: Graph, x: Tensor) -> Tensor:
    return made(g, x.shape, "mul", x)


def cast(g: Graph, x: Tensor, dtype: str) -> Tensor:
    """x.to(dtype) of a tensor no gradient flows through: itself when it has that dtype."""
    return x if x.dtype == dtype else made(g, x.shape, "_to_copy", x, dtype=dtype)


def rms_norm(g: Graph, x: Tensor, w: Tensor, scope: str) -> Tensor:
    """LlamaRMSNorm.forward: to fp32; variance = pow(2).mean(-1); x * rsqrt(variance + eps);
    weight * that.to(input_dtype). The fp32 product and the variance die when it returns."""
    with g.scoped(scope):
        input_dtype = x.dtype
        hidden_states = aten.to(g, x, "fp32")
        variance = aten.mean_last(g, aten.pow2(g, hidden_states))
        hidden_states = aten.mul(g, hidden_states, aten.rsqrt(g, aten.add_scalar(g, variance)))
        out = aten.mul(g, w, aten.to(g, hidden_states, input_dtype))
        del hidden_states, variance
        return out


def decoder_layer(g: Graph, m: HFModel, i: int, hidden_states: Tensor, causal, cos, sin, kwargs) -> Tensor:
    """LlamaDecoderLayer.forward: pre-norm attention and MLP, each added to its residual; kwargs go on
    to the attention interface. Under the Trainer's use_liger_kernel its norms, RoPE and MLP are Liger's
    (memcalc.exact.hf.liger: liger_layer)."""
    n = f"model.layers.{i}."
    norm, project, rope, mlp = liger_layer(m) if m.cfg.stack.savers.liger is not None else (rms_norm, None, None,
                                                                                            llama_mlp)  # fmt: skip
    residual = hidden_states
    hidden_states = norm(g, hidden_states, m.p[n + "input_layernorm.weight"], "norm1")
    with g.scoped("attention"):
        hidden_states, _ = self_attention(g, m, n + "self_attn.", hidden_states, causal, cos, sin, kwargs, project,
                                          rope)  # fmt: skip
    hidden_states = aten.add(g, residual, hidden_states)
    residual = hidden_states
    hidden_states = norm(g, hidden_states, m.p[n + "post_attention_layernorm.weight"], "norm2")
    with g.scoped("mlp"):
        hidden_states = mlp(g, m, n + "mlp.", hidden_states)
    hidden_states = aten.add(g, residual, hidden_states)
    del residual, _
    return hidden_states


def liger_layer(m: HFModel) -> tuple:
    """The decoder layer's (norm, projections, rope, mlp) under Liger (memcalc.exact.hf.liger): LigerRMSNorm (Qwen3's
    q_norm and k_norm too), q, k and v projected as here, LigerRopeFunction, LigerSwiGLUMLP."""
    norm, cfg, s = liger.liger_norm(m), m.cfg, m.cfg.shape
    # the gradient reaches RoPE laid out as its input (flash's, made like q and k) unless it comes from a matmul
    # (eager attention), or, for k, through the cache's copy: contiguous (B, n, T, d), which its transpose copies
    # unless n is 1 (CPU's flash kernel lays its gradients out (B, T, n, d) whatever its inputs: hf.attention)
    cached = dynamic_cache.kept(cfg) and cfg.device != "cpu"
    copies = (not cfg.flash and s.n_heads > 1, (not cfg.flash or cached) and s.n_kv_heads > 1)
    return (norm, lambda g, m, n, h, causal: projections(g, m, n, h, causal, norm, rope_copies=False),
            lambda g, q, k, cos, sin: liger.rope(g, q, k, cos, sin, copies),
            lambda g, m, n, x: liger.swiglu_mlp(g, m, n, x, linear))  # fmt: skip


def linear(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """nn.Linear: F.linear with the module's weight (and bias); PEFT's LoRA Linear where it wraps the module;
    bitsandbytes' Linear4bit where QLoRA quantised it."""
    if name in m.quant:  # QLoRA's 4-bit base (memcalc.exact.hf.qlora), under LoRA or not
        return (lora_linear4bit if name + ".lora_A.weight" in m.p else linear4bit)(g, m, name, x)
    if name + ".lora_A.weight" in m.p:
        return lora_linear(g, m, name, x)
    return aten.linear(g, x, m.p[name + ".weight"], m.p.get(name + ".bias"))


def llama_mlp(g: Graph, m: HFModel, n: str, x: Tensor) -> Tensor:
    """LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)); act_fn silu (SiLUActivation)."""
    return linear(g, m, n + "down_proj", aten.mul(g, aten.silu(g, linear(g, m, n + "gate_proj", x)),
                                                  linear(g, m, n + "up_proj", x)))  # fmt: skip


def self_attention(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal, cos, sin, kwargs, project=None,
                   rope=None):  # fmt: skip
    """LlamaAttention.forward, which OLMo 2's and Gemma's attention follow: q, k, v projected, viewed per head
    and transposed (project: the family's, Llama's projections by default), RoPE (rope: the family's
    apply_rotary_pos_emb), the cache's update, the attention interface, o_proj. The pre-RoPE q and k die as
    RoPE's results replace them; k and v live until it returns."""
    s, cfg = m.cfg.shape, m.cfg
    B, T, _ = hidden_states.shape
    query_states, key_states, value_states = (project or projections)(g, m, n, hidden_states, causal)
    query_states, key_states = (rope or apply_rotary_pos_emb)(g, query_states, key_states, cos, sin)
    key_states, value_states = dynamic_cache.update(g, m, key_states, value_states)
    attn_output, attn_weights = attention_interface(g, cfg, query_states, key_states, value_states, causal, kwargs)
    attn_output = aten.view(g, attn_output, (B, T, s.q_dim))  # reshape(*input_shape, -1).contiguous()
    attn_output = linear(g, m, n + "o_proj", attn_output)
    del query_states, key_states, value_states
    return attn_output, attn_weights


def projections(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal, norm=rms_norm,
                rope_copies: bool = True) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """LlamaAttention.forward's q_proj, k_proj, v_proj, each viewed (B, T, n, d) and transposed (Qwen3Attention:
    q_norm, k_norm on the (B, T, n, d) views, before the transpose; norm: the model's RMSNorm). rope_copies False:
    q's and k's gradients reach their views laid out (B, T, n, d), as Liger's RoPE hands them back."""
    s = m.cfg.shape
    B, T, _ = hidden_states.shape
    q_copies, k_copies, v_copies = grad_copies(m.cfg, m.cfg.flash and causal is not None)  # a window's mask
    q_copies, k_copies = q_copies and rope_copies, k_copies and rope_copies
    query_states = aten.view(g, linear(g, m, n + "q_proj", hidden_states), (B, T, s.n_heads, s.head_dim), q_copies)
    if s.qk_norm:
        query_states = norm(g, query_states, m.p[n + "q_norm.weight"], "attention")
    query_states = transpose12(g, query_states)
    key_states = aten.view(g, linear(g, m, n + "k_proj", hidden_states), (B, T, s.n_kv_heads, s.head_dim), k_copies)
    if s.qk_norm:
        key_states = norm(g, key_states, m.p[n + "k_norm.weight"], "attention")
    key_states = transpose12(g, key_states)
    value_states = transpose12(g, aten.view(g, linear(g, m, n + "v_proj", hidden_states),
                                            (B, T, s.n_kv_heads, s.head_dim), v_copies))  # fmt: skip
    return query_states, key_states, value_states


def apply_rotary_pos_emb(g: Graph, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos.unsqueeze(1), sin.unsqueeze(1) (views); q * cos + rotate_half(q) * sin, then k likewise."""
    cos, sin = g.view(cos, (1, 1) + cos.shape[1:]), g.view(sin, (1, 1) + sin.shape[1:])
    q_embed = aten.add(g, aten.mul(g, q, cos), aten.mul(g, rotate_half(g, q), sin))
    k_embed = aten.add(g, aten.mul(g, k, cos), aten.mul(g, rotate_half(g, k), sin))
    return q_embed, k_embed


def rotate_half(g: Graph, x: Tensor) -> Tensor:
    """x1 = x[..., :d/2], x2 = x[..., d/2:] (slices); torch.cat((-x2, x1), dim=-1)."""
    half = x.shape[-1] // 2
    x1 = aten.slice_last(g, x, 0, half)
    x2 = aten.slice_last(g, x, half, x.shape[-1])
    return aten.cat_last(g, aten.neg(g, x2), x1)
