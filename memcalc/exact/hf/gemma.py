"""Transformers' Gemma, Gemma 2 and Gemma 3 (text) decoders, op by op, in bytes on memcalc.exact.sim.graph:
  models/gemma/modeling_gemma.py    GemmaTextScaledWordEmbedding (the embeddings times embed_scale, a 0-d
                                    buffer in the model's dtype), GemmaRMSNorm (in fp32, times 1 + weight in
                                    fp32, then cast back), GemmaMLP (GeGLU: gelu_pytorch_tanh), GemmaAttention
                                    (Llama's ops: memcalc.exact.hf.llama), GemmaDecoderLayer, GemmaModel
  models/gemma2/modeling_gemma2.py  Gemma2DecoderLayer (four norms: each branch normed before and after),
                                    eager_attention_forward (its scores softcapped: memcalc.exact.hf.attention),
                                    Gemma2Model (a full and a sliding causal mask, both held through forward),
                                    Gemma2ForCausalLM (the logits softcapped: memcalc.exact.hf.model causal_lm); no sdpa
  models/gemma3/modeling_gemma3.py  Gemma3Attention (q_norm, k_norm per head, after the transpose),
                                    Gemma3RotaryEmbedding (cos and sin for each layer type, each from its own
                                    inv_freq), Gemma3TextModel, Gemma3ForCausalLM
The masks are memcalc.exact.hf.attention's (create_causal_mask, create_sliding_window_causal_mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

from .. import aten
from ..aten.operands import made
from ..builder.layers import transpose12
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import dynamic_cache
from .attention import arange_plus, causal_mask, grad_copies, sliding_window_causal_mask
from .family import Family, decoder_config, decoder_params
from .llama import cast, liger_layer, linear, scaled, self_attention
from .lora import embedded

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel

FULL, SLIDING = "full_attention", "sliding_attention"
NO_SDPA = ("Transformers' gemma2 runs no sdpa, so no flash kernel (modeling_gemma2.py Gemma2PreTrainedModel, "
           "line 353: _supports_sdpa = False, 'sdpa does not support softcapping'): drop flash for its eager "
           "attention")  # fmt: skip


# -- the config the replay is built from ------------------------------------------------------------------


def gemma_layer_types(s: ModelShape) -> list[str]:
    """config.layer_types: "sliding_attention" where the layer has a window (shape.window_at), else
    "full_attention"."""
    return [SLIDING if s.window_at(i) else FULL for i in range(s.n_layers)]


def gemma_window(s: ModelShape, seq_len: int) -> int:
    """config.sliding_window: the shape's; a shape without one gets one longer than the sequence (Gemma2Model
    and Gemma3TextModel build the sliding mask whatever the layer types: create_sliding_window_causal_mask
    raises without a window), which masks nothing."""
    return s.sliding_window or seq_len + 1


def flash_refused(arch: str) -> str:
    """Why Transformers cannot run an architecture's attention on the flash kernel ('' where it can): Gemma 2's
    softcapped scores (its class refuses attn_implementation="sdpa")."""
    return NO_SDPA if arch == "gemma2" else ""


def check_gemma(s: ModelShape, arch: str) -> None:
    """What each modeling file fixes: GeGLU, RoPE over all of each head, no biases (attention_bias off);
    gemma: pre-norms, no window, no q/k norms, no softcaps; gemma2: the sandwich, no q/k norms; gemma3_text:
    the sandwich, q/k norms per head, no softcap on the scores (Gemma3Attention passes none to attention)."""
    common = dict(gated_mlp=True, activation="gelu", norm="rmsnorm", positions="rope", rotary_fraction=1.0,
                  qkv_bias=False, linear_bias=False, parallel_residual=False, qk_norm_over="head")  # fmt: skip
    fixed = {"gemma": dict(norm_layout="pre", qk_norm=False, sliding_window=0, attn_softcap=0.0, logit_softcap=0.0),
             "gemma2": dict(norm_layout="sandwich", qk_norm=False),
             "gemma3_text": dict(norm_layout="sandwich", qk_norm=True, attn_softcap=0.0)}[arch]  # fmt: skip
    if any(getattr(s, name) != value for name, value in (common | fixed).items()):
        what = {"gemma": "pre-norms and no window, q/k norms or softcaps", "gemma2": "the sandwich norms and no q/k "
                "norms", "gemma3_text": "the sandwich norms, q/k norms per head and no softcap on the scores"}[arch]
        raise InputError(f"Transformers' {arch} builds a GeGLU MLP, RMSNorms, full rotary positions, no biases, "
                         f"{what}; {s.name}'s shape differs")  # fmt: skip


# -- parameters and buffers ---------------------------------------------------------------------------------


def layer_params(s: ModelShape, n: str, qk_norm: bool, sandwich: bool) -> list[tuple[str, tuple]]:
    """One decoder layer in __init__ order: self_attn (q, k, v, o_proj; Gemma3Attention then q_norm, k_norm),
    mlp (gate, up, down_proj), input_layernorm, post_attention_layernorm (Gemma 2/3: pre_feedforward_layernorm,
    post_feedforward_layernorm)."""
    h, f = s.hidden, s.ffn
    out = [(n + "self_attn.q_proj.weight", (s.q_dim, h)), (n + "self_attn.k_proj.weight", (s.kv_dim, h)),
           (n + "self_attn.v_proj.weight", (s.kv_dim, h)), (n + "self_attn.o_proj.weight", (h, s.q_dim))]
    if qk_norm:
        out += [(n + "self_attn.q_norm.weight", (s.head_dim,)), (n + "self_attn.k_norm.weight", (s.head_dim,))]
    out += [(n + "mlp.gate_proj.weight", (f, h)), (n + "mlp.up_proj.weight", (f, h)),
            (n + "mlp.down_proj.weight", (h, f))]  # fmt: skip
    norms = ("input", "post_attention", "pre_feedforward", "post_feedforward") if sandwich else ("input",
                                                                                                 "post_attention")
    return out + [(f"{n}{norm}_layernorm.weight", (h,)) for norm in norms]


def params_of(arch: str):
    """XForCausalLM's named_parameters(): embed_tokens, the layers, norm (a tied lm_head is not listed)."""

    def params(s: ModelShape) -> list[tuple[str, tuple]]:
        check_gemma(s, arch)
        return decoder_params(s, lambda n: layer_params(s, n, arch == "gemma3_text", arch != "gemma"))

    return params


