"""PEFT's LoRA and frozen weights on Transformers' model, as a fine-tuning script sets them up.

    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)   # the base in 16 bits
    model.gradient_checkpointing_enable()                                   # with ckpt: and so
                                                                            # enable_input_require_grads
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))

On meta, PEFT builds its adapters on meta too (peft/tuners/tuners_utils.py _move_adapter_to_device_of_base_layer
skips a meta adapter; cast_adapter_dtype then upcasts them to fp32, as on any device). Frozen parts of a full
training run are requires_grad_(False) on the weights named (the embedding, the head, the first N blocks).
memcalc.exact.hf.lora replays both.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

from torch import nn

from memcalc.errors import InputError
from memcalc.exact.hf.lora import trainable
from memcalc.model.finetune import Finetune, peft_targets
from memcalc.model.stacks import KBIT_PREPARED


def peft():
    """The installed PEFT, or a one-line error: it is the optional extra memcalc[lora]."""
    try:
        import peft as lib
    except ImportError:
        raise InputError("--lora wraps the model with Hugging Face PEFT: pip install 'memcalc[lora]'") from None
    return lib


def fine_tuned(model: nn.Module, finetune: Finetune, tied: bool, trl: str = "", checkpointing: bool = False,
               bf16_args: bool = False) -> nn.Module:  # fmt: skip
    """get_peft_model with the LoraConfig the job names, or the weights frozen; the model itself when every
    weight trains. Under TRL's SFTTrainer (trl: its release line) a 4-bit model is prepared first and, under
    TrainingArguments' bf16=True (bf16_args), cast after (verify/trl.py)."""
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device.type  # as loaded (TRL's preparation casts weight.data after)
    del weight
    if finetune.quantize:
        from .qlora import quantized

        model = quantized(model, dtype, device)
        if trl in KBIT_PREPARED:
            from .trl import prepare_kbit

            model = prepare_kbit(model, checkpointing)
    if finetune.lora:
        lib = peft()
        with warnings.catch_warnings():  # PeftModel.__init__ asks the deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            model = lib.get_peft_model(model, lora_config(model.config.model_type, finetune))
        if trl in KBIT_PREPARED and finetune.quantize and bf16_args:  # args.bf16, the model loaded in 4 bits
            from .trl import peft_module_casting_to_bf16

            peft_module_casting_to_bf16(model)
        return model
    for name, p in model.named_parameters():
        if not trainable(name, finetune, tied):
            p.requires_grad_(False)
    return model


def lora_config(model_type: str, finetune: Finetune):
    """The LoraConfig the job names (peft's)."""
    return peft().LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.lora_alpha, lora_dropout=finetune.lora_dropout,
                             target_modules=list(peft_targets(model_type, finetune)), use_dora=finetune.dora,
                             modules_to_save=list(finetune.modules_to_save) or None,
                             task_type="CAUSAL_LM")  # fmt: skip


def held_tensors(model: nn.Module) -> list:
    """Tensors the model keeps on its device besides parameters and buffers: 4-bit layers' quantisation state."""
    if "bitsandbytes" not in sys.modules:
        return []
    from .qlora import quant_tensors

    return quant_tensors(model)


def meta_paths():
    """What a meta run of a QLoRA model holds over its step: a 4-bit layer's matmul as CUDA runs it in training
    (verify/qlora.py cuda_gemm_4bit); nothing where bitsandbytes is not loaded."""
    if "bitsandbytes" not in sys.modules:
        return contextlib.nullcontext()
    from .qlora import cuda_gemm_4bit

    return cuda_gemm_4bit()
