"""An axolotl config as memcalc's options. axolotl trains with Transformers' Trainer over PEFT and bitsandbytes,
so its step is the hf stack's: its model is loaded in the dtype bf16 or fp16 picks (16-bit weights: --recipe pure)
and, with an adapter, its norms and embeddings go back to that dtype after prepare_model_for_kbit_training, as
the hf stack loads them.

Sources: axolotl-ai-cloud/axolotl @ 067b021c8b87: src/axolotl/utils/schemas/config.py (sequence_len 512, bf16
"auto", gradient_checkpointing, attn_implementation and the older flash_attention/sdp_attention, sample_packing,
deepspeed, fsdp, fsdp_config, rl, plugins, chunked_cross_entropy, activation_offloading), schemas/training.py
(micro_batch_size 1, gradient_accumulation_steps 1, optimizer adamw_torch_fused), schemas/peft.py (adapter, lora_r,
lora_target_modules, lora_target_linear, load_in_4bit), utils/config/__init__.py (resolve_dtype: torch_dtype bf16
where bf16 or bfloat16; gradient_checkpointing_kwargs use_reentrant True where unset; gradient_accumulation_steps
from batch_size), loaders/model.py (nf4 with double quantisation; _convert_embedding_modules_dtype after
prepare_model_for_kbit_training).
"""

from __future__ import annotations

from pathlib import Path

from . import sharding
from .common import TrickSet, attention_flash, ckpt_typed_away, clipping, lora_targets, model_option, optimizer_option
from .ledger import KeyLedger
from .peft import dora_option, saved_option

SAVERS = {  # memory savers memcalc does not replay, each of which lowers the peak by much
    "chunked_cross_entropy": "chunked cross-entropy", "activation_offloading": "activation offloading to the host",
    "tiled_mlp": "the tiled MLP", "cut_cross_entropy": "Cut Cross-Entropy (the logits never held)",
    "liger_fused_linear_cross_entropy": "Liger's fused linear cross-entropy (the logits never held)",
}  # fmt: skip
KERNELS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm", "lora_mlp_kernel",
           "lora_qkv_kernel", "lora_o_kernel", "unsloth_cross_entropy_loss", "unsloth_rms_norm", "unsloth_rope")
LEGACY_ATTENTION = {"flash_attention": True, "sdp_attention": True, "xformers_attention": True,
                    "flex_attention": True, "eager_attention": False}  # fmt: skip


def read_axolotl(ledger: KeyLedger, typed: dict) -> None:
    if ledger.text("rl") is not None:
        ledger.refuse("rl", "axolotl's preference and RL training runs its own subclass of TRL's trainers at the "
                            "TRL release it pins, which is not replayed: give the job's options with --stack trl:1.16 "
                            "--rl dpo for TRL 1.16's DPOTrainer (docs/rl.md)")  # fmt: skip
    model_option(ledger, "base_model_config" if ledger.has("base_model_config") else "base_model")
    if ledger.has("base_model_config"):
        ledger.used("base_model", "its config.json from base_model_config")
    for key, what in SAVERS.items():
        if ledger.raw(key) not in (None, False) and ledger.has(key):
            ledger.refuse(key, f"{what} is not modelled, and it lowers the peak by much: memcalc would overstate it; "
                               "turn it off to estimate the step without it")  # fmt: skip
    for key in KERNELS:
        if ledger.raw(key) not in (None, False) and ledger.has(key):
            ledger.unmodelled(key, "its fused kernels save less for backward than the replayed step")
    for plugin in ledger.names("plugins") or []:
        ledger.unmodelled("plugins", f"{plugin}: only the keys it reads that memcalc knows are in the verdict")
    lora = adapter_options(ledger)
    step_options(ledger)
    clipping(ledger)  # axolotl hands max_grad_norm to TrainingArguments
    tricks_and_recipe(ledger, typed.get("gpu", "h100-sxm"), ckpt_typed_away(typed))
    optimizer_option(ledger, "optimizer")
    sharding.fsdp_options(ledger, "fsdp", "fsdp_config", lora, config_alone=True)
    if ledger.has("fsdp_version"):
        ledger.used("fsdp_version", "FSDP1 or FSDP2: memcalc's ZeRO layout either way")
    sharding.deepspeed_options(ledger, "deepspeed", Path(ledger.path).parent)
    if "stack" not in typed:
        ledger.options["stack"] = "hf"
        ledger.origin["stack"] = []
        ledger.remarks.append("--stack hf: axolotl trains with Transformers' Trainer over PEFT and bitsandbytes")
    for key in ("sequence_parallel_degree", "context_parallel_size", "tensor_parallel_size"):
        if (ledger.count(key) or 1) > 1:
            ledger.refuse(key, "axolotl's sequence, context and tensor parallel are not read: give --cp or --tp")


