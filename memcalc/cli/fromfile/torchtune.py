"""A torchtune recipe config as memcalc's options.

A single-device recipe of a Llama builder in bf16 is replayed as torchtune runs it (--stack torchtune: its
TransformerDecoder op by op, bf16 LoRA adapters, torchao's NF4 for QLoRA, CEWithChunkedOutputLoss as --loss
chunked, optimizer_in_bwd as --optimizer-in-backward, bitsandbytes' paged optimizers' state in unified memory).
Any other recipe (another builder, fp32, the distributed recipes' FSDP) is the hf stack's step without a KV cache
(--no-cache), the model in the config's dtype (--recipe pure): Transformers' model of the same config computes
what torchtune's does, with PEFT's fp32 adapters for torchtune's LoRALinear and bitsandbytes' nf4 for its NF4.
apply_lora_to_output is lm_head among --lora-targets on either. What neither replays (activation offloading; the
chunked loss and the optimizer step in backward off the torchtune stack; fused linear cross-entropy) lowers the peak
by much, so a recipe that turns one on is refused, naming it, rather than answered with a peak it was written to
avoid.

Sources: pytorch/torchtune @ bd2a0fc7c314: recipes/configs/*/*.yaml (the keys), recipes/full_finetune_single_device.py
and lora_finetune_single_device.py (batch_size, gradient_accumulation_steps, dtype, enable_activation_checkpointing,
enable_activation_offloading, optimizer_in_bwd, compile, loss, tokenizer.max_seq_len, dataset.packed),
torchtune/models/*/__init__.py (the model builders), torchtune/modules/peft/lora.py (LoRALinear).
"""

from __future__ import annotations

from pathlib import Path

from .common import TrickSet, lora_targets
from .ledger import KeyLedger

# torchtune's builders (torchtune/models/<family>/__init__.py) as memcalc's presets of the same config.json
BUILDERS = {
    "llama2_7b": "llama2-7b", "llama2_13b": "llama2-13b", "llama2_70b": "llama2-70b", "llama3_8b": "llama3-8b",
    "llama3_70b": "llama3-70b", "llama3_1_8b": "llama3.1-8b", "llama3_1_70b": "llama3.1-70b",
    "llama3_1_405b": "llama3.1-405b", "llama3_2_1b": "llama3.2-1b", "llama3_2_3b": "llama3.2-3b",
    "mistral_7b": "mistral-7b", "gemma_7b": "gemma-7b", "gemma2_9b": "gemma2-9b", "phi3_mini": "phi3-mini",
    "qwen3_32b": "qwen3-32b",
    **{f"qwen3_{size}_{kind}": f"qwen3-{size.replace('_', '.')}" for size in ("0_6b", "1_7b", "4b", "8b", "14b")
       for kind in ("base", "instruct")},
}  # fmt: skip
# loss components as --loss, None where memcalc replays neither (LinearCrossEntropyLoss fuses the head into the loss)
LOSSES = {"torch.nn.CrossEntropyLoss": "full", "torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked",
          "torchtune.modules.loss.LinearCrossEntropyLoss": None,
          "torchtune.modules.loss.ChunkedCrossEntropyLoss": None}  # fmt: skip
# optimizer components as (--optimizer, --optimizer-impl); torch.optim.AdamW is foreach on CUDA unless fused: true
OPTIMIZERS = {"torch.optim.AdamW": ("adamw", "foreach"), "torch.optim.SGD": ("sgd", "foreach"),
              "bitsandbytes.optim.AdamW8bit": ("adam8bit", "loop"),
              "bitsandbytes.optim.PagedAdamW8bit": ("paged-adam8bit", "loop"),
              "bitsandbytes.optim.PagedAdamW": ("paged-adamw", "loop")}  # fmt: skip
SAVER = "is not modelled, and it lowers the peak by much: memcalc would overstate it; turn it off to estimate the " \
        "step without it"  # fmt: skip
