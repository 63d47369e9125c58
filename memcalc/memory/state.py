"""Model state: weights, gradients, master weights and optimizer state, per GPU.

Mixed precision with Adam (Micikevicius et al. 2018; Rajbhandari et al. 2019, sec. 3.1):
2 (16-bit weight) + 2 (16-bit grad) + 4 (fp32 master) + 4 (Adam m) + 4 (Adam v) = 16 bytes/param.
ZeRO stage 1 shards optimizer state (master, m, v) over the data-parallel ranks, stage 2 adds the
gradients, stage 3 the weights (Rajbhandari et al. 2019, sec. 5, Fig. 1).
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.errors import InputError
from memcalc.model.bnb import BLOCK  # elements per absmax scale in bitsandbytes' block-wise 8-bit optimizers
from memcalc.model.layout import Layout
from memcalc.model.sizes import MAX_GPUS  # noqa: F401  (the CLI's limit on --gpus)
from memcalc.records import record

OPTIMIZERS = ("adamw", "sgd", "adam8bit", "paged-adam8bit", "paged-adamw")
WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of one element


@record(frozen=True)
class StateSharding:
    """How the textbook's model state is spread (the input of model_state; a job's is its layout's:
    state_sharding): over how many data-parallel ranks, at which ZeRO stage, the optimizer offloaded or not."""

    gpus: int = 1
    zero: int = 0  # 0 replicates everything; 1, 2, 3 as Rajbhandari et al. 2019
    offload: bool = False  # ZeRO-Offload (Ren et al. 2021): master + moments live in host memory

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or not 0 < self.gpus <= MAX_GPUS:
            raise InputError(f"gpus must be a whole number in [1, {MAX_GPUS}], got {self.gpus!r}")
        if self.zero not in (0, 1, 2, 3):
            raise InputError(f"zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.offload and not self.can_offload:
            raise InputError("optimizer offload over several data-parallel GPUs needs ZeRO >= 1 "
                             "(DeepSpeed's offload_optimizer runs on ZeRO stages 1-3)")  # fmt: skip

    @property
    def can_offload(self) -> bool:
        """Whether optimizer offload may be added: on one GPU, or over several with ZeRO >= 1."""
        return self.gpus == 1 or self.zero >= 1

    @property
    def gathers_layers(self) -> bool:
        """ZeRO-3 over several GPUs all-gathers each layer's weights before it runs."""
        return self.zero == 3 and self.gpus > 1


@record(frozen=True, slots=True)  # frozen: model_state's cache hands the same parts to every caller
class StatePart:
    """One part of model state (weights, grads, master, a moment), as one GPU holds it."""

    name: str  # "weights", "grads", "master", "adam_m", ...
    dtype: str  # what one element is stored as
    bytes_per_param: float  # before sharding; 8-bit Adam adds its per-block scales
    bytes: int  # held by one GPU (or, on host, by one GPU's share of host memory)
    sharded_over: int  # how many ranks share this part (1: replicated)
    on_host: bool  # in CPU memory: moved there by offload, or (unified) paged by the driver
    formula: str  # template over {N} parameters and {G} GPUs, for --explain
    unified: bool = False  # a paged optimizer's state: unified memory the driver pages to the host (on_host too)


@record(frozen=True, slots=True)
class ModelState:
    """Every part of model state one GPU holds, in its memory or (offloaded) in host memory."""

    params: int
    precision: str
    optimizer: str
    sharding: StateSharding
    parts: tuple[StatePart, ...]
    recipe: str = "master"  # how 16 bits train: master | autocast | pure | main_grad | grad_partition | lora | qlora
    # (lora:dtype, qlora:dtype: the adapters in the model's dtype, torchtune's)

    @property
    def total_bytes(self) -> int:
        """Per-GPU bytes in GPU memory."""
        return sum(p.bytes for p in self.parts if not p.on_host)

    @property
    def host_bytes(self) -> int:
        """Per-GPU bytes moved to host memory by offload."""
        return sum(p.bytes for p in self.parts if p.on_host)

    @property
    def bytes_per_param(self) -> float:
        """Unsharded bytes per parameter, all parts together (16 for mixed-precision AdamW)."""
        return sum(p.bytes_per_param for p in self.parts)


