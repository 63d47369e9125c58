"""A TRL or Transformers arguments file (JSON or YAML of TrainingArguments, TRL's SFTConfig, and the ModelConfig
`trl sft --config FILE` reads from the same file) as memcalc's options.

Sources: transformers src/transformers/training_args.py @ fd798335c275 (Transformers 5: per_device_train_batch_size
8, gradient_accumulation_steps, bf16, fp16, gradient_checkpointing alias activation_checkpointing and their
kwargs, optim adamw_torch_fused, torch_compile, use_liger_kernel and liger_kernel_config, use_cache,
label_smoothing_factor, fsdp, deepspeed); huggingface/trl trl/trainer/sft_config.py @ v0.14.0 (49711efab9e0:
max_seq_length None, which the trainer makes min(tokenizer.model_max_length, 1024); use_liger), @ v0.21.0
(46d09bd2408f: max_length 1024, bf16 True unless fp16, since 0.19; activation_offloading), @ v0.25.0 (55f5433e15cc:
gradient_checkpointing True, since 0.22); trl/trainer/model_config.py @ v0.25.0 (model_name_or_path, dtype,
attn_implementation).
"""

from __future__ import annotations

from pathlib import Path

from memcalc.model.stacks import CHUNKED_DEFAULT, CHUNKED_NLL, FUSED_HEAD, TRL_FIRST, releases

from . import peft, sharding
from .common import TrickSet, attention_flash, ckpt_typed_away, clipping, half_precision, model_option, optimizer_option
from .dpo import DPO_KEYS, dpo_config
from .grpo import GRPO_KEYS, grpo_config
from .ledger import KeyLedger

# keys only SFTConfig and TRL's ModelConfig have (TrainingArguments has none of them): the file is TRL's
TRL_KEYS = ("max_seq_length", "max_length", "packing", "dataset_text_field", "model_init_kwargs", "padding_free",
            "completion_only_loss", "assistant_only_loss", "use_liger", "packing_strategy", "activation_offloading",
            "eval_packing", "dataset_kwargs", "use_peft", "lora_r", "load_in_4bit", "use_bnb_nested_quant")  # fmt: skip
# what SFTConfig's defaults are in each TRL line memcalc replays (its last release): bf16, gradient checkpointing
TRL_DEFAULTS = {"0.14": (False, False), "0.21": (True, False), "0.25": (True, True), "1.2": (True, True),
                "1.5": (True, True), "1.13": (True, True), "1.14": (True, True),
                "1.16": (True, True)}
STACK_REMARK = {
    "hf": "--stack hf: Transformers' Trainer (no key of TRL's SFTConfig here; --stack trl:0.25 if SFTTrainer ran it)",
    "trl:0.25": "--stack trl:0.25: the TRL line memcalc replays whose SFTConfig takes these keys; the file does not "
                "say which TRL ran it (--stack trl:1.2, trl:1.5, trl:1.13 or trl:1.16 for later lines, trl:0.14 or "
                "trl:0.21 for older ones)",
    "trl:1.16": "--stack trl:1.16: the newest TRL line memcalc replays, whose DPOTrainer, GRPOTrainer and RLOOTrainer "
                "it replays (--rl dpo, grpo, rloo); --stack trl:1.5 to trl:1.13 for an earlier DPOTrainer",
    "trl:0.21": "--stack trl:0.21: the newest TRL line memcalc replays whose SFTConfig takes max_seq_length or "
                "use_liger (gone in 0.20); --stack trl:0.14 for 0.9-0.14",
}  # fmt: skip
UNMODELLED = {
    "auto_find_batch_size": "the Trainer halves the batch until it fits: the verdict is for the batch given",
    "neftune_noise_alpha": "NEFTune's noise on the embeddings' output (one more tensor of it)",
    "parallelism_config": "accelerate's tensor and context parallel are not read: give --tp or --cp",
    "optim_target_modules": "GaLore's and APOLLO's projected optimizer state",
}
SAVERS = {
    "use_liger": "TRL 0.14-0.19's Liger (SFTConfig use_liger) is not modelled",
    "activation_offloading": "activation offloading to the host is not modelled",
}