CHUNKED = "torchtune.modules.loss.CEWithChunkedOutputLoss"
REMARKS = {"torchtune": "--stack torchtune: the single-device recipe replayed as torchtune runs it",
           "hf": "--stack hf --no-cache: torchtune's TransformerDecoder computes what Transformers' model of the same "
                 "config does, without a KV cache",
           "fsdp2": "--stack fsdp2: the distributed LoRA recipe's fully_shard per layer, over PEFT's model of the same "
                    "config"}  # fmt: skip
DISTRIBUTED = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "data_parallel_shard_dim")


def read_torchtune(ledger: KeyLedger, typed: dict) -> None:
    stack = typed.get("stack", "").strip().lower() or ("torchtune" if runs_as_torchtune(ledger) else "")
    replayed = stack == "torchtune"
    if ledger.flag("enable_activation_offloading"):
        ledger.refuse("enable_activation_offloading", f"activation offloading {SAVER}")
    elif ledger.has("enable_activation_offloading"):
        ledger.used("enable_activation_offloading", "off")
    if replayed:
        read_recipe_loop(ledger)
    else:
        read_loop_off_torchtune(ledger)
    lora = model_options(ledger)
    step_options(ledger)
    tricks_and_recipe(ledger, replayed)
    optimizer_options(ledger)
    sharded = distributed_options(ledger)
    stack = stack or ("fsdp2" if lora and sharded else "hf")  # LoRA under FSDP2: PEFT's model fully_shard-ed
    if "stack" not in typed:
        ledger.options["stack"] = stack
        ledger.origin["stack"] = ["model._component_"]
        ledger.remarks.append(REMARKS[stack])
    if stack == "hf":
        ledger.set("no_cache", True, "model._component_", "--no-cache")
    if lora and not replayed:
        nf4 = ", its NF4 as bitsandbytes' nf4" if "quantize" in ledger.options else ""
        ledger.caveat("model._component_", f"torchtune's LoRALinear replayed as PEFT's (fp32 adapters){nf4}")


def runs_as_torchtune(ledger: KeyLedger) -> bool:
    """Whether memcalc's replay of torchtune's single-device recipes takes this config: a Llama builder it replays
    (memcalc.exact.torchtune.model.BUILDERS), in bf16, on one device (none of the distributed recipes' keys)."""
    from memcalc.exact.torchtune.model import BUILDERS as REPLAYED

    component = ledger.text("model._component_") or ""
    base = component.rsplit(".", 1)[-1].removeprefix("qlora_").removeprefix("lora_")
    replayed = {name for name, _, _ in REPLAYED.values()}
    dtype = (ledger.text("dtype") or "").strip().lower()
    distributed = any(ledger.has(k) for k in DISTRIBUTED) or (ledger.count("tensor_parallel_dim") or 1) > 1
    return base in replayed and dtype in ("bf16", "bfloat16") and not distributed


def read_recipe_loop(ledger: KeyLedger) -> None:
    """The recipe's loss and optimizer_in_bwd, as --stack torchtune replays them."""
    loss = ledger.text("loss._component_")
    if loss is not None:
        if LOSSES.get(loss) is None:
            ledger.refuse("loss._component_", "a fused linear cross-entropy is not modelled, and it lowers the peak "
                                              f"by much: memcalc would overstate it; set {CHUNKED} to estimate the "
                                              "step with torchtune's chunked loss" if loss in LOSSES else
                          f"memcalc models torch.nn.CrossEntropyLoss and {CHUNKED}")  # fmt: skip
        ledger.set("loss", LOSSES[loss], "loss._component_", f"--loss {LOSSES[loss]}")
    if ledger.flag("optimizer_in_bwd"):
        ledger.set("optimizer_in_backward", True, "optimizer_in_bwd", "--optimizer-in-backward")
    elif ledger.has("optimizer_in_bwd"):
        ledger.used("optimizer_in_bwd", "off")