def adapter_options(ledger: KeyLedger) -> bool:
    """adapter lora or qlora with lora_r, lora_dropout, lora_target_modules and lora_target_linear; the 4-bit base
    (qlora with load_in_4bit) as axolotl's BitsAndBytesConfig, nf4 with double quantisation."""
    adapter = ledger.text("adapter")
    if ledger.flag("load_in_8bit"):
        ledger.refuse("load_in_8bit", "bitsandbytes' 8-bit base is not replayed: LLM.int8() multiplies the outlier "
                                      "columns in 16 bits, so its memory depends on the data")  # fmt: skip
    for key in ("load_in_8bit", "load_in_4bit"):
        if ledger.flag(key) is False:
            ledger.used(key, "off")
    if adapter is None:
        if ledger.flag("load_in_4bit"):
            ledger.refuse("load_in_4bit", "a 4-bit base trains adapters only: set adapter: qlora")
        return False
    if adapter.strip().lower() not in ("lora", "qlora"):
        ledger.refuse("adapter", "memcalc replays LoRA and QLoRA (adapter: lora or qlora)")
    if adapter.strip().lower() == "qlora" and not ledger.flag("load_in_4bit"):
        ledger.refuse("adapter", "qlora needs load_in_4bit: true (axolotl refuses it too)")
    if ledger.count("lora_r") is None:
        ledger.refuse("adapter", "lora_r is not set: axolotl needs the rank")
    ledger.set("lora", str(ledger.count("lora_r")), "lora_r")
    ledger.used("adapter", "LoRA" if adapter.strip().lower() == "lora" else "QLoRA")
    if ledger.has("lora_dropout"):
        ledger.set("lora_dropout", str(ledger.number("lora_dropout")), "lora_dropout")
    names = ledger.names("lora_target_modules") or []
    if ledger.flag("lora_target_linear"):
        ledger.set("lora_targets", "all-linear", "lora_target_linear")
        if names:
            ledger.used("lora_target_modules", "within all-linear")
    elif names:
        ledger.set("lora_targets", lora_targets(ledger, "lora_target_modules", names), "lora_target_modules")
    else:
        ledger.refuse("adapter", "neither lora_target_modules nor lora_target_linear is set")
    dora_option(ledger, "peft_use_dora")
    saved_option(ledger, "lora_modules_to_save")
    for key, what in (("lora_target_parameters", "target_parameters"), ("peft_layers_to_transform", "layers")):
        if ledger.raw(key) not in (None, False, []) and ledger.has(key):
            ledger.refuse(key, f"{what} changes what trains and is not modelled: memcalc replays LoRA on the blocks' "
                               "projections alone")  # fmt: skip
    if ledger.flag("load_in_4bit"):
        ledger.set("quantize", "nf4", "load_in_4bit")
        if (ledger.section("bnb_config_kwargs") or {}).get("bnb_4bit_use_double_quant") is False:
            ledger.caveat("load_in_4bit", "without double quantisation bitsandbytes keeps an fp32 absmax per 64 "
                                          "weights: memcalc counts the double-quantised 4-bit weights")  # fmt: skip
    return True


