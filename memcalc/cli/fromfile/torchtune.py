"""A torchtune recipe config as memcalc's options.

memcalc does not replay torchtune's own modules. Its TransformerDecoder computes what Transformers' model of the
same config computes, so the step is the hf stack's without a KV cache (--no-cache), the model in the config's
dtype (--recipe pure); its LoRALinear is replayed as PEFT's, whose fp32 adapters and fp32 casts of their inputs
hold more than torchtune's adapters in the model's dtype, and its QLoRA's torchao NF4 as bitsandbytes' nf4 (the
same 4 bits, double-quantised scales). torchtune's memory savers are not replayed (chunked or fused cross-entropy,
activation offloading, the optimizer step in backward, LoRA on the output): each lowers the peak by much, so a
recipe that turns one on is refused, naming it, rather than answered with a peak it was written to avoid.

Sources: pytorch/torchtune @ bd2a0fc7c314: recipes/configs/*/*.yaml (the keys), recipes/full_finetune_single_device.py
and lora_finetune_single_device.py (batch_size, gradient_accumulation_steps, dtype, enable_activation_checkpointing,
enable_activation_offloading, optimizer_in_bwd, compile, loss, tokenizer.max_seq_len, dataset.packed),
torchtune/models/*/__init__.py (the model builders), torchtune/modules/peft/lora.py (LoRALinear).
"""

from __future__ import annotations

from pathlib import Path

from .common import PAGED, TrickSet, lora_targets
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
LOSSES = {"torch.nn.CrossEntropyLoss": True, "torchtune.modules.loss.CEWithChunkedOutputLoss": False,
          "torchtune.modules.loss.LinearCrossEntropyLoss": False,
          "torchtune.modules.loss.ChunkedCrossEntropyLoss": False}  # fmt: skip
# optimizer components as (--optimizer, --optimizer-impl); torch.optim.AdamW is foreach on CUDA unless fused: true
OPTIMIZERS = {"torch.optim.AdamW": ("adamw", "foreach"), "torch.optim.SGD": ("sgd", "foreach"),
              "bitsandbytes.optim.AdamW8bit": ("adam8bit", "loop"), "bitsandbytes.optim.PagedAdamW8bit": ("adam8bit", "loop"),
              "bitsandbytes.optim.PagedAdamW": ("adamw", "fused")}  # fmt: skip
SAVER = "is not modelled, and it lowers the peak by much: memcalc would overstate it; turn it off to estimate the " \
        "step without it"  # fmt: skip
DISTRIBUTED = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "data_parallel_shard_dim")


def read_torchtune(ledger: KeyLedger, typed: dict) -> None:
    for key, what in (("enable_activation_offloading", "activation offloading"),
                      ("optimizer_in_bwd", "the optimizer step fused into backward")):  # fmt: skip
        if ledger.flag(key):
            ledger.refuse(key, f"{what} {SAVER}")
        elif ledger.has(key):
            ledger.used(key, "off")
    loss = ledger.text("loss._component_")
    if loss is not None and not LOSSES.get(loss, False):
        ledger.refuse("loss._component_", "a chunked or fused cross-entropy is not modelled, and it lowers the peak "
                                          "by much: memcalc would overstate it; set torch.nn.CrossEntropyLoss to "
                                          "estimate the step without it" if loss in LOSSES else
                      "memcalc models torch.nn.CrossEntropyLoss")  # fmt: skip
    if loss is not None:
        ledger.used("loss._component_", "cross-entropy over the whole logits, as replayed")
    lora = model_options(ledger)
    step_options(ledger)
    tricks_and_recipe(ledger)
    optimizer_options(ledger)
    distributed_options(ledger, lora)
    if "stack" not in typed:
        ledger.options["stack"] = "hf"
        ledger.origin["stack"] = ["model._component_"]
        ledger.remarks.append("--stack hf --no-cache: torchtune's TransformerDecoder computes what Transformers' model "
                              "of the same config does, without a KV cache")  # fmt: skip
    if typed.get("stack", "hf").strip().lower() == "hf":
        ledger.set("no_cache", True, "model._component_", "--no-cache")
    if lora:
        nf4 = ", its NF4 as bitsandbytes' nf4" if "quantize" in ledger.options else ""
        ledger.caveat("model._component_", f"torchtune's LoRALinear replayed as PEFT's (fp32 adapters){nf4}")


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
        ledger.refuse("model.apply_lora_to_output", "LoRA on the output projection is not modelled")
    if ledger.flag("model.use_dora"):
        ledger.refuse("model.use_dora", "DoRA is not modelled")
    if builder.startswith("qlora_") or ledger.flag("model.quantize_base"):
        ledger.set("quantize", "nf4", "model._component_", "--quantize nf4")
    for key in ("model.lora_alpha", "model.apply_lora_to_output"):
        if ledger.has(key):
            ledger.ignore(key, "scales the adapters: no memory" if key.endswith("alpha") else "off")
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


def tricks_and_recipe(ledger: KeyLedger) -> None:
    """dtype (the model's, and so its gradients' and optimizer state's: --recipe pure), checkpointing, compile.
    torchtune's attention is SDPA (torchtune/modules/attention.py): flash."""
    tricks = TrickSet()
    dtype = (ledger.text("dtype") or "fp32").strip().lower()
    precision = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "bfloat16": "bf16", "float32": "fp32"}.get(dtype)
    if precision is None:
        ledger.refuse("dtype", "bf16, fp16 or fp32")
    tricks.add(precision, "dtype", "" if ledger.has("dtype") else "torchtune's default")
    if precision != "fp32":
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
    if "Paged" in component:
        ledger.caveat("optimizer._component_", PAGED)


def distributed_options(ledger: KeyLedger, lora: bool) -> None:
    """The distributed recipes' FSDP2 (fully_shard, resharding after forward unless fsdp_reshard_after_forward is
    false; fsdp_cpu_offload) as --zero 3 (2) over --gpus N; their tensor parallel is not read."""
    if (ledger.count("tensor_parallel_dim") or 1) > 1:
        ledger.refuse("tensor_parallel_dim", "torchtune's tensor parallel plan is not read: give --tp")
    keys = [k for k in DISTRIBUTED if ledger.has(k)]
    if not keys:
        return
    stage = "2" if ledger.flag("fsdp_reshard_after_forward") is False else "3"
    if lora:
        ledger.refuse_unless(("zero",), keys[0], "LoRA sharded over GPUs (FSDP2) is not replayed yet: memcalc replays it "
                                              "on one GPU or plain data parallelism (--zero 0)")  # fmt: skip
    ledger.set("zero", stage, keys[0], f"--zero {stage} (FSDP2's fully_shard)")
    if ledger.flag("fsdp_cpu_offload"):
        ledger.set("offload_params", True, "fsdp_cpu_offload", "--offload-params")
    ledger.refuse_unless(("gpus", "zero"), keys[0], "FSDP shards over the job's GPUs, which tune run's "
                                                    "--nproc_per_node sets, not the file: add --gpus N", replaces=False)