def read_trainer(ledger: KeyLedger, typed: dict) -> None:
    grpo = grpo_config(ledger, typed)  # GRPOConfig's keys, under --rl grpo or rloo (memcalc.cli.fromfile.grpo)
    dpo = dpo_config(ledger, typed)  # DPOConfig's, under --rl dpo (memcalc.cli.fromfile.dpo)
    stack, trl = stack_of(ledger, typed, dpo or grpo)
    model_option(ledger, "model_name_or_path")
    liger_option(ledger)
    for key, why in SAVERS.items():
        if ledger.flag(key):
            ledger.refuse(key, f"{why}, and it lowers the peak by much: memcalc would overstate it; turn it off to "
                               "estimate the step without it")  # fmt: skip
        elif ledger.has(key):
            ledger.used(key, "off")
    for key, why in UNMODELLED.items():
        if ledger.raw(key) not in (None, False, 0, [], {}) and ledger.has(key):
            ledger.unmodelled(key, why)
    if ledger.flag("use_cpu"):
        ledger.refuse("use_cpu", "memcalc answers for a GPU")
    if (ledger.number("label_smoothing_factor") or 0) > 0:
        ledger.refuse("label_smoothing_factor", "the Trainer's LabelSmoother (a log-softmax of the logits) is not "
                                                "modelled, and it raises the peak")  # fmt: skip
    elif ledger.has("label_smoothing_factor"):
        ledger.used("label_smoothing_factor", "none")
    lora = peft.lora_options(ledger)
    peft.quantize_options(ledger, lora)
    step_options(ledger, trl)
    if not dpo and not grpo:  # DPOConfig's and GRPOConfig's loss_type are their own
        loss_type(ledger, trl)
    clipping(ledger)
    tricks_and_recipe(ledger, trl, ckpt_typed_away(typed))
    optimizer_option(ledger, "optim")
    if not ledger.has("optim"):
        ledger.default(None, None, "optim", "TrainingArguments' default", "adamw_torch_fused, the stack's own")
    sharding.fsdp_options(ledger, "fsdp", "fsdp_config", lora)
    sharding.deepspeed_options(ledger, "deepspeed", Path(ledger.path).parent)
    for key in ("model_init_kwargs.use_cache", "use_cache"):
        if ledger.flag(key) is False:
            ledger.set("no_cache", True, key, "--no-cache")
    if stack:
        ledger.options["stack"] = stack
        ledger.origin["stack"] = [key for key in TRL_KEYS + DPO_KEYS + GRPO_KEYS if key in ledger.data][:1]
        ledger.remarks.append(STACK_REMARK[stack])


def liger_option(ledger: KeyLedger) -> None:
    """use_liger_kernel: --liger, the Trainer's apply_liger_kernel with liger's defaults (liger_kernel_config unset),
    under TRL's SFTTrainer too (0.15-0.25 then skip their metrics)."""
    if not ledger.flag("use_liger_kernel"):
        if ledger.has("use_liger_kernel"):
            ledger.used("use_liger_kernel", "off")
        return
    if ledger.has("liger_kernel_config") and ledger.raw("liger_kernel_config") not in (None, {}):
        ledger.refuse("liger_kernel_config", "Liger with kernels other than its defaults is not replayed")
    else:
        ledger.set("liger", True, "use_liger_kernel", "--liger: Liger's RoPE, RMSNorm, SwiGLU and fused cross-entropy")


def stack_of(ledger: KeyLedger, typed: dict, dpo: bool = False) -> tuple[str | None, str]:
    """The stack and the TRL line whose defaults apply: the user's --stack; else under --rl dpo, grpo or rloo the
    line whose trainers memcalc replays; else TRL's newest line memcalc replays whose SFTConfig takes the file's keys
    (max_seq_length went in 0.20), or the Trainer alone (hf) without them."""
    if typed.get("stack"):
        given = typed["stack"].strip().lower()
        return None, given.removeprefix("trl:") if given.startswith("trl:") else ""
    if dpo:
        return f"trl:{FUSED_HEAD[-1]}", FUSED_HEAD[-1]
    if not any(key in ledger.data for key in TRL_KEYS):
        return "hf", ""
    line = "0.21" if "max_seq_length" in ledger.data or "use_liger" in ledger.data else "0.25"
    return f"trl:{line}", line


