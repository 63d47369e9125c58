"""Hugging Face Transformers' causal language models, op by op, in bytes on memcalc.exact.sim.graph.

What verify/hf.py builds (AutoModelForCausalLM.from_config, trained as the Trainer does) replayed
without torch: the parameters in named_parameters() order, and each forward function of
transformers 5.x's modeling files line by line, so that Python keeps the same temporaries alive for
the same time. Citations name the file and the function mirrored. This module: which architecture
builds a shape, its parameters, and the Trainer's step around the model (trainer.py compute_loss,
LlamaForCausalLM.forward and GPT2LMHeadModel.forward, loss/loss_utils.py ForCausalLMLoss: logits.float(),
labels padded and shifted, cross-entropy summed and divided by num_items_in_batch). The decoders are
memcalc.exact.hf.llama's (Llama, Mistral, Qwen2, Qwen3), hf_gpt2's, hf_gemma's, hf_olmo2's, hf_phi3's and
hf_gpt_neox's; the causal mask and the attention interface, which all call, memcalc.exact.hf.attention's.
"""

from __future__ import annotations

from collections.abc import Callable

from memcalc.errors import InputError
from memcalc.model.finetune import Finetune, missing_targets
from memcalc.model.savers import OFFLOAD_MIN_BYTES, OFFLOAD_STASH, offload_mode
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import FUSED_HEAD

from .. import aten
from ..aten.cast_policy import autocast_for
from ..aten.operands import made
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.offload import kept_on_gpu, offloader
from ..sim.tensors import Tensor
from . import chunked_nll, dpo, dpo_logits, dynamic_cache, fused_head, grpo, liger, lora, ppo, qlora, rloo, trl
from .family import NORM_EPS, Family, HFModel, decoder_config, decoder_params, rope_buffers
from .gemma import GEMMA, GEMMA2, GEMMA3_TEXT
from .gpt2 import gpt2_model
from .gpt_neox import GPT_NEOX
from .llama import llama_model
from .olmo2 import OLMO2
from .phi3 import PHI3
from .ppo_models import Critic, check_ppo, decay_first


def finetune_not_replayed(finetune: Finetune, arch: str, model: str) -> str | None:
    """Why the replay cannot run this fine-tuning (LoRA, QLoRA, frozen weights), or None."""
    if finetune.trains_all:
        return None
    if model != "hf":
        return ("LoRA and frozen weights are replayed on Transformers' classes wrapped by PEFT (--stack hf), "
                f"not on --stack {model}'s model")  # fmt: skip
    with_lora = [name for name, family in FAMILIES.items() if family.lora]
    if arch not in with_lora:
        what = "LoRA is" if finetune.lora else "frozen weights are"
        return f"{what} replayed on Transformers' {', '.join(with_lora)}, not {arch}"
    missing = missing_targets(arch, finetune)
    if missing:
        return missing
    if arch == "gpt2" and (finetune.quantize or finetune.dora):  # PEFT's LoRA around Conv1D (fan_in_fan_out)
        return ("GPT-2's Conv1D layers take LoRA as PEFT wraps them; QLoRA's 4-bit layers and DoRA's norm on them "
                "are not replayed")  # fmt: skip
    if finetune.quantize not in ("", "nf4"):
        return (f"--quantize {finetune.quantize}: bitsandbytes' LLM.int8() splits out the input columns past "
                "llm_int8_threshold (6.0 in Transformers' BitsAndBytesConfig), as many as the data has: its "
                "memory is not a function of the shape, so it is not replayed (nf4 is: QLoRA)")  # fmt: skip
    return None


def check_finetune(finetune: Finetune, arch: str, model: str) -> None:
    reason = finetune_not_replayed(finetune, arch, model)
    if reason:
        raise InputError(reason)


def arch_for(shape: ModelShape) -> str:
    """The Transformers architecture whose modeling file builds exactly this shape: the one it was read from
    (shape.arch), else the one its fields describe (mistral builds what llama does: the fields cannot tell
    them apart)."""
    if shape.arch:
        if shape.arch not in FAMILIES:
            raise InputError(f"the hf stack builds {', '.join(FAMILIES)}, not {shape.arch!r}")
        return shape.arch
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
                     f"{shape.positions} positions); the hf stack builds {', '.join(FAMILIES)}")  # fmt: skip


def param_shapes(s: ModelShape, arch: str) -> list[tuple[str, tuple]]:
    """named_parameters() of the model as __init__ registers them (a tied lm_head is not listed)."""
    return FAMILIES[arch].params(s)


def gpt2_params(s: ModelShape) -> list[tuple[str, tuple]]:
    """GPT2LMHeadModel: Conv1D weights are (in, out)."""
    h, f = s.hidden, s.ffn
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


