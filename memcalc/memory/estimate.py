"""One estimate: model state, activations, logits, FLOPs and time for each trick set, on one GPU of a
data-parallel layout (the textbook's model state shards as the layout says)."""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.exact.kernels import recompute_first, step_flops
from memcalc.model.finetune import (
    frozen_params,
    quantized_weights,
    saved_params,
    trained_params,
    unpaged_adapter_params,
)
from memcalc.model.flops import Flops, StepFlops, flops
from memcalc.model.gpus import GPU
from memcalc.model.headroom import usable_bytes
from memcalc.model.layout import ONE_GPU, Layout
from memcalc.model.params import largest_layer_params
from memcalc.model.shape import Model, ModelShape, check_positions
from memcalc.model.stacks import bf16_adapters
from memcalc.model.tricks import PROGRESSION, Tricks
from memcalc.records import record
from memcalc.terms import Term

from .activations import (
    Activations,
    AttentionDetail,
    Logits,
    attention_detail,
    layer_terms,
    logits_memory,
    textbook_activations,  # fmt: skip
)
from .setup import DEFAULT_MFU, MAX_HOST_BYTES, Fits, Setup, host_share  # noqa: F401  (Setup's home for its users)
from .state import ModelState, finetune_state, state_bytes, state_sharding, weights_held_elsewhere, zero3_gather_bytes


@record(slots=True)
class Memory(Fits):
    """Peak GPU memory of one trick set: model state + activations at their peak + logits."""

    tricks: Tricks
    model_state_bytes: int
    activation_peak_bytes: int
    logits_bytes: int
    buffer_bytes: int  # ZeRO-3's gathered layers, when it shards over several GPUs
    usable_bytes: int  # the GPU's memory less the headroom (memcalc.model.headroom)
    host_bytes: int  # model state offloaded to CPU memory, one GPU's part
    host_usable_bytes: int  # one GPU's share of the node's CPU memory
    formula: bool = True  # False: the textbook has no formula for these activations (sac): not a verdict

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.activation_peak_bytes + self.logits_bytes + self.buffer_bytes


@record(slots=True)
class Compute:
    """Step time when the GPU sustains `utilization` of its peak on the FLOPs it executes.

    Without recompute that fraction is the MFU; recompute adds hardware FLOPs, so the step takes
    longer and MFU (model FLOPs / time / peak) falls below HFU (hardware FLOPs / time / peak).
    """

    tricks: Tricks
    flops: StepFlops
    tokens_per_step: int
    peak_flops: float  # dense peak of the GPU for this precision
    utilization: float  # --mfu: the fraction of peak sustained on executed FLOPs

    @property
    def step_seconds(self) -> float:
        return self.tokens_per_step * self.flops.hardware_per_token / (self.utilization * self.peak_flops)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def mfu(self) -> float:
        return self.utilization * self.flops.model_per_token / self.flops.hardware_per_token

    @property
    def hfu(self) -> float:
        return self.utilization


@record(slots=True)
class Estimate:
    """The textbook's numbers of one job, one entry per trick set in each tuple, in order."""

    model: Model
    setup: Setup
    gpu: GPU
    layout: Layout  # data parallelism alone: dp, ZeRO, offload (memcalc.model.layout)
    model_state: ModelState  # of the first 16-bit trick set (the recipe the field trains with)
    flops: Flops
    attention: AttentionDetail
    activations: tuple[Activations, ...]  # one per trick set, in order
    logits: tuple[Logits, ...]
    memory: tuple[Memory, ...]  # the textbook's: the lesson's reference
    compute: tuple[Compute, ...]  # time at setup.mfu of the peak (the lesson's model; the roofline is memcalc.time's)

    @property
    def trick_sets(self) -> tuple[Tricks, ...]:
        return tuple(a.tricks for a in self.activations)


def memory_for(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout = ONE_GPU,
               layer: dict[str, Term] | None = None, logits: Logits | None = None,
               ) -> tuple[ModelState, Activations, Logits, Memory]:  # fmt: skip
    """The memory side of one trick set on one GPU of a data-parallel layout (layer: its layer_terms, logits: its
    logits_memory, where the caller has them from a trick set of the same activation width)."""
    shape, seq, batch, sharding = model.shape, setup.seq_len, setup.micro_batch, state_sharding(layout)
    state, held, host = state_for(model.shape, model.n_params, setup, tricks.precision, layout)
    acts = textbook_activations(shape, seq, batch, tricks, setup.routing, layer)
    logits = logits or logits_memory(shape, seq, batch, tricks.precision)
    buffers = 0
    if sharding.gathers_layers:
        elsewhere = weights_held_elsewhere(state)
        buffers = zero3_gather_bytes(largest_layer_params(shape), shape.n_layers, tricks.precision, elsewhere)
    usable = usable_bytes(gpu, layout.groups)
    memory = Memory(tricks, held, acts.peak_bytes, logits.total_bytes, buffers, usable, host,
                    host_share(setup, layout), acts.formula)  # fmt: skip
    return state, acts, logits, memory