def step_options(ledger: KeyLedger) -> None:
    """--seq, --micro-batch and --grad-accum (from batch_size where gradient_accumulation_steps is not set)."""
    if ledger.has("sequence_len"):
        ledger.set("seq", str(ledger.count("sequence_len")), "sequence_len")
    else:
        ledger.default("seq", "512", "sequence_len", "axolotl's default")
    micro = ledger.count("micro_batch_size") or 1
    if ledger.has("micro_batch_size"):
        ledger.set("micro_batch", str(micro), "micro_batch_size")
    if ledger.has("gradient_accumulation_steps"):
        ledger.set("grad_accum", str(ledger.count("gradient_accumulation_steps")), "gradient_accumulation_steps")
    elif ledger.has("batch_size"):
        steps = max(1, ledger.count("batch_size") // micro)
        ledger.set("grad_accum", str(steps), "batch_size", f"--grad-accum {steps} (batch_size // micro_batch_size)")
    packing = ledger.flag("sample_packing")
    if packing is not None:
        ledger.used("sample_packing", "full sequences, as memcalc takes them" if packing else
                    "the verdict is for full sequences, the longest batch")


def tricks_and_recipe(ledger: KeyLedger, card: str, typed_away: bool = False) -> None:
    """--tricks: the precision (bf16 "auto": bf16 where the card has it, else fp16, as axolotl's resolve_dtype),
    the attention, checkpointing, compile; --recipe pure: axolotl loads the model in that 16-bit dtype."""
    tricks = TrickSet()
    bf16 = ledger.raw("bf16")
    auto = bf16 == "auto" or not ledger.has("bf16")
    if ledger.flag("fp16") or ledger.flag("float16"):
        precision, key, why = "fp16", "fp16" if ledger.flag("fp16") else "float16", ""
    elif ledger.flag("bfloat16") or bf16 in (True, "full"):
        precision, key, why = "bf16", "bfloat16" if ledger.flag("bfloat16") else "bf16", ""
    elif auto:
        precision = half_of(card)
        key, why = "bf16", "" if ledger.has("bf16") else "axolotl's default bf16: auto"
        if precision == "fp16":
            ledger.used("bf16", f"auto on the {card}, which has no bf16: fp16 in --tricks")
    else:
        precision, key, why = "fp32", "bf16", ""
    tricks.add(precision, key, why)
    attention(ledger, tricks)
    checkpointing(ledger, tricks, typed_away)
    if ledger.raw("torch_compile") in (True, "auto"):
        tricks.add("compile", "torch_compile")
    tricks.commit(ledger)
    pure = f"--recipe pure (the model loaded in {precision})"
    if precision != "fp32" and not why:
        ledger.set("recipe", "pure", key, pure)
    elif precision != "fp32":
        ledger.default("recipe", "pure", key, why, pure)


def half_of(card: str) -> str:
    """The 16-bit dtype `bf16: auto` picks on the card: bf16 where it has bf16 tensor cores, else fp16."""
    from memcalc.model.gpus import find_gpu, half_precision

    return half_precision(find_gpu(card))


def attention(ledger: KeyLedger, tricks: TrickSet) -> None:
    if ledger.has("attn_implementation"):
        if attention_flash(ledger, "attn_implementation"):
            tricks.add("flash", "attn_implementation")
        else:
            ledger.used("attn_implementation", "eager attention: the s x s scores kept")
        return
    legacy = [k for k in LEGACY_ATTENTION if ledger.flag(k)]
    if legacy and LEGACY_ATTENTION[legacy[0]]:
        tricks.add("flash", legacy[0])
    elif legacy:
        ledger.used(legacy[0], "eager attention: the s x s scores kept")
    else:
        tricks.add("flash", "attn_implementation", "Transformers' default attention, sdpa")


def checkpointing(ledger: KeyLedger, tricks: TrickSet, typed_away: bool = False) -> None:
    """gradient_checkpointing true (offload: activation offloading, refused) and its reentrancy, axolotl's default
    use_reentrant True where the file sets no kwargs (none where the typed --tricks has no ckpt: typed_away)."""
    value = ledger.raw("gradient_checkpointing")
    if value in ("offload", "offload_disk"):
        ledger.refuse("gradient_checkpointing", "activation offloading to the host is not modelled, and it lowers "
                                                "the peak by much: memcalc would overstate it")  # fmt: skip
    if not ledger.flag("gradient_checkpointing"):
        if ledger.has("gradient_checkpointing"):
            ledger.used("gradient_checkpointing", "off")
        return
    tricks.add("ckpt", "gradient_checkpointing")
    kwargs = "gradient_checkpointing_kwargs.use_reentrant"
    if typed_away:
        ledger.used(kwargs, "no ckpt in the typed --tricks: nothing is checkpointed")
    elif ledger.flag(kwargs):
        ledger.set("reentrant", True, kwargs, "--reentrant: torch.utils.checkpoint's reentrant CheckpointFunction")
    elif not ledger.has("gradient_checkpointing_kwargs"):
        ledger.default("reentrant", True, kwargs, "axolotl's default (utils/config resolves use_reentrant True)",
                       "--reentrant")  # fmt: skip
    elif ledger.has(kwargs):
        ledger.used(kwargs, "non-reentrant")
