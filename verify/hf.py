"""The Hugging Face Transformers stack: the library's own model class, trained as its Trainer trains it.

memcalc's shape becomes a Transformers config (llama, mistral, qwen2, qwen3, gemma, gpt2) and the
model is AutoModelForCausalLM.from_config's, built on the meta device in the activation dtype (a
model loaded in bf16). What runs is the installed library's code (transformers/models/<arch>/
modeling_<arch>.py); memcalc.exact.hf.model mirrors it line by line. Three switches make meta and CPU
run what CUDA runs, as verify/builder_layers.py's Kernels do for the reference model:

  attention  "sdpa" on CUDA reaches aten._scaled_dot_product_flash_attention through
             F.scaled_dot_product_attention; on meta SDPA takes its math path. FLASH, registered
             through Transformers' AttentionInterface with sdpa's own mask function, runs
             integrations/sdpa_attention.py's training path and calls the flash op by name.
             Eager attention is the model's own eager_attention_forward. (Selective recompute, which
             Transformers has no switch for, wraps either in torch.utils.checkpoint: SELECTIVE.)
  dropout    F.dropout is aten.native_dropout on CUDA (a bool mask), a mask of the input's dtype on
             meta and CPU: cuda_paths() routes F.dropout to the native op while it is active.
  packing    masking_utils.find_packed_sequence_indices reads a value (`.all()`) to learn that the
             batch holds one sequence per row; meta has no values. cuda_paths() runs its ops and
             takes the answer every Trainer batch without position_ids gives: not packed.

The Trainer's step (transformers/trainer.py, training_step and compute_loss) is TrainerModel:
labels passed to the model (ForCausalLMLoss shifts them and upcasts the logits), normalised by
num_items_in_batch, and scaled by the process count (1).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memcalc.errors import InputError
from memcalc.exact.hf.family import NORM_EPS  # noqa: F401  (verify/serve.py's too)
from memcalc.exact.hf.fused_head import RL_OUTPUTS, SFT_OUTPUTS
from memcalc.exact.hf.gemma import flash_refused
from memcalc.exact.hf.model import FAMILIES, arch_for
from memcalc.model.finetune import FULL, Finetune
from memcalc.model.params import n_params
from memcalc.model.shape import ModelShape, check_positions
from memcalc.model.stacks import BF16_CAST, FUSED_HEAD
from memcalc.model.tricks import Tricks

from .amp import amp_forward
from .lora import fine_tuned
from .recipes import DTYPES

FLASH = "memcalc_sdpa"  # the flash path of "sdpa" (a name with "flash" in it asks the hub for a kernel)
CPU_FLASH = "memcalc_sdpa_cpu"  # on real CPU tensors: Transformers' sdpa, SDPA held to its flash backend
SELECTIVE = {"eager": "memcalc_eager_core", FLASH: "memcalc_sdpa_core", CPU_FLASH: "memcalc_sdpa_cpu_core"}
IGNORE_INDEX = -100  # transformers/loss/loss_utils.py ForCausalLMLoss


def transformers():
    """The installed library, or a one-line error: it is the optional extra memcalc[hf]."""
    try:
        import transformers as tf
    except ImportError:
        raise InputError("--stack hf needs Hugging Face Transformers: pip install 'memcalc[hf]'") from None
    return tf


def hf_config(shape: ModelShape, seq_len: int, arch: str | None = None, use_cache: bool = False):
    """The config a Transformers user would load for this shape; use_cache as the stack has it (every
    config's default is on; off, as a Trainer with gradient checkpointing sets it)."""
    tf = transformers()
    arch = arch or arch_for(shape)
    if arch not in FAMILIES:
        raise InputError(f"unknown Transformers architecture {arch!r}; known: {', '.join(FAMILIES)}")
    return tf.AutoConfig.for_model(arch, **FAMILIES[arch].config(shape, seq_len) | {"use_cache": use_cache})


# -- attention ----------------------------------------------------------------------------------------


def sdpa_flash_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):  # fmt: skip
    """integrations/sdpa_attention.py sdpa_attention_forward as it runs in training on CUDA: no mask
    (sdpa_mask skipped it: one causal sequence per row), so use_gqa_in_sdpa gives enable_gqa and the
    key/value heads are not repeated; is_causal; F.scaled_dot_product_attention's flash backend, which
    is this op; then the output reshaped (same shape) and transpose(1, 2).contiguous(): a view, since
    the output is laid out (B, T, n, d) (CUDA's kernel transposes q to (B, T, n, d) and writes its
    output so; the meta function's empty_like(query) lays it out in q's dimension order, the same)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is not None:
        return sdpa_masked_forward(module, query, key, value, attention_mask, dropout, scaling)
    if query.dtype == torch.float32:
        return sdpa_fp32_forward(module, query, key, value, dropout, scaling)
    if groups > 1 and key.shape[-1] > 256:
        raise InputError("Transformers' sdpa would not reach the flash kernel here: GQA with head_dim > 256")
    q_length = query.shape[2]
    causal = q_length > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, causal, False,
                                                            scale=scaling)[0]  # fmt: skip
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def sdpa_fp32_forward(module, query, key, value, dropout: float = 0.0, scaling=None):
    """integrations/sdpa_attention.py sdpa_attention_forward at fp32 as it runs on CUDA: SDPA's flash kernel
    takes 16 bits only (sdp_utils.cpp check_dtypes_flash_attention), so one key head per query head runs the
    memory-efficient kernel, causal, no bias; grouped heads (enable_gqa) the math path, which the
    memory-efficient kernel's check on head counts leaves (check_batch_size_and_num_heads_dense) and which
    the meta device itself runs (attention.cpp _scaled_dot_product_attention_math); then the output
    transposed and made contiguous."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    if groups > 1:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=q_length > 1,
                                             scale=scaling, enable_gqa=True)  # fmt: skip
    else:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout,
                                                                    q_length > 1, scale=scaling)[0]  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def sdpa_masked_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None):
    """integrations/sdpa_attention.py sdpa_attention_forward given a mask (a sliding window at seq >= the
    window) as it runs on CUDA: use_gqa_in_sdpa is False with a mask, so repeat_kv; is_causal False; then
    F.scaled_dot_product_attention's CUDA path, which the meta device does not take (it runs the math
    fallback): the bool mask made additive in q's dtype (aten/src/ATen/native/transformers/attention.cpp
    convert_boolean_attn_mask, where(mask, 0, -inf)), the flash kernel refused for the mask
    (sdp_utils.cpp check_for_attn_mask), so the memory-efficient kernel, its bias expanded to
    (B, nh, Tq, Tk) and its last dim padded to a multiple of 16 (attention.cpp preprocess_mask)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    B, nh, q_length, _ = query.shape
    kv_length = key.shape[2]
    mask = attention_mask[:, :, :, :kv_length]
    bias = torch.where(mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                       torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device))  # fmt: skip
    bias = bias.expand(B, nh, q_length, kv_length)
    if kv_length % 16:
        bias = F.pad(bias, (0, 16 - kv_length % 16))[..., :kv_length]
    out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout, False,
                                                                scale=scaling)[0]  # fmt: skip
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def sdpa_cpu_flash_forward(module, query, key, value, attention_mask, **kwargs):
    """On real CPU tensors: integrations/sdpa_attention.py sdpa_attention_forward itself (enable_gqa,
    is_causal, no mask), F.scaled_dot_product_attention held to its flash backend, which on CPU is
    aten._scaled_dot_product_flash_attention_for_cpu (no dropout, no RNG state; autocast casts q, k, v
    at scaled_dot_product_attention, as CUDA's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def eager_forward(module):
    """The model's own eager_attention_forward (each modeling file has one)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def core_checkpointed(attention):
    """Korthikanti's selective recompute: the attention core under torch.utils.checkpoint. Transformers
    has no switch for it (it checkpoints whole decoder layers); its attention interface lets the core
    function be wrapped, as a user would."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        fn = attention(module) if attention is eager_forward else attention

        def core(q, k, v, mask):
            return fn(module, q, k, v, mask, **kwargs)

        return checkpoint(core, query, key, value, attention_mask, use_reentrant=False)

    return forward


@functools.cache
def register_attention() -> None:
    """FLASH and the selective variants in Transformers' attention and mask interfaces (once)."""
    tf = transformers()
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    tf.logging.set_verbosity_error()  # its notes on defaults (loss_type, token ids) are not ours to print
    tf.AttentionInterface.register(FLASH, sdpa_flash_forward)
    AttentionMaskInterface.register(FLASH, sdpa_mask)
    tf.AttentionInterface.register(SELECTIVE[FLASH], core_checkpointed(sdpa_flash_forward))
    AttentionMaskInterface.register(SELECTIVE[FLASH], sdpa_mask)
    tf.AttentionInterface.register(SELECTIVE["eager"], core_checkpointed(eager_forward))
    AttentionMaskInterface.register(SELECTIVE["eager"], eager_mask)
    tf.AttentionInterface.register(CPU_FLASH, sdpa_cpu_flash_forward)
    AttentionMaskInterface.register(CPU_FLASH, sdpa_mask)
    tf.AttentionInterface.register(SELECTIVE[CPU_FLASH], core_checkpointed(sdpa_cpu_flash_forward))
    AttentionMaskInterface.register(SELECTIVE[CPU_FLASH], sdpa_mask)


def attention_for(tricks: Tricks, device: str = "meta") -> str:
    """The attention interface: flash (the CUDA op by name; on CPU tensors SDPA's CPU flash kernel) or
    the model's eager function, its core checkpointed under selective recompute."""
    name = (CPU_FLASH if device == "cpu" else FLASH) if tricks.flash else "eager"
    return SELECTIVE[name] if tricks.recompute == "selective" else name


# -- what meta and CPU run differently ----------------------------------------------------------------


def native_dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """F.dropout as CUDA runs it (aten/src/ATen/native/Dropout.cpp dropout): the input itself at p = 0
    or in eval, else aten.native_dropout, which saves a bool mask."""
    if not training or p == 0.0:
        return input
    if inplace:
        raise InputError("in-place dropout is not measured")
    return torch.ops.aten.native_dropout(input, p, True)[0]


def not_packed(original):
    """find_packed_sequence_indices, its ops run, its `.all()` answered without reading values: every
    row one sequence (position_ids made by the model: an arange)."""

    def find(position_ids):
        if position_ids.device.type != "meta":
            return original(position_ids)
        first = position_ids[:, :1] - 1
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        packed = (diff != 1).cumsum(-1)
        (packed[:, -1] == 0).all()  # the value the library reads: no packed sequences
        return None

    return find


@contextlib.contextmanager
def cuda_dropout():
    """While active: F.dropout (nn.Dropout's call) is CUDA's, aten.native_dropout with its bool mask."""
    saved = F.dropout
    F.dropout = native_dropout
    try:
        yield
    finally:
        F.dropout = saved


@contextlib.contextmanager
def cuda_paths(dropout: bool = True):
    """While active: F.dropout is CUDA's (unless dropout is False: the tests' comparison), and the
    packed-sequence check runs on meta. Hold it over forward and backward both (checkpoint recompute
    runs the model's code again in backward)."""
    from transformers import masking_utils

    saved = F.dropout, masking_utils.find_packed_sequence_indices
    F.dropout = native_dropout if dropout else F.dropout
    masking_utils.find_packed_sequence_indices = not_packed(saved[1])
    try:
        yield
    finally:
        F.dropout, masking_utils.find_packed_sequence_indices = saved


# -- the model and the Trainer's step -----------------------------------------------------------------


class TrainerModel(nn.Module):
    """Trainer.compute_loss's call of the model: (token ids, labels) in, the loss out.

    transformers/trainer.py: _get_num_items_in_batch counts the labels that are not IGNORE_INDEX after
    the shift (labels[..., 1:]); compute_loss passes it with the labels (model_accepts_loss_kwargs);
    ForCausalLMLoss then sums the cross-entropy and divides by it; with average_tokens_across_devices
    (the default) the loss is multiplied by the process count, 1 on one GPU. The logits returned in
    the output die when compute_loss returns, before backward.

    With autocast (device type, 16-bit dtype: TrainingArguments bf16=True or fp16=True over fp32
    weights) the model's forward is the one Accelerate prepared (amp_forward)."""

    def __init__(self, model: nn.Module, autocast: tuple[str, torch.dtype] | None = None, trl: str = "",
                 chunked: bool = False, dpo=None, grpo=None):  # fmt: skip
        super().__init__()
        self.model = model
        self.autocast = autocast
        self.trl = trl  # TRL's SFTTrainer's release line: its compute_loss's metrics (verify/trl.py)
        self.chunked = chunked  # its loss_type "chunked_nll": the patched forward's counts, no logits
        self.dpo = dpo  # DPOTrainer's (verify/trl_dpo.py Dpo): its _compute_loss; the labels' slot: the completion mask
        self.grpo = grpo  # GRPOTrainer's or RLOOTrainer's (verify/trl_grpo.py Grpo); the labels' slot: the mask

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.dpo is not None:  # no labels in the batch: no count (Trainer._get_num_items_in_batch)
            from .trl_dpo import dpo_loss

            return dpo_loss(self.model, idx, labels, self.autocast, self.dpo)
        if self.grpo is not None:
            from .trl_grpo import grpo_loss

            return grpo_loss(self.model, idx, labels, self.autocast, self.grpo)
        num_items_in_batch = sum(x.ne(IGNORE_INDEX).sum() for x in [labels[..., 1:]])
        call = self.model if self.autocast is None else amp_forward(self.model, *self.autocast)
        if self.trl in FUSED_HEAD:  # SFTTrainer's own compute_loss, through the fused LM head
            from .trl import sft_compute_loss

            return sft_compute_loss(call, idx, labels, num_items_in_batch)
        outputs = call(input_ids=idx, labels=labels, num_items_in_batch=num_items_in_batch)
        loss = outputs["loss"]
        loss *= 1  # num_processes // tp_size
        if self.chunked:  # SFTTrainer.compute_loss under loss_type "chunked_nll": its metrics from the counts
            from .trl_chunked import chunked_metrics

            chunked_metrics(outputs, labels)
        elif self.trl:  # SFTTrainer.compute_loss: its metrics from the output, held until it returns the loss
            from .trl import compute_loss_metrics

            held = compute_loss_metrics(self.trl, outputs.logits, labels)
            del held
        return loss


def build_hf(shape: ModelShape, tricks: Tricks, seq_len: int, arch: str | None = None,
             device: str = "meta", autocast: str | None = None, use_cache: bool = False,
             finetune: Finetune = FULL, trl: str = "", liger: bool = False,
             reentrant: bool = False, loss: str = "full", rl: str = "",
             precompute_ref: bool = False, online=None) -> TrainerModel:  # fmt: skip
    """AutoModelForCausalLM.from_config on the device (meta: nothing allocated; cpu: the tests' real
    tensors), in the trick set's dtype, in training mode; activation checkpointing as the Trainer
    enables it (activation_checkpointing_enable with use_reentrant=False; gradient_checkpointing_enable,
    which the issue names, is its deprecated alias in Transformers 5). autocast (a device type): the
    weights in fp32, the forward under torch.autocast in the trick set's 16-bit dtype, as the Trainer
    runs a model loaded in fp32 with bf16=True or fp16=True. finetune: LoRA by PEFT over a base loaded in the trick
    set's dtype (under autocast too, as LoRA scripts load it), or weights frozen (verify/lora.py). liger: the
    Trainer's use_liger_kernel, applied as Trainer.train does, after PEFT (verify/liger.py). reentrant:
    gradient_checkpointing_kwargs={"use_reentrant": True} (torch.utils.checkpoint's CheckpointFunction)."""
    tf = transformers()
    check_positions(shape, seq_len)
    register_attention()
    config = hf_config(shape, seq_len, arch, use_cache)
    if tricks.flash and flash_refused(config.model_type):  # as memcalc.exact.hf.gemma refuses it
        raise InputError(flash_refused(config.model_type))
    amp = autocast is not None and tricks.precision != "fp32"
    dtype = torch.float32 if amp and not finetune.lora else DTYPES[tricks.precision]
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                    attn_implementation=attention_for(tricks, device))  # fmt: skip
    kwargs = {"use_reentrant": reentrant}  # gradient_checkpointing_kwargs as the Trainer passes them on
    if tricks.recompute == "full":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    model.train()
    count = sum(p.numel() for p in model.parameters())
    if count != n_params(shape):  # the architecture was picked to build exactly this shape
        raise InputError(f"Transformers' {config.model_type} has {count:,} parameters, memcalc's shape "
                         f"{n_params(shape):,}")  # fmt: skip
    checkpointing = tricks.recompute == "full"
    model = fine_tuned(model, finetune, shape.tied_embeddings, trl, checkpointing, amp and dtype == torch.bfloat16)
    if trl in BF16_CAST:  # SFTTrainer.__init__ from 0.26: its casts, from 1.15 the fused LM head (verify/trl.py)
        from .trl import prepare_after_peft

        prepare_after_peft(model, trl, bool(finetune.quantize), checkpointing and finetune.lora,
                           RL_OUTPUTS.get(rl, SFT_OUTPUTS))  # fmt: skip
    dpo = trainer = None
    if rl == "dpo":  # DPOTrainer.__init__'s own: its dropout off, its reference (verify/trl_dpo.py)
        from .trl_dpo import dpo_setup

        dpo = dpo_setup(model, tf, config, dtype, attention_for(tricks, device), device, finetune.lora,
                        precompute_ref, kwargs if reentrant else None, trl)  # fmt: skip
    if rl in ("grpo", "rloo"):  # GRPOTrainer's, RLOOTrainer's own: a reference where beta is not 0 (verify/trl_grpo.py)
        from .trl_grpo import grpo_setup

        trainer = grpo_setup(tf, config, dtype, attention_for(tricks, device), device, finetune.lora, online, rl, trl)
    if loss == "chunked_nll":  # SFTTrainer.__init__ patches the forward for loss_type "chunked_nll" (verify/trl.py)
        from .trl_chunked import patch_chunked

        patch_chunked(model, trl)
    if trl and checkpointing:  # Trainer.train enables it again (its kwargs) over TRL's preparation's
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    if liger:
        from .liger import apply

        apply(model, {"fused_linear_cross_entropy": False} if trl in FUSED_HEAD else None)  # TRL's args from 1.15
    # TRL 0.15-0.25's compute_loss computes its metrics from the logits only without use_liger_kernel
    return TrainerModel(model, (autocast, DTYPES[tricks.precision]) if amp else None,
                        "" if liger and trl not in FUSED_HEAD else trl, loss == "chunked_nll", dpo,
                        trainer)  # fmt: skip


def describe(shape: ModelShape) -> str:
    """One line for verify's notes: which library and class trained."""
    tf = transformers()
    arch = arch_for(shape)
    cls = tf.AutoModelForCausalLM._model_mapping[type(hf_config(shape, 2048, arch))].__name__
    return f"stack hf: Transformers {tf.__version__}'s {cls}, trained as its Trainer's compute_loss calls it"