def state_for(shape: ModelShape, params: int, setup: Setup, precision: str,
              layout: Layout = ONE_GPU) -> tuple[ModelState, int, int]:  # fmt: skip
    """The textbook's model state of `params` parameters, and what of it is on the GPU and on the host: every
    weight trained, or some frozen (LoRA, --freeze: memcalc.memory.state.finetune_state, on the GPU but for a
    paged optimizer's state, in unified memory)."""
    ft, recipe = setup.stack.finetune, setup.stack.recipe
    if ft.trains_all:
        return state_bytes(params, precision, setup.optimizer, state_sharding(layout), recipe)
    frozen_dtype = precision if ft.lora or not (precision == "fp32" or recipe == "autocast") else "fp32"
    quantized = quantized_weights(shape) if ft.quantize else (0, 0)
    frozen = frozen_params(shape, ft) - quantized[0]
    unpaged = unpaged_adapter_params(shape, ft) if setup.optimizer.startswith("paged-") else 0
    state = finetune_state(params, frozen, trained_params(shape, ft), frozen_dtype, precision, setup.optimizer,
                           recipe, ft.lora, quantized, state_sharding(layout),
                           setup.stack.model != "torchtune" and not bf16_adapters(setup.stack), unpaged,
                           saved_params(shape, ft))  # torchtune's adapters in its dtype, TRL's bf16  # fmt: skip
    return state, state.total_bytes, state.host_bytes


def memory_sides(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...],
                 layout: Layout = ONE_GPU) -> list[tuple]:  # fmt: skip
    """memory_for of each trick set in one pass: Korthikanti's layer terms (per sequence, micro-batch and
    activation width: fp32's twice 16-bit's) and the logits (per precision) made once for the trick sets
    that share them, not once per trick set."""
    if len(trick_sets) == 1:
        return [memory_for(model, setup, gpu, trick_sets[0], layout)]
    shape, seq, batch = model.shape, setup.seq_len, setup.micro_batch
    layers: dict[int, dict[str, Term]] = {}
    logits: dict[str, Logits] = {}
    sides = []
    for t in trick_sets:
        width = 2 if t.precision == "fp32" else 1
        if width not in layers:
            layers[width] = layer_terms(shape, seq, batch, width)
        if t.precision not in logits:
            logits[t.precision] = logits_memory(shape, seq, batch, t.precision)
        sides.append(memory_for(model, setup, gpu, t, layout, layers[width], logits[t.precision]))
    return sides


def compute_for(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> Compute:
    step = step_flops(model.shape, setup.seq_len, tricks)
    return Compute(tricks, step, setup.tokens_per_step, gpu.peak_flops(tricks.precision), setup.mfu)


def computes(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...]) -> tuple[Compute, ...]:
    """compute_for of each trick set in order, asked in recompute_first's order (a plain step reuses the
    trace of its step with recompute)."""
    if len(trick_sets) == 1:
        return (compute_for(model, setup, gpu, trick_sets[0]),)
    by_tricks = {t: compute_for(model, setup, gpu, t) for t in recompute_first(trick_sets)}
    return tuple(by_tricks[t] for t in trick_sets)


def estimate(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...] = PROGRESSION,
             layout: Layout = ONE_GPU) -> Estimate:  # fmt: skip
    """The textbook for each trick set in order, on one GPU of the layout's data parallelism (dp, ZeRO,
    offload): the lesson's numbers (the verdict, what the stack really allocates, is memcalc.parallel.verdict's)."""
    if not trick_sets:
        raise InputError("no trick sets to estimate")
    check_positions(model.shape, setup.seq_len)
    states, activations, logits, memory = zip(*memory_sides(model, setup, gpu, trick_sets, layout))
    return Estimate(
        model=model,
        setup=setup,
        gpu=gpu,
        layout=layout,
        model_state=next((state for state in states if state.precision != "fp32"), states[0]),
        flops=flops(model.shape, model.n_params, setup.seq_len),
        attention=attention_detail(model.shape, setup.seq_len, setup.micro_batch),
        activations=activations,
        logits=logits,
        memory=memory,
        compute=computes(model, setup, gpu, trick_sets),
    )
