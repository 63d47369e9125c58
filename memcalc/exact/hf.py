"""Hugging Face Transformers' causal language models, op by op, in bytes on memcalc.exact.sim.

What verify/hf.py builds (AutoModelForCausalLM.from_config, trained as the Trainer does) replayed
without torch: the parameters in named_parameters() order, and each forward function of
transformers 5.x's modeling files line by line, so that Python keeps the same temporaries alive for
the same time. Citations name the file and the function mirrored:
  models/llama/modeling_llama.py    LlamaRMSNorm (fp32 upcast), LlamaRotaryEmbedding (fp32 inv_freq,
                                    cos and sin cast to the model's dtype), apply_rotary_pos_emb and
                                    rotate_half (slices: their backward writes full-size zeros),
                                    repeat_kv, eager_attention_forward (softmax in fp32), LlamaMLP,
                                    LlamaDecoderLayer, LlamaModel, LlamaForCausalLM
  models/qwen3/modeling_qwen3.py    the same, with q_norm and k_norm per head before the transpose
  models/qwen2, models/mistral      the same ops (qwen2: biases on q, k, v)
  models/gpt2/modeling_gpt2.py      Conv1D (addmm on a (in, out) weight), the fused c_attn split,
                                    NewGELU ("gelu_new", written out in eight ops), three dropouts
  masking_utils.py                  create_causal_mask: the packed-sequence check, and for eager a
                                    (B, 1, T, T) additive mask held through forward
  loss/loss_utils.py                ForCausalLMLoss: logits.float(), labels padded and shifted,
                                    cross-entropy summed and divided by num_items_in_batch
The attention interface on meta is verify/hf.py's: sdpa's training path calling the flash op that
CUDA's SDPA runs (aten._scaled_dot_product_flash_attention), or the model's eager path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

from . import aten
from .autocast import Autocast, autocast_for
from .builder import made, repeat_kv, transpose12
from .config import Config
from .sim import Graph, Tensor

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2")
REPLAYED = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def arch_for(shape: ModelShape) -> str:
    """The Transformers architecture whose modeling file builds exactly this shape (mistral builds what
    llama does: memcalc's shape cannot tell them apart)."""
    if not shape.gated_mlp:
        gpt2 = (shape.norm, shape.positions, shape.linear_bias, shape.qk_norm, shape.qkv_bias) == (
            "layernorm", "learned", True, False, False)  # fmt: skip
        if gpt2 and shape.n_kv_heads == shape.n_heads and shape.head_dim * shape.n_heads == shape.hidden:
            return "gpt2"
    elif shape.norm == "rmsnorm" and shape.positions == "rope" and not shape.linear_bias:
        if shape.qk_norm and not shape.qkv_bias and shape.activation == "silu":
            return "qwen3"
        if shape.qkv_bias and not shape.qk_norm and shape.activation == "silu":
            return "qwen2"
        if not shape.qk_norm and not shape.qkv_bias and shape.activation == "gelu" and shape.tied_embeddings:
            return "gemma"
        if not shape.qk_norm and not shape.qkv_bias and shape.activation == "silu":
            return "llama"
    raise InputError(f"no Transformers architecture builds {shape.name}'s shape ({shape.family} family, {shape.norm}, "
                     f"{shape.positions} positions); the hf stack builds {', '.join(ARCHS)}")  # fmt: skip


@dataclass
class HFModel:
    cfg: Config
    arch: str
    p: dict[str, Tensor]  # the parameters by name
    rope: list[Tensor]  # LlamaRotaryEmbedding's inv_freq and original_inv_freq (fp32 buffers)
    params: list[Tensor] = field(default_factory=list)  # in model.parameters() order
    autocast: Autocast | None = None  # the autocast recipe's: the forward Accelerate prepared runs under it


# -- build ----------------------------------------------------------------------------------------


def param_shapes(s: ModelShape, arch: str) -> list[tuple[str, tuple]]:
    """named_parameters() of the model as __init__ registers them (a tied lm_head is not listed)."""
    h, f = s.hidden, s.ffn
    if arch == "gpt2":  # GPT2LMHeadModel: Conv1D weights are (in, out)
        out = [("transformer.wte.weight", (s.vocab, h)), ("transformer.wpe.weight", (s.max_positions, h))]
        for i in range(s.n_layers):
            n = f"transformer.h.{i}."
            out += [(n + "ln_1.weight", (h,)), (n + "ln_1.bias", (h,)),
                    (n + "attn.c_attn.weight", (h, 3 * h)), (n + "attn.c_attn.bias", (3 * h,)),
                    (n + "attn.c_proj.weight", (h, h)), (n + "attn.c_proj.bias", (h,)),
                    (n + "ln_2.weight", (h,)), (n + "ln_2.bias", (h,)),
                    (n + "mlp.c_fc.weight", (h, f)), (n + "mlp.c_fc.bias", (f,)),
                    (n + "mlp.c_proj.weight", (f, h)), (n + "mlp.c_proj.bias", (h,))]  # fmt: skip
        out += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
        return out + ([] if s.tied_embeddings else [("lm_head.weight", (s.vocab, h))])
    out = [("model.embed_tokens.weight", (s.vocab, h))]
    for i in range(s.n_layers):
        n = f"model.layers.{i}."
        for proj, rows in (("q_proj", s.q_dim), ("k_proj", s.kv_dim), ("v_proj", s.kv_dim)):
            out.append((f"{n}self_attn.{proj}.weight", (rows, h)))
            if arch == "qwen2":  # Qwen2Attention: bias=True on q, k, v
                out.append((f"{n}self_attn.{proj}.bias", (rows,)))
        out.append((n + "self_attn.o_proj.weight", (h, s.q_dim)))
        if arch == "qwen3":
            out += [(n + "self_attn.q_norm.weight", (s.head_dim,)), (n + "self_attn.k_norm.weight", (s.head_dim,))]
        out += [(n + "mlp.gate_proj.weight", (f, h)), (n + "mlp.up_proj.weight", (f, h)),
                (n + "mlp.down_proj.weight", (h, f)), (n + "input_layernorm.weight", (h,)),
                (n + "post_attention_layernorm.weight", (h,))]  # fmt: skip
    out.append(("model.norm.weight", (h,)))
    return out + ([] if s.tied_embeddings else [("lm_head.weight", (s.vocab, h))])


def build(g: Graph, cfg: Config) -> HFModel:
    """The parameters in model.parameters() order, in the model's dtype (fp32 under autocast), and the
    rotary buffers: inv_freq and original_inv_freq, fp32 (hs/2) each (LlamaRotaryEmbedding.__init__)."""
    arch = arch_for(cfg.shape)
    if arch not in REPLAYED:
        raise InputError(f"the exact model does not replay Transformers' {arch} yet; it replays {', '.join(REPLAYED)}")
    params = [g.param(shape, cfg.weights_dtype, name) for name, shape in param_shapes(cfg.shape, arch)]
    rope = [] if arch == "gpt2" else [g.empty((cfg.shape.head_dim // 2,), "fp32", "buffer " + name, kind="buffer")
                                      for name in ("inv_freq", "original_inv_freq")]  # fmt: skip
    autocast = autocast_for(cfg.recipe, cfg.precision, cfg.device)
    return HFModel(cfg, arch, {p.name: p for p in params}, rope, params, autocast)


# -- the Trainer's step ---------------------------------------------------------------------------


def forward(g: Graph, m: HFModel, idx: Tensor, labels: Tensor) -> Tensor:
    """verify/hf.py TrainerModel.forward: the Trainer's count of labels (trainer.py
    _get_num_items_in_batch), the model called with labels and that count (compute_loss), and the
    loss scaled by the process count in place (loss *= 1). Under autocast the model's forward is the
    one Accelerate prepared (verify/hf.py amp_forward): the forward in the autocast region, then its
    16-bit logits converted to an fp32 copy (convert_to_fp32), the output (both logits) dropped once
    compute_loss has taken the loss."""
    with g.scoped("loss"):
        num_items_in_batch = num_items(g, labels)
    if m.autocast is None:
        loss, logits = causal_lm(g, m, idx, labels, num_items_in_batch)
        del logits  # the output dies as the loss is taken from it
    else:
        with m.autocast.region(g):
            loss, logits = causal_lm(g, m, idx, labels, num_items_in_batch)
        with g.scoped("logits"):
            converted = aten.to(g, logits, "fp32")  # accelerate convert_to_fp32: logits.float()
        del logits, converted
    with g.scoped("loss"):
        aten.mul_scalar_(g, loss)
    return loss


def num_items(g: Graph, labels: Tensor) -> Tensor:
    """sum(x.ne(-100).sum() for x in [labels[..., 1:]]): a bool temporary, a 0-d count, and 0 + it."""
    B, T = labels.shape
    ne = made(g, (B, T - 1), "ne", labels, dtype="bool")
    counted = made(g, (), "sum", ne, dtype="int64")
    del ne
    total = made(g, (), "add", counted, dtype="int64")
    del counted
    return total


def causal_lm(g: Graph, m: HFModel, idx: Tensor, labels: Tensor,
              num_items_in_batch: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """LlamaForCausalLM.forward / GPT2LMHeadModel.forward: the decoder, the head on every position
    (slice_logits_to_keep(h, 0) keeps all: no op), the loss. Its output holds the loss and the logits,
    which live until compute_loss has taken the loss from it."""
    kwargs = (num_items_in_batch,)  # **kwargs: on to the decoder layers and the attention interface
    hidden_states = gpt2_model(g, m, idx, kwargs) if m.arch == "gpt2" else llama_model(g, m, idx, kwargs)
    tied = "transformer.wte.weight" if m.arch == "gpt2" else "model.embed_tokens.weight"
    head = m.p.get("lm_head.weight") or m.p[tied]
    with g.scoped("logits"):
        logits = aten.linear(g, hidden_states, head, None, "logits")  # (B, T, V)
    with g.scoped("loss"):
        loss = for_causal_lm_loss(g, logits, labels, num_items_in_batch)
    del kwargs, hidden_states
    return loss, logits  # CausalLMOutputWithPast(loss, logits)


def for_causal_lm_loss(g: Graph, logits: Tensor, labels: Tensor, num_items_in_batch: Tensor) -> Tensor:
    """loss/loss_utils.py ForCausalLMLoss: logits.float(); labels padded by one ignore_index and
    shifted (labels[..., 1:].contiguous(): a view of the padded labels for one row, since a size-1
    dim does not break contiguity; a copy for more); fixed_cross_entropy with reduction "sum", then
    / num_items_in_batch."""
    B, T, V = logits.shape
    logits = aten.to(g, logits, "fp32")
    labels = made(g, (B, T + 1), "constant_pad_nd", labels, dtype="int64")
    shift_labels = g.view(labels, (B, T)) if B == 1 else made(g, (B, T), "clone", labels, dtype="int64")
    logits = aten.view(g, logits, (B * T, V))
    shift_labels = g.view(shift_labels, (B * T,))
    loss = aten.nll_loss(g, aten.log_softmax(g, logits), shift_labels)  # F.cross_entropy, reduction "sum"
    loss = aten.div_tensor(g, loss, num_items_in_batch)
    del logits, labels, shift_labels  # the frame's locals, in order
    return loss


# -- masks ----------------------------------------------------------------------------------------


def causal_mask(g: Graph, cfg: Config, B: int, T: int, position_ids: Tensor, dtype: str) -> Tensor | None:
    """masking_utils.create_causal_mask with no attention_mask: _preprocess_mask_arguments runs
    find_packed_sequence_indices; sdpa's mask is skipped (is_causal); eager's is built in
    inputs_embeds' dtype (dtype: fp32 under autocast, whose embedding is on no list)."""
    with g.scoped("mask"):
        find_packed_sequence_indices(g, B, T, position_ids)
        return None if cfg.flash else eager_mask(g, B, T, dtype)


def find_packed_sequence_indices(g: Graph, B: int, T: int, position_ids: Tensor) -> None:
    """position_ids[:, :1] - 1; torch.diff with it prepended (a cat, then a sub); != 1; cumsum; and
    (packed[:, -1] == 0).all(): not packed, so None. (position_ids expanded to B rows: a view.)"""
    first_dummy_value = made(g, (B, 1), "sub", position_ids, dtype="int64")
    prepended = made(g, (B, T + 1), "cat", first_dummy_value, position_ids, dtype="int64")
    position_diff = made(g, (B, T), "sub", prepended, dtype="int64")
    del prepended
    ne = made(g, (B, T), "ne", position_diff, dtype="bool")
    packed_sequence_mask = made(g, (B, T), "cumsum", ne, dtype="int64")
    del ne
    eq = made(g, (B,), "eq", packed_sequence_mask, dtype="bool")
    every = made(g, (), "all", eq, dtype="bool")
    del eq, every
    del first_dummy_value, position_diff, packed_sequence_mask


def eager_mask(g: Graph, B: int, T: int, dtype: str) -> Tensor:
    """eager_mask: sdpa_mask's bool (1, 1, T, T) from index aranges (kv_idx <= q_idx), expanded to
    (B, 1, T, T) (a view), then torch.where(mask, 0, finfo.min): (B, 1, T, T) in the model's dtype."""
    mask = sdpa_mask(g, B, T)
    zero = made(g, (), "zeros", dtype=dtype)
    low = made(g, (), "scalar_tensor", dtype=dtype)
    out = made(g, (B, 1, T, T), "where", mask, zero, low, dtype=dtype)
    del low, zero, mask
    return out


def sdpa_mask(g: Graph, B: int, T: int) -> Tensor:
    batch_arange = made(g, (B,), "arange", dtype="int64")
    head_arange = made(g, (1,), "arange", dtype="int64")
    q_arange = arange_plus(g, T)  # torch.arange(q_length) + q_offset
    kv_arange = arange_plus(g, T)
    mask = made(g, (1, 1, T, T), "le", q_arange, kv_arange, dtype="bool")
    del batch_arange, head_arange, q_arange, kv_arange
    return g.view(mask, (B, 1, T, T))  # .expand(batch_size, -1, q_length, kv_length)


def arange_plus(g: Graph, n: int) -> Tensor:
    """torch.arange(n) + offset: the sum is a new tensor, the arange dies."""
    a = made(g, (n,), "arange", dtype="int64")
    return made(g, (n,), "add", a, dtype="int64")


# -- Llama, Mistral, Qwen2, Qwen3 -----------------------------------------------------------------


def llama_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """LlamaModel.forward (Qwen2Model, Qwen3Model and MistralModel run the same ops). Each layer gets
    position_ids and the forward's **kwargs (num_items_in_batch): a checkpointed layer's partial, or
    a checkpointed attention core's closure, holds them until its recompute."""
    cfg, s = m.cfg, m.cfg.shape
    B, T = input_ids.shape
    with g.scoped("embedding"):
        inputs_embeds = aten.embedding(g, m.p["model.embed_tokens.weight"], input_ids)
        position_ids = arange_plus(g, T)  # .unsqueeze(0): (1, T)
    causal = causal_mask(g, cfg, B, T, position_ids, inputs_embeds.dtype)
    hidden_states = inputs_embeds
    with g.scoped("rope tables"):
        cos, sin = rotary_embedding(g, m, position_ids, T, hidden_states.dtype)
    for i in range(s.n_layers):
        g.layer = i
        if cfg.recompute == "full":  # GradientCheckpointingLayer: checkpoint(partial(forward, **kwargs), hidden_states)
            hidden_states = g.checkpoint(lambda x, i=i, causal=causal, cos=cos, sin=sin, kw=(position_ids,) + kwargs:
                                         decoder_layer(g, m, i, x, causal, cos, sin, kw), hidden_states)  # fmt: skip
        else:  # (the lambda's defaults are the partial's kwargs: they live until its recompute)
            hidden_states = decoder_layer(g, m, i, hidden_states, causal, cos, sin, (position_ids,) + kwargs)
    g.layer = None
    hidden_states = rms_norm(g, hidden_states, m.p["model.norm.weight"], "final norm")
    del position_ids, inputs_embeds, causal, cos, sin  # the frame's locals, in order
    return hidden_states


def rotary_embedding(g: Graph, m: HFModel, position_ids: Tensor, T: int, dtype: str) -> tuple[Tensor, Tensor]:
    """LlamaRotaryEmbedding.forward: position_ids[..., None].float() * inv_freq (fp32), cat with itself,
    cos() and sin() each times attention_scaling (1.0: a new tensor), then cast to the model's dtype."""
    half, hs = m.cfg.shape.head_dim // 2, m.cfg.shape.head_dim
    position = made(g, (1, T, 1), "_to_copy", position_ids)
    freqs = made(g, (1, T, half), "mul", position, m.rope[0])
    del position
    emb = made(g, (1, T, hs), "cat", freqs)
    cos = scaled(g, made(g, (1, T, hs), "cos", emb))
    sin = scaled(g, made(g, (1, T, hs), "sin", emb))
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
    to the attention interface."""
    n = f"model.layers.{i}."
    residual = hidden_states
    hidden_states = rms_norm(g, hidden_states, m.p[n + "input_layernorm.weight"], "norm1")
    with g.scoped("attention"):
        hidden_states, _ = self_attention(g, m, n + "self_attn.", hidden_states, causal, cos, sin, kwargs)
    hidden_states = aten.add(g, residual, hidden_states)
    residual = hidden_states
    hidden_states = rms_norm(g, hidden_states, m.p[n + "post_attention_layernorm.weight"], "norm2")
    with g.scoped("mlp"):
        hidden_states = llama_mlp(g, m, n + "mlp.", hidden_states)
    hidden_states = aten.add(g, residual, hidden_states)
    del residual, _
    return hidden_states


def linear(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """nn.Linear: F.linear with the module's weight (and bias)."""
    return aten.linear(g, x, m.p[name + ".weight"], m.p.get(name + ".bias"))


def llama_mlp(g: Graph, m: HFModel, n: str, x: Tensor) -> Tensor:
    """LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)); act_fn silu (SiLUActivation)."""
    return linear(g, m, n + "down_proj", aten.mul(g, aten.silu(g, linear(g, m, n + "gate_proj", x)),
                                                  linear(g, m, n + "up_proj", x)))  # fmt: skip


def self_attention(g: Graph, m: HFModel, n: str, hidden_states: Tensor, causal, cos, sin, kwargs):
    """LlamaAttention.forward (Qwen3Attention: q_norm, k_norm on (B, T, n, d) before the transpose):
    projections viewed per head and transposed, RoPE, the attention interface, o_proj. The pre-RoPE
    q and k die as RoPE's results replace them; k and v live until it returns."""
    s, cfg = m.cfg.shape, m.cfg
    B, T, _ = hidden_states.shape
    q_copies, k_copies, v_copies = grad_copies(cfg)
    query_states = aten.view(g, linear(g, m, n + "q_proj", hidden_states), (B, T, s.n_heads, s.head_dim), q_copies)
    if m.arch == "qwen3":
        query_states = rms_norm(g, query_states, m.p[n + "q_norm.weight"], "attention")
    query_states = transpose12(g, query_states)
    key_states = aten.view(g, linear(g, m, n + "k_proj", hidden_states), (B, T, s.n_kv_heads, s.head_dim), k_copies)
    if m.arch == "qwen3":
        key_states = rms_norm(g, key_states, m.p[n + "k_norm.weight"], "attention")
    key_states = transpose12(g, key_states)
    value_states = transpose12(g, aten.view(g, linear(g, m, n + "v_proj", hidden_states),
                                            (B, T, s.n_kv_heads, s.head_dim), v_copies))  # fmt: skip
    query_states, key_states = apply_rotary_pos_emb(g, query_states, key_states, cos, sin)
    attn_output, attn_weights = attention_interface(g, cfg, query_states, key_states, value_states, causal, kwargs)
    attn_output = aten.view(g, attn_output, (B, T, s.q_dim))  # reshape(*input_shape, -1).contiguous()
    attn_output = linear(g, m, n + "o_proj", attn_output)
    del query_states, key_states, value_states
    return attn_output, attn_weights


def grad_copies(cfg: Config) -> tuple[bool, bool, bool]:
    """Whether the gradient reaching each (B, T, n, d) view of q, k, v arrives laid out so that reshaping
    it to (B, T, n·d) copies (never with one head). With RoPE (Llama, Qwen) as memcalc.exact.builder's
    eager path and flash path: the same RoPE, the same layouts. GPT-2: flash's gradients arrive
    (B, T, n, d)-laid out (no copies); eager's q and v gradients arrive (B, n, T, d)-laid out (copies),
    k's through kᵀ, whose (n, d) dims merge (none)."""
    s = cfg.shape
    if s.positions == "rope":
        return s.n_heads > 1, s.n_kv_heads > 1, s.n_kv_heads > 1 and not cfg.flash
    return s.n_heads > 1 and not cfg.flash, False, s.n_kv_heads > 1 and not cfg.flash


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


def attention_interface(g: Graph, cfg: Config, q, k, v, causal, kwargs: tuple):
    """ALL_ATTENTION_FUNCTIONS[config._attn_implementation]: the flash path or the model's eager
    function, the core checkpointed under selective recompute (verify/hf.py core_checkpointed, whose
    closure holds the call's kwargs, position_ids among them, until the recompute)."""
    if cfg.recompute == "selective":
        return g.checkpoint(lambda q, k, v, causal, kwargs=kwargs: attention_core(g, cfg, q, k, v, causal),
                            q, k, v, causal)  # fmt: skip
    return attention_core(g, cfg, q, k, v, causal)


def attention_core(g: Graph, cfg: Config, q, k, v, causal):
    with g.scoped("attention core"):
        if cfg.flash:
            return sdpa_flash_forward(g, q, k, v, cfg.device == "cpu"), None
        if cfg.shape.positions != "rope":
            return gpt2_eager_attention(g, cfg, q, k, v, causal)
        return eager_attention_forward(g, cfg, q, k, v, causal)


def sdpa_flash_forward(g: Graph, q: Tensor, k: Tensor, v: Tensor, cpu: bool = False) -> Tensor:
    """verify/hf.py sdpa_flash_forward: the flash op on q, k, v (GQA: k and v unrepeated), its output
    reshaped (same shape: a view) and transpose(1, 2).contiguous() (a view: the output is laid out
    (B, T, n, d)). On CPU tensors (cpu): the stock sdpa path on SDPA's CPU flash kernel."""
    out = aten.flash_attention(g, q, k, v, cpu)
    out = aten.view(g, out, out.shape)
    return transpose12(g, out)


def eager_attention_forward(g: Graph, cfg: Config, query, key, value, attention_mask):
    """modeling_llama.py eager_attention_forward: repeat_kv; matmul(q, kᵀ) * scaling; + the mask;
    softmax in fp32 (dtype=torch.float32: a cast, then _softmax), cast back to q's dtype; dropout;
    matmul with v; transpose(1, 2).contiguous() (a copy). The probabilities are returned too."""
    B, groups = query.shape[0], query.shape[1] // key.shape[1]
    copied = groups > 1 and key.shape[1] > 1  # repeat_kv made contiguous copies
    # repeat_kv of one key head is an expand (heads at stride 0); autocast's cast of it (matmul is on
    # both lists; RoPE left k fp32 under autocast) is laid out contiguous (_to_copy with
    # preserve_format of a tensor that is not non-overlapping and dense: empty_like's suggested
    # format), so matmul views it to 3-D where it would copy the expanded view
    cast_expanded = groups > 1 and not copied and g.autocast is not None and key.dtype != g.autocast.dtype
    key_states, value_states = repeat_kv(g, key, query.shape[1]), repeat_kv(g, value, query.shape[1])
    kt = aten.view(g, key_states, key_states.shape[:2] + (key_states.shape[3], key_states.shape[2]))
    k_copies = B > 1 and not copied and not cast_expanded
    attn_weights = aten.mul_scalar(g, aten.matmul4(g, query, kt, B > 1, k_copies, False))
    del kt
    attn_weights = aten.add(g, attn_weights, attention_mask)
    attn_weights = aten.to(g, aten.softmax(g, aten.to(g, attn_weights, "fp32")), query.dtype)
    attn_weights = dropout(g, attn_weights, cfg.shape.dropout)
    attn_output = aten.matmul4(g, attn_weights, value_states, False, B > 1 and not copied, B > 1)
    attn_output = aten.reshape_copy(g, transpose12(g, attn_output), (B, query.shape[2], query.shape[1],
                                                                     query.shape[3]))  # fmt: skip
    del key_states, value_states
    return attn_output, attn_weights


def dropout(g: Graph, x: Tensor, p: float) -> Tensor:
    """F.dropout as CUDA runs it: the input itself at p = 0, else aten.native_dropout (a bool mask)."""
    return aten.native_dropout(g, x) if p > 0 else x


# -- GPT-2 ----------------------------------------------------------------------------------------


def gpt2_model(g: Graph, m: HFModel, input_ids: Tensor, kwargs: tuple) -> Tensor:
    """GPT2Model.forward: token and position embeddings added, the mask, embedding dropout (embd_pdrop),
    the blocks, ln_f, a view. The embeddings and the mask live until it returns."""
    cfg, s = m.cfg, m.cfg.shape
    B, T = input_ids.shape
    p = s.dropout
    with g.scoped("embedding"):
        inputs_embeds = aten.embedding(g, m.p["transformer.wte.weight"], input_ids)
        position_ids = arange_plus(g, T)
        position_embeds = aten.embedding(g, m.p["transformer.wpe.weight"], g.view(position_ids, (1, T)))
        hidden_states = aten.add(g, inputs_embeds, position_embeds)
    causal = causal_mask(g, cfg, B, T, position_ids, inputs_embeds.dtype)
    with g.scoped("embedding dropout"):
        hidden_states = dropout(g, hidden_states, p)
    for i in range(s.n_layers):
        g.layer = i
        if cfg.recompute == "full":  # the mask is a positional argument: a checkpoint input
            hidden_states = g.checkpoint(lambda x, mask, i=i, kw=(position_ids,) + kwargs: gpt2_block(g, m, i, x, mask, kw),
                                         hidden_states, causal)  # fmt: skip
        else:
            hidden_states = gpt2_block(g, m, i, hidden_states, causal, (position_ids,) + kwargs)
    g.layer = None
    with g.scoped("final norm"):
        hidden_states = layer_norm(g, m, "transformer.ln_f", hidden_states)
    hidden_states = aten.view(g, hidden_states, hidden_states.shape)  # .view(output_shape)
    del position_ids, inputs_embeds, position_embeds, causal
    return hidden_states


def layer_norm(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    return aten.layer_norm(g, x, m.p[name + ".weight"], m.p[name + ".bias"])


def conv1d(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """pytorch_utils.py Conv1D.forward: addmm(bias, x.view(-1, in), weight) on a (in, out) weight, viewed back."""
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


def gpt2_eager_attention(g: Graph, cfg: Config, query, key, value, attention_mask):
    """modeling_gpt2.py eager_attention_forward: matmul(q, kᵀ) * scaling; + the mask; softmax in the
    input's dtype, then .type(value.dtype); dropout (attn_pdrop); matmul with v; transpose(1, 2) (a view). q, k and v are
    strided views of c_attn's output: matmul copies them where B and the heads cannot merge (B > 1)."""
    B = query.shape[0]
    kt = aten.view(g, key, key.shape[:2] + (key.shape[3], key.shape[2]))  # key.transpose(-1, -2)
    attn_weights = aten.mul_scalar(g, aten.matmul4(g, query, kt, B > 1, B > 1, False))
    del kt
    attn_weights = aten.add(g, attn_weights, attention_mask)
    attn_weights = aten.softmax(g, attn_weights)
    attn_weights = aten.to(g, attn_weights, value.dtype)  # .type(value.dtype): under autocast fp32 to 16 bits
    attn_weights = dropout(g, attn_weights, cfg.shape.dropout)
    attn_output = aten.matmul4(g, attn_weights, value, False, B > 1, B > 1)
    return transpose12(g, attn_output), attn_weights


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