def loss_type(ledger: KeyLedger, trl: str) -> None:
    """SFTConfig's loss_type (from 1.4) as --loss: nll, the cross-entropy over the logits, and chunked_nll, the head
    and the loss 256 positions at a time under checkpointing, on the lines that run both (1.6-1.14; chunked_nll the
    default from 1.7); from 1.15 both run the fused LM head (chunked_nll deprecated into nll)."""
    if not ledger.has("loss_type"):
        if trl in CHUNKED_DEFAULT:
            ledger.default("loss", "chunked_nll", "loss_type", "SFTConfig's default from 1.7")
        return
    kind = ledger.text("loss_type")
    if trl in FUSED_HEAD and kind in ("nll", "chunked_nll"):
        ledger.used("loss_type", "the fused LM head")
    elif kind == "nll":
        ledger.set("loss", "nll", "loss_type", "--loss nll: the cross-entropy over the logits")
    elif kind == "chunked_nll" and trl in CHUNKED_NLL:
        ledger.set("loss", "chunked_nll", "loss_type", "--loss chunked_nll")
    elif kind == "chunked_nll":
        ledger.refuse("loss_type", f"SFTTrainer's chunked_nll is replayed on --stack "
                      f"{', '.join('trl:' + x for x in CHUNKED_NLL)} (give the release's with --stack), not on "
                      f"trl:{trl or '0.25'}")  # fmt: skip
    else:
        ledger.unmodelled("loss_type", f"{kind}: the verdict is loss_type nll's")


def step_options(ledger: KeyLedger, trl: str) -> None:
    """--micro-batch, --grad-accum and --seq, each from its key or the library's default."""
    if ledger.has("per_device_train_batch_size"):
        ledger.set("micro_batch", str(ledger.count("per_device_train_batch_size")), "per_device_train_batch_size")
    else:
        ledger.default("micro_batch", "8", "per_device_train_batch_size", "TrainingArguments' default")
    if ledger.has("gradient_accumulation_steps"):
        ledger.set("grad_accum", str(ledger.count("gradient_accumulation_steps")), "gradient_accumulation_steps")
    seq_keys = [k for k in ("max_length", "max_seq_length") if ledger.has(k)]
    if seq_keys:
        ledger.set("seq", str(ledger.count(seq_keys[0])), seq_keys[0])
    elif trl:
        ledger.default("seq", "1024", "max_length", "SFTConfig's default (at most 1024 tokens)")
    else:
        ledger.default("seq", None, "max_length", "the Trainer does not truncate (the data sets the length)",
                       "memcalc's default --seq, or give --seq")  # fmt: skip
    if ledger.flag("padding_free"):
        ledger.used("padding_free", "the batch flattened into one sequence: the verdict is for full-length ones")
    packing = ledger.flag("packing")
    if packing is not None:
        ledger.used("packing", "full sequences, as memcalc takes them" if packing else
                    "the verdict is for full sequences, the longest batch")