def optimizer_elements(optimizer: str, params: int, dtype: str = "fp32") -> list[tuple[str, str, int, str]]:
    """(name, dtype, bytes, formula) of each optimizer state tensor, unsharded. dtype: what the state
    is kept in (the master's fp32; a pure 16-bit recipe's zeros_like(param) makes it 16-bit)."""
    w = WIDTH[dtype]
    if optimizer == "adamw":  # Loshchilov & Hutter 2019: first and second moments
        return [("adam_m", dtype, w * params, f"{w}·{{N}}"), ("adam_v", dtype, w * params, f"{w}·{{N}}")]
    if optimizer == "sgd":  # SGD with momentum: one buffer
        return [("momentum", dtype, w * params, f"{w}·{{N}}")]
    if optimizer == "paged-adamw":  # bitsandbytes PagedAdamW: Optimizer2State(optim_bits=32), fp32 m and v
        return [("adam_m", "fp32", 4 * params, "4·{N}"), ("adam_v", "fp32", 4 * params, "4·{N}")]
    if optimizer in ("adam8bit", "paged-adam8bit"):  # Dettmers et al. 2022: uint8 states + one fp32 absmax per block
        size = params + 4 * -(-params // BLOCK)
        formula = "{N} + 4·⌈{N}/%d⌉" % BLOCK
        return [("adam_m", "uint8", size, formula), ("adam_v", "uint8", size, formula)]
    raise InputError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")


def unsharded_parts(precision: str, optimizer: str, params: int, recipe: str = "master") -> list[tuple[str, str, int, int, str]]:
    """(name, dtype, bytes, ZeRO stage that shards it, formula) for every part of model state.

    recipe (memcalc.model.stacks): how a 16-bit precision trains. master: 16-bit weights and grads with
    an fp32 master (Micikevicius et al. 2018); autocast: fp32 weights and grads, the weights being the
    master; pure: 16-bit weights, grads and optimizer state, no master; main_grad (Megatron-LM): 16-bit
    weights, the gradients accumulated in an fp32 main_grad buffer, an fp32 master; grad_partition
    (DeepSpeed ZeRO): 16-bit weights and grads, an fp32 master and an fp32 copy of the gradient
    partition. fp32 trains in fp32 alike."""
    if precision == "fp32" or recipe == "autocast":  # the weights are fp32 and are what the optimizer updates
        parts = [("weights", "fp32", 4 * params, 3, "4·{N}"), ("grads", "fp32", 4 * params, 2, "4·{N}")]
    else:  # 16-bit copies, and (but for pure) an fp32 master (Micikevicius et al. 2018)
        parts = [("weights", precision, 2 * params, 3, "2·{N}"), grads_part(precision, params, recipe)]
        if recipe == "grad_partition":  # deepspeed/runtime/zero/stage_1_and_2.py step: the partition's grads .to(fp32)
            parts.append(("grads_fp32", "fp32", 4 * params, 1, "4·{N}"))
        if recipe != "pure":
            parts.append(("master", "fp32", 4 * params, 1, "4·{N}"))
    state_dtype = precision if recipe == "pure" else "fp32"
    parts += [(name, dtype, size, 1, f) for name, dtype, size, f in optimizer_elements(optimizer, params, state_dtype)]
    if precision == "fp16" and recipe != "pure":  # dynamic loss scaling: GradScaler's fp32 scale + int32 tracker
        # (pure fp16 has none: GradScaler.unscale_ refuses fp16 grads, torch/amp/grad_scaler.py _unscale_grads_)
        parts.append(("loss_scale", "fp32+int32", 8, 99, "8"))
    return parts


def grads_part(precision: str, params: int, recipe: str) -> tuple[str, str, int, int, str]:
    """The gradients of a 16-bit recipe: in its dtype, but Megatron-LM's main_grad buffer holds bf16 training's
    in fp32 (megatron/training/arguments.py: bf16 sets accumulate_allreduce_grads_in_fp32; fp16 keeps 16 bits)."""
    if recipe == "main_grad" and precision == "bf16":
        return ("grads", "fp32", 4 * params, 2, "4·{N}")
    return ("grads", precision, 2 * params, 2, "2·{N}")


NOT_SHARDED = StateSharding()  # one GPU, nothing sharded or offloaded


def state_sharding(layout: Layout) -> StateSharding:
    """The layout's sharding of model state: over its ZeRO group (dp × cp, or a node's part with hybrid shard),
    or, without ZeRO, replicated on its dp ranks; the optimizer offloaded where the layout offloads it."""
    return StateSharding(layout.shard_group if layout.zero else layout.dp, layout.zero, layout.offload_optimizer)


def paged(optimizer: str, part: str) -> bool:
    """A part bitsandbytes' paged optimizers keep in unified memory (get_paged: cudaMallocManaged), which the driver
    moves to the host when the GPU's memory runs short: their moments, off the GPU's allocator."""
    return optimizer.startswith("paged-") and part in ("adam_m", "adam_v")


@lru_cache(maxsize=1024)  # the same for every sequence and micro-batch: each estimate asks again
def model_state(params: int, precision: str, optimizer: str = "adamw", sharding: StateSharding = NOT_SHARDED,
                recipe: str = "master") -> ModelState:  # fmt: skip
    """Per-GPU model state. A part is sharded (ceil-divided) when the ZeRO stage reaches it."""
    parts = []
    for name, dtype, size, stage, formula in unsharded_parts(precision, optimizer, params, recipe):
        shards = sharding.gpus if sharding.zero >= stage else 1
        unified = paged(optimizer, name)
        on_host = sharding.offload and stage == 1 or unified  # offloaded master and moments; paged state
        per_param = 0.0 if name == "loss_scale" else size / params
        if shards > 1:
            formula = "⌈(" + formula + ")/{G}⌉"
        parts.append(StatePart(name, dtype, per_param, -(-size // shards), shards, on_host, formula, unified))
    return ModelState(params, precision, optimizer, sharding, tuple(parts), recipe)


@lru_cache(maxsize=256)
def finetune_state(params: int, frozen: int, trained: int, frozen_dtype: str, precision: str, optimizer: str,
                   recipe: str, lora: bool, quantized: tuple[int, int] = (0, 0),
                   sharding: StateSharding = NOT_SHARDED, upcast: bool = True,
                   unpaged: int = 0, copies: int = 0) -> ModelState:  # fmt: skip
    """Model state on one GPU when only some weights train (memcalc.model.finetune): the frozen weights in their
    dtype (QLoRA's 4-bit ones as bitsandbytes stores them: quantized = (their count, their bytes)) and nothing
    else for them (no gradient, master or optimizer state: the optimizer is given only what requires grad); the
    trained ones by the recipe, LoRA's adapters in fp32 whatever the precision (PEFT upcasts them:
    peft/tuners/tuners_utils.py cast_adapter_dtype), so theirs are fp32 weights, grads and moments; upcast=False
    keeps them in the model's dtype, trained in it (torchtune builds them under set_default_dtype; TRL from 0.26
    casts a 4-bit model's to bf16: memcalc.model.stacks.bf16_adapters). sharding:
    each part split as its ZeRO stage reaches it; the frozen weights (QLoRA's 4-bit ones too) at stage 3 alone.
    unpaged: under a paged optimizer, the trained elements in tensors too small to page (memcalc.model.bnb), whose
    moments stay on the GPU. copies: of the trained, PEFT's modules_to_save copies, trained whole in the model's
    dtype (ModulesToSaveWrapper is no tuner layer: cast_adapter_dtype leaves it), their moments in it too."""
    w, frozen_shards = WIDTH[frozen_dtype], sharding.gpus if sharding.zero >= 3 else 1
    parts = [StatePart("frozen weights", frozen_dtype, w * frozen / params, -(-w * frozen // frozen_shards),
                       frozen_shards, False, f"{w}·{frozen}")]  # fmt: skip
    if quantized[0]:
        packed = f"{quantized[1]} (packed nf4, absmax, nested state, codes)"
        parts.append(StatePart("4-bit weights", "nf4", quantized[1] / params, -(-quantized[1] // frozen_shards),
                               frozen_shards, False, packed))  # fmt: skip
    fp32_adapters = lora and upcast
    rows = unsharded_parts("fp32" if fp32_adapters else precision, optimizer, trained - copies,
                           "master" if fp32_adapters else "pure" if lora else recipe)  # fmt: skip
    if copies:
        rows += [("copy " + name, dtype, size, stage, formula) for name, dtype, size, stage, formula
                 in unsharded_parts(precision, optimizer, copies, "pure") if name != "loss_scale"]  # fmt: skip
    if lora and precision == "fp16" and recipe != "pure":  # GradScaler's fp32 scale + int32 tracker
        rows.append(("loss_scale", "fp32+int32", 8, 99, "8"))
    kept = {n: (b, f) for n, _, b, f in optimizer_elements(optimizer, unpaged)} \
        if unpaged and optimizer.startswith("paged-") else {}  # fmt: skip
    for name, dtype, size, stage, formula in rows:
        kept_name = name == "loss_scale" or name.startswith("copy ")
        label = name if kept_name else ("adapter " if lora else "trained ") + name
        shards = sharding.gpus if sharding.zero >= stage else 1
        n = copies if name.startswith("copy ") else trained - copies
        if name in kept:  # the small tensors' moments, on the GPU; the rest paged
            kept_bytes, kept_formula = kept[name]
            parts.append(StatePart(label, dtype, kept_bytes / params, -(-kept_bytes // shards), shards, False,
                                   kept_formula.replace("{N}", str(unpaged))))  # fmt: skip
            size, n, label = size - kept_bytes, trained - copies - unpaged, label + " (paged)"
        per_param = 0.0 if name == "loss_scale" else size / params
        unified = paged(optimizer, name.removeprefix("copy "))  # a copy's tables are paged whole
        parts.append(StatePart(label, dtype, per_param, -(-size // shards), shards, unified,
                               formula.replace("{N}", str(n)), unified))  # fmt: skip
    how = (("qlora" if quantized[0] else "lora") + ("" if upcast else ":dtype")) if lora else recipe
    how += "+copies" if copies else ""
    return ModelState(params, precision, optimizer, sharding, tuple(parts), how)


@lru_cache(maxsize=1024)
def state_bytes(params: int, precision: str, optimizer: str, sharding: StateSharding,
                recipe: str) -> tuple[ModelState, int, int]:  # fmt: skip
    """model_state, and the bytes of it one GPU holds in its own memory and in host memory."""
    state = model_state(params, precision, optimizer, sharding, recipe)
    return state, state.total_bytes, state.host_bytes


def zero3_gather_bytes(layer_params: int, n_layers: int, precision: str, held_elsewhere: int) -> int:
    """ZeRO-3/FSDP working memory: two layers' weights gathered (the one running and the one prefetched)
    and one layer's unsharded gradients before their reduce-scatter (FSDP2 fully_shard prefetches one
    module ahead; DeepSpeed's stage3_prefetch_bucket_size plays the same role).

    Bounded twice, for shallow models: no more layers gathered than the model has, and no more bytes
    than the weights this GPU does not hold itself (held_elsewhere: the other ranks' shards, or every
    weight when they are offloaded). At that bound the whole model is gathered and a GPU holds what
    ZeRO-2 holds, so stage 3 and more GPUs never cost memory. (FSDP would keep its own shard beside
    the gathered copy; memcalc counts the shard once, as a model too shallow to gain from stage 3.)
    """
    w = 4 if precision == "fp32" else 2
    layers = min(2, n_layers) + 1  # weights of the running and prefetched layers, + one layer's gradients
    return min(layers * w * layer_params, held_elsewhere)


def weights_held_elsewhere(state: ModelState) -> int:
    """Bytes of the model's weights (in their training dtype) that are not in this GPU's memory."""
    weights = next((p for p in state.parts if p.name == "weights"), None)
    if weights is None:  # some frozen (memcalc.memory.state.finetune_state): the weights are its stage-3 parts
        held = [p for p in state.parts if p.name in ("frozen weights", "4-bit weights", "adapter weights",
                                                     "trained weights")]  # fmt: skip
        return sum(p.bytes * p.sharded_over - p.bytes for p in held)
    full = (4 if state.precision == "fp32" else 2) * state.params
    return full if weights.on_host else full - weights.bytes