def read_loop_off_torchtune(ledger: KeyLedger) -> None:
    """The recipe's loss and optimizer_in_bwd where the hf stack stands in: the whole-logits loss, the step after
    backward, or a refusal."""
    if ledger.flag("optimizer_in_bwd"):
        ledger.refuse("optimizer_in_bwd", f"the optimizer step fused into backward {SAVER}")
    elif ledger.has("optimizer_in_bwd"):
        ledger.used("optimizer_in_bwd", "off")
    loss = ledger.text("loss._component_")
    if loss is not None and LOSSES.get(loss) != "full":
        ledger.refuse("loss._component_", "a chunked or fused cross-entropy is not modelled off --stack torchtune, "
                                          "and it lowers the peak by much: memcalc would overstate it; set "
                                          "torch.nn.CrossEntropyLoss to estimate the step without it" if loss in LOSSES
                      else "memcalc models torch.nn.CrossEntropyLoss")  # fmt: skip
    if loss is not None:
        ledger.used("loss._component_", "cross-entropy over the whole logits, as replayed")


def model_options(ledger: KeyLedger) -> bool:
    """model._component_: the builder as a preset (its checkpoint's config.json where no preset matches), lora_ or
    qlora_ its LoRA, with the builder's lora_* arguments; whether LoRA is on."""
    component = ledger.text("model._component_")
    if component is None:
        ledger.refuse("model", "a torchtune config names its model as model._component_")
    builder = component.rsplit(".", 1)[-1]
    base = builder.removeprefix("qlora_").removeprefix("lora_")
    config = Path(ledger.text("checkpointer.checkpoint_dir") or "") / "config.json"
    if base in BUILDERS:
        ledger.set("model", BUILDERS[base], "model._component_", f"--model {BUILDERS[base]}")
    elif ledger.has("checkpointer.checkpoint_dir") and config.is_file():
        ledger.set("config", str(config), "model._component_", f"--config {config}")
    else:
        ledger.refuse_unless(("params", "model", "config"), "model._component_", "no memcalc preset for this builder and no config.json in "
                                                           "checkpointer.checkpoint_dir: give --model or --config")
    if builder == base:
        return False
    ledger.set("lora", str(ledger.count("model.lora_rank") or 8), "model.lora_rank")
    modules = list(ledger.names("model.lora_attn_modules") or [])
    if ledger.flag("model.apply_lora_to_mlp"):
        modules += ["w1", "w2", "w3"]
    if ledger.flag("model.apply_lora_to_output"):
        modules.append("lm_head")
    if not modules:
        ledger.refuse("model.lora_attn_modules", "LoRA wraps no module")
    ledger.set("lora_targets", lora_targets(ledger, "model.lora_attn_modules", modules), "model.lora_attn_modules")
    if ledger.flag("model.apply_lora_to_mlp"):
        ledger.used("model.apply_lora_to_mlp", "gate, up, down in --lora-targets")
    elif ledger.has("model.apply_lora_to_mlp"):
        ledger.used("model.apply_lora_to_mlp", "off")
    if ledger.has("model.lora_dropout"):
        ledger.set("lora_dropout", str(ledger.number("model.lora_dropout")), "model.lora_dropout")
    if ledger.flag("model.apply_lora_to_output"):
        ledger.set("lora_targets", ledger.options["lora_targets"], "model.apply_lora_to_output",
                   "lm_head in --lora-targets")  # fmt: skip
    if ledger.flag("model.use_dora"):
        ledger.refuse("model.use_dora", "DoRA is not modelled")
    if builder.startswith("qlora_") or ledger.flag("model.quantize_base"):
        ledger.set("quantize", "nf4", "model._component_", "--quantize nf4")
    if ledger.has("model.lora_alpha"):
        ledger.ignore("model.lora_alpha", "scales the adapters: no memory")
    if ledger.has("model.apply_lora_to_output") and not ledger.flag("model.apply_lora_to_output"):
        ledger.ignore("model.apply_lora_to_output", "off")
    return True