def llama_params(s: ModelShape) -> list[tuple[str, tuple]]:
    """LlamaForCausalLM (Mistral; Qwen2: q, k, v biases; Qwen3: q_norm, k_norm per head)."""
    h, f = s.hidden, s.ffn

    def layer(n: str) -> list[tuple[str, tuple]]:
        out = []
        for proj, rows in (("q_proj", s.q_dim), ("k_proj", s.kv_dim), ("v_proj", s.kv_dim)):
            out.append((f"{n}self_attn.{proj}.weight", (rows, h)))
            if s.qkv_bias:  # Qwen2Attention: bias=True on q, k, v
                out.append((f"{n}self_attn.{proj}.bias", (rows,)))
        out.append((n + "self_attn.o_proj.weight", (h, s.q_dim)))
        if s.qk_norm:
            out += [(n + "self_attn.q_norm.weight", (s.head_dim,)), (n + "self_attn.k_norm.weight", (s.head_dim,))]
        return out + [(n + "mlp.gate_proj.weight", (f, h)), (n + "mlp.up_proj.weight", (f, h)),
                      (n + "mlp.down_proj.weight", (h, f)), (n + "input_layernorm.weight", (h,)),
                      (n + "post_attention_layernorm.weight", (h,))]  # fmt: skip

    return decoder_params(s, layer)


def gpt2_config(shape: ModelShape, seq_len: int) -> dict:
    """configuration_gpt2.py's fields."""
    return dict(vocab_size=shape.vocab, n_positions=shape.max_positions, n_embd=shape.hidden,
                n_layer=shape.n_layers, n_head=shape.n_heads, n_inner=shape.ffn, layer_norm_epsilon=NORM_EPS,
                embd_pdrop=shape.dropout, attn_pdrop=shape.dropout, resid_pdrop=shape.dropout,
                tie_word_embeddings=shape.tied_embeddings, use_cache=False, bos_token_id=None,
                eos_token_id=None)  # fmt: skip


def llama_family(fields: Callable[[ModelShape], dict]) -> Family:
    """A model_type LlamaModel's forward builds, its config's own fields (biases, window) given by `fields`."""
    return Family(llama_params, rope_buffers, llama_model, "model.embed_tokens.weight",
                  lambda s, t: decoder_config(s, t, hidden_act="silu", **fields(s)), lora=True)  # fmt: skip


# model_type -> the family that replays it: the one list of what the hf stack builds (docs/architecture.md: adding one)
FAMILIES: dict[str, Family] = {
    "llama": llama_family(lambda s: dict(attention_bias=False, mlp_bias=False)),
    "mistral": llama_family(lambda s: dict(attention_bias=False, sliding_window=s.sliding_window or None)),
    "qwen2": llama_family(lambda s: {}),  # q, k, v biases are fixed in Qwen2Attention
    "qwen3": llama_family(lambda s: dict(attention_bias=False)),
    "gemma": GEMMA,
    "gpt2": Family(gpt2_params, lambda s: [], gpt2_model, "transformer.wte.weight", gpt2_config, lora=True),
    "olmo2": OLMO2,
    "phi3": PHI3,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3_TEXT,
    "gpt_neox": GPT_NEOX,
}


