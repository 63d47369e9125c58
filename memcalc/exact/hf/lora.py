"""PEFT's LoRA, and frozen weights, on Transformers' classes, op by op in bytes on memcalc.exact.sim.graph.

What verify/lora.py builds: get_peft_model(model, LoraConfig(r, target_modules, lora_dropout)) over a model
loaded in the trick set's dtype. Each targeted nn.Linear becomes peft/tuners/lora/layer.py Linear: its
base_layer (the frozen weight, requires_grad False: peft/tuners/tuners_utils.py BaseTuner
_mark_only_adapters_as_trainable), lora_A (r, in) and lora_B (out, r), upcast to fp32 whatever the base's
dtype (tuners_utils.py cast_adapter_dtype, autocast_adapter_dtype=True). Frozen weights hold no gradient,
no master copy and no optimizer state; an op whose weight does not require grad saves only what its input's
gradient needs (aten.mm saves self only when mat2 requires grad), and an op whose inputs need none saves
nothing: so the first block, whose input comes from a frozen embedding, saves less still, unless gradient
checkpointing is on, which makes the embedding's output require grad (modeling_utils.py
enable_input_require_grads, called by _activation_checkpointing_enable and PeftModel.__init__).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.model.finetune import Finetune, peft_targets
from memcalc.model.stacks import bf16_adapters

from .. import aten
from ..sim.graph import Graph, layer_of
from ..sim.tensors import Tensor
from .attention import dropout
from .dora import dora_result
from .trl import prepared_dtype

if TYPE_CHECKING:
    from .family import HFModel

ADAPTERS = ("lora_A", "lora_B", "lora_magnitude_vector")


def with_adapters(params: list[tuple[str, tuple]], finetune: Finetune, arch: str) -> list[tuple[str, tuple]]:
    """named_parameters() of the PEFT model: each targeted projection's base weight (and bias), then its
    lora_A (r, in) and lora_B (out, r) (LoraLayer.update_layer registers them after base_layer); a module in
    modules_to_save as ModulesToSaveWrapper holds it, the frozen original_module first, then its trained copy
    (named here as the module's own weight, which the forward reads)."""
    if not finetune.lora:
        return params
    out, wrapped = [], peft_targets(arch, finetune)
    for k, (name, shape) in enumerate(params):
        module = name.rpartition(".")[0]
        if module.rpartition(".")[2] in finetune.modules_to_save:
            out.append((module + ".original_module.weight", shape))
        out.append((name, shape))
        nxt = params[k + 1][0] if k + 1 < len(params) else ""
        if module.rpartition(".")[2] in wrapped and not nxt.startswith(module + "."):
            rows, cols = params[[n for n, _ in params].index(module + ".weight")][1]
            if arch == "gpt2" and module != "lm_head":  # Conv1D's weight is (in, out): PEFT reads it so
                rows, cols = cols, rows
            out += [(module + ".lora_A.weight", (finetune.lora_rank, cols)),
                    (module + ".lora_B.weight", (rows, finetune.lora_rank))]  # fmt: skip
            out += [(module + ".lora_magnitude_vector.weight", (rows,))] if finetune.dora else []
    return out


def trainable(name: str, finetune: Finetune, tied: bool) -> bool:
    """Whether the parameter trains: LoRA's adapters alone, or every weight but the frozen parts (a tied head is
    the embedding's table: freezing either freezes it)."""
    if finetune.lora:
        module = name.rpartition(".")[0].rpartition(".")[2]
        return module in ADAPTERS or module in finetune.modules_to_save  # a modules_to_save copy trains whole
    if "embeddings" in finetune.freeze and name.endswith("embed_tokens.weight"):
        return False
    if "head" in finetune.freeze and (name == "lm_head.weight" or (tied and name.endswith("embed_tokens.weight"))):
        return False
    layer = layer_of(name)
    return layer is None or layer >= finetune.frozen_blocks


def dtype_of(name: str, cfg) -> str:
    """A LoRA model's base is loaded in the trick set's dtype (from_pretrained(dtype=...), as PEFT's and QLoRA's
    examples load it, whatever the recipe), but where TRL's SFTTrainer prepared a 4-bit model
    (memcalc.exact.hf.trl.prepared_dtype); its adapters are fp32 (cast_adapter_dtype), but where TRL from 0.26 cast
    a 4-bit model's trainable parameters to bf16 (DoRA's magnitudes up to 1.14: memcalc.model.stacks.bf16_adapters).
    Otherwise the recipe's."""
    if not cfg.finetune.lora:
        return cfg.weights_dtype
    module = name.rpartition(".")[0].rpartition(".")[2]
    if module in ADAPTERS:  # FSDP2 runs them unsharded in its param_dtype (memcalc.exact.replay.fsdp2_lora)
        if cfg.stack.engine == "fsdp2":
            return cfg.precision
        return "bf16" if bf16_adapters(cfg.stack, module == "lora_magnitude_vector") else "fp32"
    if bf16_adapters(cfg.stack) and module in cfg.finetune.modules_to_save:  # a trained copy, cast with them
        return "bf16"
    return prepared_dtype(name, cfg) or cfg.precision


def parameter(g: Graph, cfg, name: str, shape: tuple) -> Tensor:
    """A parameter as the model holds it: trainable (an AccumulateGrad leaf) or frozen (requires_grad False)."""
    dtype = dtype_of(name, cfg)
    if trainable(name, cfg.finetune, cfg.shape.tied_embeddings):
        return g.param(shape, dtype, name)
    t = g.empty(shape, dtype, "param " + name, kind="param")
    t.name = name
    return t


def embedded(g: Graph, m: HFModel, x: Tensor) -> Tensor:
    """The input embedding module's output as the model hands it on: under full checkpointing
    enable_input_require_grads' hook (activation_checkpointing_enable) makes it require grad, a leaf where the
    table is frozen (LoRA, frozen embeddings); Gemma's module is the scaled one, so the hook sees the product."""
    return require_grad(g, x) if m.cfg.recompute == "full" else x


def require_grad(g: Graph, x: Tensor) -> Tensor:
    """enable_input_require_grads' hook, output.requires_grad_(True): a tensor no gradient reaches becomes a leaf
    that requires one (its gradient is accumulated into its .grad); one that requires grad already is unchanged."""
    return g.leaf(x)


def lora_linear(g: Graph, m: HFModel, name: str, x: Tensor, base=None) -> Tensor:
    """peft/tuners/lora/layer.py Linear.forward: result = base_layer(x) (nn.Linear's, or base(x): GPT-2's Conv1D,
    fan_in_fan_out); x cast to lora_A's dtype (_cast_input_dtype: x.to(dtype) when they differ); result = result +
    lora_B(lora_A(dropout(x))) * scaling (nn.Identity at lora_dropout 0, else nn.Dropout: F.dropout);
    result.to(the base's result dtype)."""
    result = base(x) if base else aten.linear(g, x, m.p[name + ".weight"], m.p.get(name + ".bias"))
    torch_result_dtype = result.dtype
    a, b = m.p[name + ".lora_A.weight"], m.p[name + ".lora_B.weight"]
    x = aten.to(g, x, a.dtype)
    ft = m.cfg.finetune
    if ft.dora:  # DoraLinearVariant.forward (memcalc.exact.hf.dora)
        magnitude = m.p[name + ".lora_magnitude_vector.weight"]
        result = dora_result(g, m.p[name + ".weight"], m.p.get(name + ".bias"), magnitude, a, b, x, result,
                             ft.lora_dropout)  # fmt: skip
    else:
        result = aten.add(g, result, adapter(g, x, a, b, ft.lora_dropout))
    result = aten.to(g, result, torch_result_dtype)
    del x
    return result


def adapter(g: Graph, x: Tensor, a: Tensor, b: Tensor, p: float) -> Tensor:
    """lora_B(lora_A(dropout(x))) * scaling: each temporary is held while the op it is passed to runs (nn.Linear's
    input, though autocast hands F.linear a cast copy), then dies unless saved."""
    dropped = dropout(g, x, p)
    down = aten.linear(g, dropped, a, None)
    del dropped
    up = aten.linear(g, down, b, None)
    del down
    return aten.mul_scalar(g, up)