def step_options(ledger: KeyLedger) -> None:
    if ledger.has("batch_size"):
        ledger.set("micro_batch", str(ledger.count("batch_size")), "batch_size")
    if ledger.has("gradient_accumulation_steps"):
        ledger.set("grad_accum", str(ledger.count("gradient_accumulation_steps")), "gradient_accumulation_steps")
    if ledger.has("tokenizer.max_seq_len"):
        ledger.set("seq", str(ledger.count("tokenizer.max_seq_len")), "tokenizer.max_seq_len")
    else:
        ledger.default("seq", None, "tokenizer.max_seq_len", "no truncation (the data sets the length)",
                       "memcalc's default --seq, or give --seq")  # fmt: skip
    packed = ledger.flag("dataset.packed")
    if packed is not None:
        ledger.used("dataset.packed", "full sequences, as memcalc takes them" if packed else
                    "the verdict is for full sequences, the longest batch")


def tricks_and_recipe(ledger: KeyLedger, replayed: bool) -> None:
    """dtype (the model's, and so its gradients' and optimizer state's: --recipe pure, which --stack torchtune
    runs already), checkpointing, compile. torchtune's attention is SDPA (torchtune/modules/attention.py): flash."""
    tricks = TrickSet()
    dtype = (ledger.text("dtype") or "fp32").strip().lower()
    precision = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "bfloat16": "bf16", "float32": "fp32"}.get(dtype)
    if precision is None:
        ledger.refuse("dtype", "bf16, fp16 or fp32")
    tricks.add(precision, "dtype", "" if ledger.has("dtype") else "torchtune's default")
    if precision != "fp32" and not replayed:
        ledger.set("recipe", "pure", "dtype", f"--recipe pure ({precision} weights, gradients and optimizer state)")
    tricks.add("flash", "model._component_", "torchtune's attention, SDPA")
    if ledger.flag("enable_activation_checkpointing"):
        tricks.add("ckpt", "enable_activation_checkpointing")
    elif ledger.has("enable_activation_checkpointing"):
        ledger.used("enable_activation_checkpointing", "off")
    if ledger.flag("compile"):
        tricks.add("compile", "compile")
    elif ledger.has("compile"):
        ledger.used("compile", "off")
    tricks.commit(ledger)


def optimizer_options(ledger: KeyLedger) -> None:
    component = ledger.text("optimizer._component_")
    if component is None:
        return
    if component not in OPTIMIZERS:
        ledger.refuse("optimizer._component_", f"memcalc models {', '.join(OPTIMIZERS)}")
    optimizer, impl = OPTIMIZERS[component]
    impl = "fused" if optimizer == "adamw" and ledger.flag("optimizer.fused") else impl
    note = f"--optimizer {optimizer} --optimizer-impl {impl}"
    ledger.set("optimizer", optimizer, "optimizer._component_", note)
    ledger.set("optimizer_impl", impl, "optimizer._component_", note)
    if ledger.has("optimizer.fused"):
        ledger.used("optimizer.fused", note)


def distributed_options(ledger: KeyLedger) -> bool:
    """The distributed recipes' FSDP2 (fully_shard, resharding after forward unless fsdp_reshard_after_forward is
    false; fsdp_cpu_offload) as --zero 3 (2) over --gpus N; whether the file shards. Tensor parallel is not read."""
    if (ledger.count("tensor_parallel_dim") or 1) > 1:
        ledger.refuse("tensor_parallel_dim", "torchtune's tensor parallel plan is not read: give --tp")
    keys = [k for k in DISTRIBUTED if ledger.has(k)]
    if not keys:
        return False
    stage = "2" if ledger.flag("fsdp_reshard_after_forward") is False else "3"
    ledger.set("zero", stage, keys[0], f"--zero {stage} (FSDP2's fully_shard)")
    if ledger.flag("fsdp_cpu_offload"):
        ledger.set("offload_params", True, "fsdp_cpu_offload", "--offload-params")
    ledger.refuse_unless(("gpus", "zero"), keys[0], "FSDP shards over the job's GPUs, which tune run's "
                                                    "--nproc_per_node sets, not the file: add --gpus N", replaces=False)
    return True
