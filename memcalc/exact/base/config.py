"""What decides the bytes of a simulated training step (StepConfig), and the bytes it comes to (Phases)."""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "bool": 1, "uint8": 1, "int8": 1, "int64": 8, "uint64": 8, "int32": 4, "fp64": 8,
            "fp8-e4m3": 1, "fp8-e5m2": 1}  # bytes of one element of each dtype the step holds


# What the simulator replays (memcalc.model.stacks' choices); anything else it refuses, never guesses.
SIMULATED = {"model": ("reference", "hf", "torchtune"), "recipe": ("master", "pure", "autocast"), "impl": ("reference", "loop", "foreach", "fused"),
             "optimizer": ("adamw", "sgd", "adam8bit", "paged-adam8bit", "paged-adamw")}  # fmt: skip


SGD_IMPLS = ("loop", "foreach")  # torch 2.13 has no meta kernel for aten::_fused_sgd_: not measured, not replayed


def not_replayed(model: str, recipe: str, impl: str, optimizer: str, precision: str) -> str | None:
    """Why the simulator cannot replay this step, or None when it can (fp32 trains alike in every recipe)."""
    for what, value in (("model", model), ("recipe", recipe), ("impl", impl), ("optimizer", optimizer)):
        if value not in SIMULATED[what] and not (what == "recipe" and precision == "fp32"):
            return f"the exact model does not replay {what} {value!r} yet; it replays {', '.join(SIMULATED[what])}"
    return untrainable(precision, recipe, impl, optimizer)


def untrainable(precision: str, recipe: str, impl: str, optimizer: str) -> str | None:
    """Why this optimizer does not train with this recipe and implementation, or None (verify/recipes.py
    check_recipe asks the same): the reference implementation is AdamW, over fp32 weights or an fp32
    master; the libraries' optimizers update the model's own weights, so a 16-bit master recipe keeps
    the reference."""
    sixteen = precision != "fp32"
    if impl == "reference" and optimizer != "adamw":
        return f"the reference implementation trains AdamW; --optimizer {optimizer} runs with --optimizer-impl loop or foreach"
    if impl == "reference" and sixteen and recipe == "pure":
        return "the pure recipe trains with torch.optim: --optimizer-impl loop, foreach or fused"
    if impl != "reference" and sixteen and recipe == "master":
        return ("the master recipe (fp32 master weights) runs with its reference implementation only: "
                "--optimizer-impl reference, or --recipe pure")  # fmt: skip
    if optimizer == "sgd" and impl not in SGD_IMPLS + ("reference",):
        return (f"SGD runs with --optimizer-impl {' or '.join(SGD_IMPLS)} here: torch 2.13 has no meta kernel for "
                "aten::_fused_sgd_, so fused SGD cannot be measured")  # fmt: skip
    return None


def shape_not_replayed(shape: ModelShape, model: str = "reference", recipe: str = "master",
                       impl: str = "reference") -> str | None:  # fmt: skip
    """Why the simulator cannot build this shape yet, or None when it can: verify/builder.py builds one
    multi-token prediction module, not more; mixture-of-experts, latent-attention and MTP blocks are
    replayed for the reference stack (its model, master recipe and AdamW), not under autocast, the
    libraries' optimizers or Transformers' classes."""
    if shape.mtp_layers > 1:
        return "the exact model replays one multi-token prediction module, not more"
    wired = wiring_not_built(shape)
    if model == "reference" and wired:
        return f"memcalc's reference layer does not build {wired} yet (--stack hf replays Transformers' classes)"
    if (shape.n_experts or shape.is_mla or shape.mtp_layers) and (model, recipe, impl) != ("reference", "master",
                                                                                          "reference"):  # fmt: skip
        return ("the exact model replays a mixture of experts, latent attention and MTP on the reference stack "
                "only (--stack reference)")  # fmt: skip
    return None


def window_not_built(shape: ModelShape, seq_len: int, model: str = "reference") -> str | None:
    """Why memcalc's reference layer cannot give the verdict for a sliding window shorter than the sequence
    (it attends every key, as without one), or None: the hf stack replays Transformers' masks. (The step's
    kernels are still traced on it for the time: causal flash over every key.)"""
    window = min((shape.window_at(i) for i in range(shape.n_layers) if shape.window_at(i)), default=0)
    if model != "reference" or not window or seq_len <= window:
        return None
    return (f"memcalc's reference layer attends every key, and {shape.name or 'the model'}'s sliding window of "
            f"{window:,} is shorter than seq {seq_len:,} (--stack hf replays Transformers' mask)")


