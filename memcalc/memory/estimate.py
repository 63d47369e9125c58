"""One estimate: model state, activations, logits, FLOPs and time for each trick set, on one GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memcalc.errors import InputError
from memcalc.exact.kernels import step_flops
from memcalc.model.flops import Flops, StepFlops, flops
from memcalc.model.gpus import GPU, GPUS_PER_NODE, HOST_MEMORY_BYTES
from memcalc.model.shape import MAX_BATCH, MAX_SEQ, Model, check_positions, check_size, layer_params
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import PROGRESSION, Tricks

from .activations import Activations, AttentionDetail, Logits, attention_detail, logits_memory, textbook_activations
from .state import ModelState, Parallel, model_state, weights_held_elsewhere, zero3_gather_bytes

# Default MFU: Llama 3 trained at 38-43% BF16 MFU on 16K H100s (Dubey et al. 2024, Table 4);
# Korthikanti et al. 2022 Table 5 reports 41-56% on A100s. 0.4 sits at the low end of both.
DEFAULT_MFU = 0.4
MAX_HOST_BYTES = 10**15  # a petabyte of CPU memory in one node: beyond any machine


@dataclass(frozen=True)
class Setup:
    """What is trained per step, on how many GPUs, and at what assumed utilisation."""

    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    optimizer: str = "adamw"
    parallel: Parallel = Parallel()
    mfu: float = DEFAULT_MFU
    host_memory: int = HOST_MEMORY_BYTES  # CPU memory of one node, which offload fills
    stack: Stack = DEFAULT_STACK  # whose code trains: model, precision recipe, optimizer implementation

    def __post_init__(self) -> None:
        check_size("seq", self.seq_len, limit=MAX_SEQ)
        check_size("host memory", self.host_memory, limit=MAX_HOST_BYTES)
        check_size("micro-batch", self.micro_batch, limit=MAX_BATCH)
        check_size("grad-accum", self.grad_accum, limit=MAX_BATCH)
        if not (isinstance(self.mfu, (int, float)) and math.isfinite(self.mfu) and 0 < self.mfu <= 1):
            raise InputError(f"mfu must be a fraction in (0, 1], got {self.mfu!r}")

    @property
    def host_usable_bytes(self) -> int:
        """One GPU's share of its node's host memory: the job's GPUs on a node split it."""
        return self.host_memory // min(self.parallel.gpus, GPUS_PER_NODE)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        """Tokens one GPU processes per optimizer step (all accumulated micro-batches)."""
        return self.tokens_per_micro_batch * self.grad_accum


class Budget:
    """For results with total_bytes and usable_bytes (the GPU), host_bytes and host_usable_bytes (its share
    of the node's CPU memory, which offload fills): does it fit, and by how much."""

    __slots__ = ()

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        return self.host_bytes <= self.host_usable_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.total_bytes


@dataclass(slots=True)
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

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.activation_peak_bytes + self.logits_bytes + self.buffer_bytes


@dataclass(slots=True)
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


@dataclass(slots=True)
class Estimate:
    model: Model
    setup: Setup
    gpu: GPU
    model_state: ModelState  # of the first 16-bit trick set (the recipe the field trains with)
    flops: Flops
    attention: AttentionDetail
    activations: tuple[Activations, ...]  # one per trick set, in order
    logits: tuple[Logits, ...]
    memory: tuple[Memory, ...]
    compute: tuple[Compute, ...]

    @property
    def trick_sets(self) -> tuple[Tricks, ...]:
        return tuple(a.tricks for a in self.activations)


def memory_for(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> tuple[ModelState, Activations, Logits, Memory]:
    """The memory side of one trick set; shared by estimate(), the toolbox and the fit solver."""
    state = model_state(model.n_params, tricks.precision, setup.optimizer, setup.parallel, setup.stack.recipe)
    acts = textbook_activations(model.shape, setup.seq_len, setup.micro_batch, tricks)
    logits = logits_memory(model.shape, setup.seq_len, setup.micro_batch, tricks.precision)
    buffers = 0
    if setup.parallel.gathers_layers:
        elsewhere = weights_held_elsewhere(state)
        buffers = zero3_gather_bytes(layer_params(model.shape), model.shape.n_layers, tricks.precision, elsewhere)
    memory = Memory(tricks, state.total_bytes, acts.peak_bytes, logits.total_bytes, buffers, gpu.usable_bytes,
                    state.host_bytes, setup.host_usable_bytes)  # fmt: skip
    return state, acts, logits, memory


def compute_for(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> Compute:
    step = step_flops(model.shape, setup.seq_len, tricks)
    return Compute(tricks, step, setup.tokens_per_step, gpu.peak_flops(tricks.precision), setup.mfu)


def estimate(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...] = PROGRESSION) -> Estimate:
    """Everything `memcalc estimate` prints, for each trick set in order."""
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
        compute=tuple(compute_for(model, setup, gpu, t) for t in trick_sets),
    )