def build(g: Graph, cfg: StepConfig) -> HFModel:
    """The parameters in model.parameters() order, in the model's dtype (fp32 under autocast; a LoRA model's as
    memcalc.exact.hf.lora loads it), and the rotary embeddings' fp32 buffers (LlamaRotaryEmbedding.__init__:
    inv_freq and original_inv_freq). HFModel.params: those that train."""
    arch = arch_for(cfg.shape)
    family = FAMILIES.get(arch)
    if family is None:
        raise InputError(f"the exact model does not replay Transformers' {arch} yet; it replays {', '.join(FAMILIES)}")
    check_finetune(cfg.finetune, arch, cfg.model)
    why = (liger.not_replayed(cfg, arch) if cfg.stack.savers.liger is not None else
           fused_head.not_replayed(cfg) or chunked_nll.not_replayed(cfg))  # fmt: skip
    if why:
        raise InputError(why)
    if cfg.stack.rl == "ppo":  # its value and reward models: --critic's architecture, else the policy's
        critic_shape = cfg.stack.ppo.critic or cfg.shape
        critic = Critic(critic_shape, arch_for(critic_shape), FAMILIES[arch_for(critic_shape)])
        check_ppo(cfg, family, arch, critic)
    if cfg.stack.rl == "dpo" and cfg.shape.dropout:  # disable_dropout_in_model zeroes nn.Dropout modules only
        raise InputError("--rl dpo on a model with dropout: DPOConfig.disable_dropout turns its nn.Dropout modules "
                         "off but not every family's attention dropout, which is not replayed")  # fmt: skip
    if cfg.stack.rl and cfg.shape.dropout:  # GRPOConfig's and RLOOConfig's disable_dropout is False
        raise InputError(f"--rl {cfg.stack.rl} on a model with dropout: {cfg.stack.rl.upper()}Config keeps it on "
                         "(disable_dropout False), and a step with dropout is not replayed")  # fmt: skip
    online = cfg.stack.online  # labels[:, :-C] = -100: a prompt of one token at least
    if online and online.completion_len >= cfg.seq_len:
        raise InputError(f"--completion-len {online.completion_len} leaves no prompt in --seq {cfg.seq_len}: the "
                         "sequence is the prompt and the completion together")  # fmt: skip
    if cfg.finetune.modules_to_save and cfg.shape.tied_embeddings:  # PEFT would copy the shared table's module
        raise InputError("--modules-to-save with a head tied to the embedding table is not replayed")
    quant, params = {}, []
    for name, shape in lora.with_adapters(family.params(cfg.shape), cfg.finetune, arch):
        if qlora.quantized(name, cfg.finetune.quantize):  # QLoRA's 4-bit projections
            quant[name.removesuffix(".weight")] = qlora.quantize(g, name, shape)
            params.append(quant[name.removesuffix(".weight")].data)
        else:
            params.append(lora.parameter(g, cfg, name, shape))
    shared = [qlora.dynamic_map(g)] if quant else []  # the nested quantisation's code, made once
    rope = [g.empty(b[1], cfg.weights_dtype if b[2:] == ("weights",) else "fp32", "buffer " + b[0], kind="buffer")
            for b in family.buffers(cfg.shape)]  # (name, shape), fp32, or (name, shape, "weights"): the model's dtype
    autocast = autocast_for(cfg.recipe, cfg.precision, cfg.device)
    trained = [p for p in params if p.requires_grad]  # what the optimizer holds: all but frozen weights
    reference = dpo.reference_model(g, cfg, arch, family, autocast)
    loop = None
    if cfg.stack.rl == "ppo":  # PolicyAndValueWrapper: the value model trains beside the policy, under one optimizer
        loop = ppo.loop_for(g, cfg, family, arch, critic)
        trained = decay_first(trained + loop.critic.params)
    return HFModel(cfg, arch, {p.name: p for p in params}, rope, trained, autocast, quant=quant, held=shared,
                   reference=reference, own_loop=loop)  # fmt: skip


def forward(g: Graph, m: HFModel, idx: Tensor, labels: Tensor) -> Tensor:
    """verify/hf.py TrainerModel.forward: the Trainer's count of labels (trainer.py
    _get_num_items_in_batch), the model called with labels and that count (compute_loss), and the
    loss scaled by the process count in place (loss *= 1). Under autocast the model's forward is the
    one Accelerate prepared (verify/amp.py amp_forward): the forward in the autocast region, then its
    16-bit logits converted to an fp32 copy (convert_to_fp32), the output (both logits) dropped once
    compute_loss has taken the loss. Under TRL (memcalc.exact.hf.trl) compute_loss then computes its metrics
    from the output's logits, and they die with them as it returns."""
    if m.cfg.stack.rl == "dpo":  # DPOTrainer's _compute_loss: its labels' slot holds the completion mask
        trainer = dpo if m.cfg.stack.trl in FUSED_HEAD else dpo_logits  # before 1.15: from the full logits
        return trainer.compute_loss(g, m, idx, labels, causal_lm)
    if m.cfg.stack.rl == "ppo":  # PPOTrainer.train's micro-batch: its own loop (memcalc.exact.hf.ppo)
        return ppo.compute_loss(g, m, idx, labels, causal_lm)
    if m.cfg.stack.rl in ("grpo", "rloo"):  # GRPOTrainer's, RLOOTrainer's: the labels' slot holds the attention mask
        return (grpo if m.cfg.stack.rl == "grpo" else rloo).compute_loss(g, m, idx, labels, causal_lm)
    if m.cfg.stack.savers.offload:  # TRL enters its OffloadActivations around training_step: forward and backward
        offloader(g, offload_mode(m.cfg.stack.trl), OFFLOAD_MIN_BYTES, OFFLOAD_STASH)
    with g.scoped("loss"):
        num_items_in_batch = num_items(g, labels)
    if m.autocast is None:
        loss, logits = causal_lm(g, m, idx, labels, num_items_in_batch)
    else:
        with m.autocast.region(g):
            loss, half = causal_lm(g, m, idx, labels, num_items_in_batch)
        with g.scoped("logits"):  # accelerate convert_to_fp32: logits.float() (Liger's output has none)
            logits = None if half is None else aten.to(g, half, "fp32")
        del half  # the model's own output goes as the wrapper returns the converted one
    if m.cfg.stack.trl in FUSED_HEAD:  # SFTTrainer's own compute_loss over the fused head's outputs (causal_lm's)
        outputs = loss
        del loss
        return trl.fused_compute_loss(g, outputs, num_items_in_batch)
    if m.cfg.stack.loss == "chunked_nll":  # the Trainer's compute_loss, then SFTTrainer's metrics from the counts
        outputs = loss
        loss = outputs.loss
        with g.scoped("loss"):
            aten.mul_scalar_(g, loss)
        trl.chunked_metrics(g, outputs, labels.shape)
        del outputs  # the output (its counts) dies as compute_loss returns the loss
        return loss
    held = trl.compute_loss_metrics(g, m.cfg, logits, labels)
    del logits, held  # the output (its cache too) dies as compute_loss returns the loss
    dynamic_cache.release(m)
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


