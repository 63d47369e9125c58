"""One estimate: model state, activations, logits, FLOPs and time for each trick set, on one GPU."""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.exact.kernels import recompute_first, step_flops
from memcalc.model.flops import Flops, StepFlops, flops
from memcalc.model.gpus import GPU
from memcalc.model.params import largest_layer_params
from memcalc.model.shape import Model, check_positions
from memcalc.model.tricks import PROGRESSION, Tricks
from memcalc.records import record

from .activations import Activations, AttentionDetail, Logits, attention_detail, logits_memory, textbook_activations
from .setup import DEFAULT_MFU, MAX_HOST_BYTES, Budget, Setup  # noqa: F401  (Setup's home for its users)
from .state import ModelState, model_state, weights_held_elsewhere, zero3_gather_bytes


@record(slots=True)
class Memory(Budget):
    """Peak GPU memory of one trick set: model state + activations at their peak + logits."""

    tricks: Tricks
    model_state_bytes: int
    activation_peak_bytes: int
    logits_bytes: int
    buffer_bytes: int  # ZeRO-3's gathered layers, when it shards over several GPUs
    usable_bytes: int  # the GPU's memory less the CUDA context reserve
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
    model: Model
    setup: Setup
    gpu: GPU
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


def memory_for(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> tuple[ModelState, Activations, Logits, Memory]:
    """The memory side of one trick set; shared by estimate(), the toolbox and the fit solver."""
    state = model_state(model.n_params, tricks.precision, setup.optimizer, setup.parallel, setup.stack.recipe)
    acts = textbook_activations(model.shape, setup.seq_len, setup.micro_batch, tricks, setup.routing)
    logits = logits_memory(model.shape, setup.seq_len, setup.micro_batch, tricks.precision)
    buffers = 0
    if setup.parallel.gathers_layers:
        elsewhere = weights_held_elsewhere(state)
        buffers = zero3_gather_bytes(largest_layer_params(model.shape), model.shape.n_layers, tricks.precision,
                                     elsewhere)  # fmt: skip
    memory = Memory(tricks, state.total_bytes, acts.peak_bytes, logits.total_bytes, buffers, gpu.usable_bytes,
                    state.host_bytes, setup.host_usable_bytes, acts.formula)  # fmt: skip
    return state, acts, logits, memory


def in_order(trick_sets: tuple[Tricks, ...], by_tricks: dict) -> tuple:
    return tuple(by_tricks[t] for t in trick_sets)


def compute_for(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> Compute:
    step = step_flops(model.shape, setup.seq_len, tricks)
    return Compute(tricks, step, setup.tokens_per_step, gpu.peak_flops(tricks.precision), setup.mfu)


def estimate(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...] = PROGRESSION) -> Estimate:
    """The textbook for each trick set in order, on one GPU of setup.parallel's data parallelism: the
    lesson's numbers (the verdict, what the stack really allocates, is memcalc.parallel.verdict's)."""
    if not trick_sets:
        raise InputError("no trick sets to estimate")
    check_positions(model.shape, setup.seq_len)
    sides = [memory_for(model, setup, gpu, t) for t in trick_sets]
    primary = next((s for s, *_ in sides if s.precision != "fp32"), sides[0][0])
    return Estimate(
        model=model,
        setup=setup,
        gpu=gpu,
        model_state=primary,
        flops=flops(model.shape, model.n_params, setup.seq_len),
        attention=attention_detail(model.shape, setup.seq_len, setup.micro_batch),
        activations=tuple(a for _, a, _, _ in sides),
        logits=tuple(lg for _, _, lg, _ in sides),
        memory=tuple(m for *_, m in sides),
        compute=in_order(trick_sets, {t: compute_for(model, setup, gpu, t) for t in recompute_first(trick_sets)}),
    )