def wiring_not_built(shape: ModelShape) -> str:
    """The Transformers families' wiring memcalc's reference layer (verify/builder.py) does not build: '' when
    it builds every part of the shape."""
    parts = [{"sandwich": "sandwich norms", "post": "post-norms"}.get(shape.norm_layout, ""),
             "q/k norms over the projections" if shape.qk_norm and shape.qk_norm_over == "all" else "",
             "a parallel residual" if shape.parallel_residual else "",
             "partial rotary positions" if shape.rotary_fraction < 1 else "",
             "softcapping" if shape.attn_softcap or shape.logit_softcap else ""]  # fmt: skip
    return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class StepConfig:
    """What decides the bytes of a training step: the model, the tokens, the trick set it runs, and whose code
    runs it (the stack: its model's op sequence, 16-bit recipe, optimizer implementation, cache, fine-tuning)."""

    shape: ModelShape
    seq_len: int
    micro_batch: int
    tricks: Tricks  # precision, flash, recompute (ckpt:N), fp8, compile (memcalc.model.tricks)
    stack: Stack = DEFAULT_STACK  # whose code (memcalc.model.stacks): model, recipe, impl, use_cache, finetune
    optimizer: str = "adamw"  # adamw | sgd | adam8bit | paged-adam8bit | paged-adamw (bitsandbytes')
    grad_accum: int = 1  # micro-batches per optimizer step
    # whose kernels and autocast lists: cuda (the prediction), or cpu to hold the simulator against a
    # measurement on CPU tensors (verify/autocast.py): CPU's flash kernel saves no RNG state
    device: str = "cuda"
    # the step as verify's TorchDispatchMode measures it on meta or CPU tensors (verify/track.py), where CUDA's
    # allocator differs from it: autograd's index_backward out of place, and an op's own temporaries unseen
    # (memcalc.exact.hf.fused_head); False: CUDA's
    watched: bool = False
    # a layer's experts of one token count simulated once for all (memcalc.exact.sim.tensors.Region); False
    # replays each, as a timeline (which records every allocation) and the test of the two need
    collapse: bool = True

    # The trick set's and the stack's choices, as the simulator reads them.
    precision = property(lambda self: self.tricks.precision)  # fp32 | bf16 | fp16
    flash = property(lambda self: self.tricks.flash)  # attention by the flash kernel
    recompute = property(lambda self: self.tricks.recompute)  # none | selective | full | op
    ckpt_every = property(lambda self: self.tricks.ckpt_every)  # with full: every Nth block checkpointed
    fp8 = property(lambda self: self.tricks.fp8)  # the blocks' linears in fp8 (memcalc.exact.aten.float8, te)
    compile = property(lambda self: self.tricks.compile)  # Inductor's fused kernels (memcalc.exact.replay.inductor)
    model = property(lambda self: self.stack.model)  # whose op sequence: reference | hf
    recipe = property(lambda self: self.stack.recipe)  # how a 16-bit precision trains: master | autocast | pure
    impl = property(lambda self: self.stack.impl)  # the optimizer's implementation: reference | loop | foreach | fused
    use_cache = property(lambda self: self.stack.use_cache)  # hf: Transformers' DynamicCache kept in forward
    finetune = property(lambda self: self.stack.finetune)  # which weights train (memcalc.exact.hf.lora)

    @property
    def dtype(self) -> str:
        """The parameters' and activations' dtype: the precision's name is the sim's dtype name."""
        return self.precision

    @property
    def weights_dtype(self) -> str:
        """The parameters' dtype: fp32 under autocast (torch.autocast casts them per op), else the
        precision's."""
        return "fp32" if self.recipe == "autocast" else self.precision

@dataclass(frozen=True)
class Phases:
    """Bytes of one steady-state training step (the second), as verify measures them. Peaks are
    of everything live on the device: weights, buffers, inputs, optimizer state, activations; with
    gradient accumulation, forward and backward are its last micro-batch's (grads already exist)."""

    weights_bytes: int  # parameters and buffers, after build
    inputs_bytes: int  # token ids and targets
    state_bytes: int  # live between steps, less the inputs: weights, buffers, master, m, v (+ scaler)
    retained_bytes: int  # what forward leaves alive: saved tensors (and checkpoint inputs) and the loss
    grads_bytes: int  # what backward leaves alive above the state (the loss released): the gradients
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    forward_peak_at: str  # the op at which the peak was reached
    backward_peak_at: str
    optimizer_peak_at: str
    offloaded_bytes: int = 0  # one micro-batch's saved tensors copied to pinned host memory (memcalc.exact.sim.offload)
    reloaded_bytes: int = 0  # ... copied back to the GPU in backward
    load_bytes: int = 0  # held as the model loads, before the engine shards it; 0 where it loads sharded (see zero.py)

    @property
    def step_peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)

    @property
    def run_peak_bytes(self) -> int:
        """The run's peak on this GPU: the step's, or the model's load where that holds more."""
        return max(self.step_peak_bytes, self.load_bytes)