def causal_lm(g: Graph, m: HFModel, idx: Tensor, labels: Tensor, num_items_in_batch: Tensor,
              keep: int = 0) -> tuple[Tensor | fused_head.FusedOutput, Tensor | None]:  # fmt: skip
    """LlamaForCausalLM.forward / GPT2LMHeadModel.forward: the decoder, the head on every position
    (slice_logits_to_keep(h, 0) keeps all: no op) or on the last `keep` (logits_to_keep: kept_positions), the
    loss. Its output holds the loss and the logits, which live until compute_loss has taken the loss from it. Under
    TRL's fused LM head (memcalc.exact.hf.fused_head) its forward, with no logits, and no cache (it passes
    use_cache=False)."""
    fused = m.cfg.stack.trl in FUSED_HEAD  # SFTTrainer calls it without num_items_in_batch
    chunked = m.cfg.stack.loss == "chunked_nll"  # TRL's patched forward takes it for its own division
    kwargs = () if fused or chunked else (num_items_in_batch,)  # **kwargs: on to the layers and attention interface
    family = FAMILIES[m.arch]
    dynamic_cache.start(m)
    hidden_states = family.decoder(g, m, idx, kwargs)
    head = m.p.get("lm_head.weight") or m.p[family.table]
    if fused:  # the backbone's output goes as the patched forward returns
        outputs = fused_head.fused_forward(g, m, hidden_states, head, labels)
        del kwargs, hidden_states
        return outputs, None
    if chunked:  # TRL's _chunked_ce_forward: the backbone, then _chunked_cross_entropy_loss (no logits)
        outputs = chunked_nll.chunked_forward(g, m, hidden_states, head, labels, num_items_in_batch)
        del kwargs, hidden_states
        return outputs, None
    if m.cfg.stack.savers.liger is not None:  # Liger's lce_forward: the head fused with the loss, no logits
        loss = liger.causal_lm_loss(g, m, hidden_states, head, labels, num_items_in_batch)
        del kwargs, hidden_states
        return loss, None
    with g.scoped("logits"), kept_on_gpu(g):
        kept, strided = kept_positions(g, hidden_states, keep)
        if "lm_head.lora_A.weight" in m.p:  # LoRA on the head (target_modules lm_head): PEFT's Linear around it
            logits = lora.lora_linear(g, m, "lm_head", kept)
        else:
            logits = aten.linear(g, kept, head, None, "logits", strided)  # (B, T, V), or (B, keep, V)
        del kept
    with g.scoped("logits"):
        if m.cfg.shape.logit_softcap:  # Gemma2ForCausalLM.forward: / final_logit_softcapping, tanh, * it
            logits = aten.div_scalar(g, logits)
            logits = aten.tanh(g, logits)
            logits = aten.mul_scalar(g, logits)
    if labels is None:  # called without labels (DPOTrainer before 1.15): the logits alone
        del kwargs, hidden_states
        return None, logits
    with g.scoped("loss"):
        loss = for_causal_lm_loss(g, logits, labels, num_items_in_batch)
    del kwargs, hidden_states
    return loss, logits  # CausalLMOutputWithPast(loss, logits)


def kept_positions(g: Graph, hidden_states: Tensor, keep: int) -> tuple[Tensor, bool]:
    """hidden_states[:, slice(-keep, None), :] (logits_to_keep): all of them where keep is 0 (slice(0, None): indexing
    returns the tensor itself); else a view of each sequence's last `keep` positions, which autograd records even
    where they are all of them (a negative start is not the whole-slice shortcut's 0): SliceBackward0, backward
    slice_backward, a zero (B, T, H) with the gradient copied in. Strided where B > 1 and it leaves positions out."""
    B, T, H = full = hidden_states.shape
    if not keep:
        return hidden_states, False
    node = g.begin("slice", [hidden_states], lambda gs: [made(g, full, "slice_backward", gs[0], dtype=gs[0].dtype)])
    out = g.view(hidden_states, (B, min(keep, T), H))
    g.end(node, [out])
    return out, B > 1 and keep < T


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