def tricks_and_recipe(ledger: KeyLedger, trl: str, typed_away: bool = False) -> None:
    """--tricks from bf16/fp16, the attention and checkpointing (SFTConfig's defaults in the TRL line), and
    --recipe pure where the model is loaded in 16 bits."""
    tricks = TrickSet()
    whose = f"SFTConfig's default in TRL {releases(trl)}" if trl in TRL_FIRST else "TrainingArguments' default"
    bf16_default, ckpt_default = TRL_DEFAULTS.get(trl, (False, False))
    precision, key = half_precision(ledger, "bf16", "fp16", bf16_default)
    dtype_key = next((k for k in ("model_init_kwargs.dtype", "model_init_kwargs.torch_dtype", "dtype", "torch_dtype")
                      if ledger.has(k)), None)  # fmt: skip
    loaded = weights_dtype(ledger, dtype_key, precision)
    if loaded != "fp32":
        ledger.set("recipe", "pure", dtype_key, f"--recipe pure: {loaded} weights, gradients and optimizer state")
        tricks.add(loaded, dtype_key)
        if key:
            ledger.used(key, f"autocast over the {loaded} weights: {loaded} in --tricks")
    elif key or ledger.has("bf16") or ledger.has("fp16"):
        tricks.add(precision, key or "bf16")
    else:
        tricks.add(precision, "bf16", whose)
    attention = next((k for k in ("model_init_kwargs.attn_implementation", "attn_implementation") if ledger.has(k)), "")
    if not attention:
        tricks.add("flash", "attn_implementation", "Transformers' default attention, sdpa")
    elif attention_flash(ledger, attention):
        tricks.add("flash", attention)
    else:
        ledger.used(attention, "eager attention: the s x s scores kept")
    key = next((k for k in ("activation_checkpointing", "gradient_checkpointing") if ledger.has(k)), "")
    if key == "activation_checkpointing" and ledger.has("gradient_checkpointing"):
        ledger.used("gradient_checkpointing", "Transformers 5's alias of activation_checkpointing, which decides")
    if key and ledger.flag(key):
        tricks.add("ckpt", key)
        checkpoint_kwargs(ledger, typed_away)
    elif key:
        ledger.used(key, "off")
    elif ckpt_default:
        tricks.add("ckpt", "gradient_checkpointing", whose)
        checkpoint_kwargs(ledger, typed_away)
    if ledger.flag("torch_compile"):
        tricks.add("compile", "torch_compile")
    tricks.commit(ledger)


def weights_dtype(ledger: KeyLedger, key: str | None, precision: str) -> str:
    """The dtype the model is loaded in: bf16 or fp16 (16-bit weights: --recipe pure), else fp32 (the stack's
    autocast over fp32 weights; 'auto', the checkpoint's own, is taken as fp32)."""
    if key is None:
        return "fp32"
    name = ledger.text(key).strip().lower().removeprefix("torch.")
    loaded = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "auto": "fp32"}.get(name)
    if loaded is None:
        ledger.refuse(key, "bfloat16, float16, float32 or auto")
    if name == "auto":
        ledger.unmodelled(key, "the checkpoint's own dtype is not read: fp32 weights under autocast; write "
                               "bfloat16 for 16-bit weights")  # fmt: skip
    elif loaded == "fp32":
        ledger.used(key, "fp32 weights (the stack's autocast recipe)")
    if loaded != "fp32" and precision not in ("fp32", loaded):
        ledger.refuse(key, f"weights in {loaded} trained under {precision} autocast: the Trainer's GradScaler refuses "
                           "such gradients")  # fmt: skip
    return loaded


def checkpoint_kwargs(ledger: KeyLedger, typed_away: bool = False) -> None:
    """gradient_checkpointing_kwargs (Transformers 5: activation_checkpointing_kwargs): reentrancy (not where the
    typed --tricks has no ckpt: typed_away), offload and every_n_layers."""
    kwargs = next((k for k in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs") if ledger.has(k)), "")
    if not kwargs:
        return
    if ledger.flag(f"{kwargs}.offload"):
        ledger.refuse(f"{kwargs}.offload", "activation offloading to the host is not modelled, and it lowers the peak "
                                           "by much: memcalc would overstate it")  # fmt: skip
    if (ledger.count(f"{kwargs}.every_n_layers") or 1) > 1:
        ledger.refuse(f"{kwargs}.every_n_layers", "the hf stack checkpoints every decoder layer or none")
    if typed_away and ledger.has(f"{kwargs}.use_reentrant"):
        ledger.used(f"{kwargs}.use_reentrant", "no ckpt in the typed --tricks: nothing is checkpointed")
    elif ledger.flag(f"{kwargs}.use_reentrant"):
        ledger.set("reentrant", True, f"{kwargs}.use_reentrant", "--reentrant: torch.utils.checkpoint's reentrant "
                                                                 "CheckpointFunction")  # fmt: skip
    elif ledger.has(f"{kwargs}.use_reentrant"):
        ledger.used(f"{kwargs}.use_reentrant", "non-reentrant, Transformers 5's default")