def gemma_buffers(s: ModelShape) -> list[tuple]:
    """model.named_buffers(): GemmaTextScaledWordEmbedding's embed_scale (torch.tensor(hidden ** 0.5): 0-d, in
    the model's dtype), GemmaRotaryEmbedding's inv_freq and original_inv_freq (fp32, head_dim/2 each)."""
    return [("model.embed_tokens.embed_scale", (), "weights"), ("model.rotary_emb.inv_freq", (s.head_dim // 2,)),
            ("model.rotary_emb.original_inv_freq", (s.head_dim // 2,))]


def gemma3_buffers(s: ModelShape) -> list[tuple]:
    """Gemma3TextModel's: embed_scale, then Gemma3RotaryEmbedding's {type}_inv_freq and {type}_original_inv_freq
    for each layer type the config has, in sorted order (sorted(set(config.layer_types)))."""
    out = [("model.embed_tokens.embed_scale", (), "weights")]
    for kind in sorted(set(gemma_layer_types(s))):
        out += [(f"model.rotary_emb.{kind}_{name}", (s.head_dim // 2,)) for name in ("inv_freq", "original_inv_freq")]
    return out


# -- the model ----------------------------------------------------------------------------------------------


def gemma_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """GemmaModel.forward, Gemma2Model.forward, Gemma3TextModel.forward: the scaled embedding, position_ids,
    the masks (gemma: create_causal_mask; Gemma 2 and 3: a dict of it and create_sliding_window_causal_mask),
    the rotary tables (Gemma 3: one pair per layer type), the layers (each checkpointed whole under full
    recompute: the partial's kwargs, its mask and tables, live until its recompute), the final norm."""
    cfg, s = m.cfg, m.cfg.shape
    if cfg.flash and flash_refused(m.arch):
        raise InputError(flash_refused(m.arch))
    B, T = input_ids.shape
    with g.scoped("embedding"):
        inputs_embeds = embedded(g, m, scaled_embedding(g, m, input_ids))
        dynamic_cache.construct(g, m)  # cache = DynamicCache(config=self.config)
        position_ids = arange_plus(g, T)  # .unsqueeze(0): (1, T)
    masks = causal_masks(g, m, B, T, position_ids, inputs_embeds.dtype)
    hidden_states = inputs_embeds
    with g.scoped("rope tables"):
        tables = rotary_tables(g, m, position_ids, T, hidden_states.dtype)
    types = gemma_layer_types(s) if m.arch != "gemma" else [FULL] * s.n_layers
    for i in range(s.n_layers):
        g.layer = i
        causal, (cos, sin) = masks[types[i]], tables[types[i]]
        if cfg.recompute == "full":  # GradientCheckpointingLayer: checkpoint(partial(forward, **kwargs), hidden_states)
            hidden_states = m.checkpoint(g)(lambda x, i=i, causal=causal, cos=cos, sin=sin, kw=(position_ids,) + kwargs:
                                            decoder_layer(g, m, i, x, causal, cos, sin, kw), hidden_states)  # fmt: skip
        else:
            hidden_states = decoder_layer(g, m, i, hidden_states, causal, cos, sin, (position_ids,) + kwargs)
        del causal, cos, sin
    g.layer = None
    hidden_states = gemma_kernels(m)[0](g, hidden_states, m.p["model.norm.weight"], "final norm")
    del inputs_embeds, position_ids, masks, tables  # the frame's locals
    return hidden_states


def scaled_embedding(g: Graph, m: HFModel, input_ids: Tensor) -> Tensor:
    """GemmaTextScaledWordEmbedding.forward: super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)
    (the buffer has the weight's dtype: no cast); the product saves the 0-d buffer, the embedding dies."""
    return aten.mul(g, aten.embedding(g, m.p["model.embed_tokens.weight"], input_ids), m.rope[0])


def causal_masks(g: Graph, m: HFModel, B: int, T: int, position_ids: Tensor, dtype: str) -> dict:
    """GemmaModel.forward: create_causal_mask. Gemma2Model.forward, Gemma3TextModel.forward: causal_mask_mapping,
    {"full_attention": create_causal_mask(...), "sliding_attention": create_sliding_window_causal_mask(...)},
    each run whatever the layer types (each with its packed-sequence check)."""
    cfg = m.cfg
    full = causal_mask(g, cfg, B, T, position_ids, dtype)
    if m.arch == "gemma":
        return {FULL: full}
    window = gemma_window(cfg.shape, T)
    return {FULL: full, SLIDING: sliding_window_causal_mask(g, cfg, B, T, position_ids, dtype, window)}


def rotary_tables(g: Graph, m: HFModel, position_ids: Tensor, T: int, dtype: str) -> dict:
    """The position embeddings each layer type gets. GemmaModel, Gemma2Model: self.rotary_emb(hidden_states,
    position_ids), one (cos, sin) for every layer. Gemma3TextModel: for layer_type in set(config.layer_types),
    self.rotary_emb(hidden_states, position_ids, layer_type), from that type's inv_freq (m.rope after
    embed_scale, in gemma3_buffers' order; the set's order does not change the bytes: the tables are alike)."""
    if m.arch != "gemma3_text":
        table = rope_table(g, position_ids, T, m.rope[1], dtype)
        return {FULL: table, SLIDING: table}
    kinds = sorted(set(gemma_layer_types(m.cfg.shape)))
    return {kind: rope_table(g, position_ids, T, m.rope[1 + 2 * k], dtype) for k, kind in enumerate(kinds)}


def rope_table(g: Graph, position_ids: Tensor, T: int, inv_freq: Tensor, dtype: str) -> tuple[Tensor, Tensor]:
    """GemmaRotaryEmbedding.forward (Gemma3RotaryEmbedding.forward for one layer type): position_ids[..., None]
    .float() * inv_freq, cat with itself, cos() and sin() each times attention_scaling, cast to x's dtype."""
    half = inv_freq.shape[0]
    position = made(g, (1, T, 1), "_to_copy", position_ids)
    freqs = made(g, (1, T, half), "mul", position, inv_freq)
    del position
    emb = made(g, (1, T, 2 * half), "cat", freqs)
    cos = scaled(g, made(g, (1, T, 2 * half), "cos", emb))
    sin = scaled(g, made(g, (1, T, 2 * half), "sin", emb))
    out = cast(g, cos, dtype), cast(g, sin, dtype)
    del freqs, emb, cos, sin
    return out


def rms_norm(g: Graph, x: Tensor, w: Tensor, scope: str) -> Tensor:
    """GemmaRMSNorm.forward (Gemma2RMSNorm, Gemma3RMSNorm): output = _norm(x.float()), x * rsqrt(x.pow(2)
    .mean(-1, keepdim=True) + eps); output * (1.0 + self.weight.float()); .type_as(x). Unlike Llama's, the
    weight's product is in fp32; x.float() lives while _norm runs, the fp32 product until it returns."""
    with g.scoped(scope):
        output = norm(g, aten.to(g, x, "fp32"))
        output = aten.mul(g, output, aten.add_scalar(g, aten.to(g, w, "fp32")))
        return aten.to(g, output, x.dtype)


def norm(g: Graph, x: Tensor) -> Tensor:
    """GemmaRMSNorm._norm: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)."""
    return aten.mul(g, x, aten.rsqrt(g, aten.add_scalar(g, aten.mean_last(g, aten.pow2(g, x)))))


def decoder_layer(g: Graph, m: HFModel, i: int, hidden_states: Tensor, causal, cos, sin, kwargs) -> Tensor:
    """GemmaDecoderLayer.forward: x + attn(input_layernorm(x)), then h + mlp(post_attention_layernorm(h)).
    Gemma2DecoderLayer.forward (Gemma3's): x + post_attention_layernorm(attn(input_layernorm(x))), then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). The attention weights (_) live until
    it returns."""
    n, sandwich = f"model.layers.{i}.", m.arch != "gemma"
    rms, mlp, rope = gemma_kernels(m)
    residual = hidden_states
    hidden_states = rms(g, hidden_states, m.p[n + "input_layernorm.weight"], "norm1")
    with g.scoped("attention"):
        hidden_states, _ = self_attention(g, m, n + "self_attn.", hidden_states, causal, cos, sin, kwargs,
                                          projections, rope)  # fmt: skip
    if sandwich:
        hidden_states = rms(g, hidden_states, m.p[n + "post_attention_layernorm.weight"], "attention norm")
    hidden_states = aten.add(g, residual, hidden_states)
    residual = hidden_states
    before_mlp = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    hidden_states = rms(g, hidden_states, m.p[n + before_mlp + ".weight"], "norm2")
    with g.scoped("mlp"):
        hidden_states = mlp(g, m, n + "mlp.", hidden_states)
    if sandwich:
        hidden_states = rms(g, hidden_states, m.p[n + "post_feedforward_layernorm.weight"], "mlp norm")
    hidden_states = aten.add(g, residual, hidden_states)
    del residual, _
    return hidden_states


def gemma_kernels(m: HFModel) -> tuple:
    """The layer's (norm, mlp, rope): Transformers' own, or under the Trainer's use_liger_kernel Liger's
    (memcalc.exact.hf.liger: LigerRMSNormForGemma, LigerGEGLUMLP, LigerRopeFunction; the projections carry no
    per-head norm on Gemma and Gemma 2)."""
    if m.cfg.stack.savers.liger is None:
        return rms_norm, gemma_mlp, None
    norm, _, rope, mlp = liger_layer(m)
    return norm, mlp, rope


def gemma_mlp(g: Graph, m: HFModel, n: str, x: Tensor) -> Tensor:
    """GemmaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)); act_fn gelu_pytorch_tanh (GELUTanh:
    F.gelu(approximate="tanh"))."""
    return linear(g, m, n + "down_proj", aten.mul(g, aten.gelu(g, linear(g, m, n + "gate_proj", x)),
                                                  linear(g, m, n + "up_proj", x)))  # fmt: skip


def projections(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal) -> tuple[Tensor, Tensor, Tensor]:
    """GemmaAttention.forward (Gemma2Attention's: Llama's ops), Gemma3Attention.forward: q, k, v projected,
    viewed per head and transposed; Gemma 3: q_norm and k_norm on the (B, n, T, d) views (Gemma3RMSNorm per
    head). RoPE, the cache, the interface (Gemma 2: its softcap among the kwargs, no tensor) and o_proj are
    Llama's (hf_llama.self_attention)."""
    s = m.cfg.shape
    B, T, _ = hidden_states.shape
    q_copies, k_copies, v_copies = grad_copies(m.cfg, m.cfg.flash and causal is not None)  # a window's mask
    if m.cfg.stack.savers.liger is not None:  # Liger's RoPE hands q's and k's gradients back (B, T, n, d)-laid out
        q_copies = k_copies = False
    query_states = transpose12(g, aten.view(g, linear(g, m, n + "q_proj", hidden_states),
                                            (B, T, s.n_heads, s.head_dim), q_copies))  # fmt: skip
    key_states = transpose12(g, aten.view(g, linear(g, m, n + "k_proj", hidden_states),
                                          (B, T, s.n_kv_heads, s.head_dim), k_copies))  # fmt: skip
    value_states = transpose12(g, aten.view(g, linear(g, m, n + "v_proj", hidden_states),
                                            (B, T, s.n_kv_heads, s.head_dim), v_copies))  # fmt: skip
    if s.qk_norm:
        query_states = rms_norm(g, query_states, m.p[n + "q_norm.weight"], "attention")
        key_states = rms_norm(g, key_states, m.p[n + "k_norm.weight"], "attention")
    return query_states, key_states, value_states




def gemma_config(shape: ModelShape, seq_len: int, **extra) -> dict:
    """Gemma 2's and Gemma 3's fields (configuration_gemma2.py, configuration_gemma3.py): GeGLU
    (hidden_activation), scores scaled by head_dim ** -0.5 (query_pre_attn_scalar), each layer's type
    and the window (a shape without one gets one longer than the sequence: gemma_window), the final logits'
    softcap where the shape has one."""
    return decoder_config(shape, seq_len, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=shape.head_dim,
                          layer_types=gemma_layer_types(shape), sliding_window=gemma_window(shape, seq_len),
                          final_logit_softcapping=shape.logit_softcap or None, **extra)  # fmt: skip


GEMMA = Family(params_of("gemma"), gemma_buffers, gemma_model, "model.embed_tokens.weight",
               lambda s, t: decoder_config(s, t, hidden_act="gelu_pytorch_tanh"), lora=True)  # GemmaMLP: ACT2FN
GEMMA2 = Family(params_of("gemma2"), gemma_buffers, gemma_model, "model.embed_tokens.weight",
                lambda s, t: gemma_config(s, t, attn_logit_softcapping=s.attn_softcap or None), lora=True)
GEMMA3_TEXT = Family(params_of("gemma3_text"), gemma3_buffers, gemma_model, "model.embed_tokens.weight",
                     gemma_config, lora=True)  # Gemma3Attention passes no softcap to attention
