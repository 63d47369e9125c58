"""Step time from the hardware: each kernel of the step against the GPU's two roofs.

For every kernel of a training step (memcalc.exact.replay.meta.trace: the same per-op inventory the exact
memory model replays, forward, backward, checkpoint recompute, gradient accumulation, the optimizer
and the bf16<->fp32 copies), its time on one GPU is

    t = max(FLOPs / (efficiency · peak), bytes / (bandwidth efficiency · HBM bandwidth), launch floor)

(Williams et al. 2009, the roofline model), with matmuls at the tensor-core peak of their dtype (fp32:
the CUDA-core peak, TF32 off), the flash kernel at its own efficiency, and elementwise kernels at
the FP32 CUDA-core peak (ATen computes bf16/fp16 elementwise in float: at::opmath_type). Kernels run
one after another on one stream, as eager PyTorch runs them: the step is their sum.

One layer is traced and multiplied: every block runs the same kernels (tests/test_roofline.py checks
it against full-depth traces), so a step costs one one-layer simulation, ~1-3 ms. One GPU of a parallel
layout runs the same kernels on the shapes it holds: memcalc.time.stages times them by where they sit.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.exact.base.config import ITEMSIZE, shape_not_replayed
from memcalc.exact.base.kernel import STEP_PHASES, Kernel
from memcalc.exact.kernels import block_weight, kernels_of, recompute_first
from memcalc.model.finetune import FULL, Finetune
from memcalc.model.flops import model_flops
from memcalc.errors import InputError
from memcalc.model.gpus import GPU, roofline_gaps
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks

from .calibration import ANCHOR_DIM, Calibration

# Parts of the step, in the order the breakdown prints them.
PARTS = (
    "layer matmuls", "expert matmuls", "router", "dispatch and combine", "attention core", "norms",
    "other elementwise", "logits matmul", "logits and loss", "embedding", "recompute (checkpointing)",
    "gradient accumulation", "optimizer (AdamW)", "fp32 master copies",
)  # fmt: skip


MOE_SCOPES = {"router": "router", "dispatch": "dispatch and combine", "combine": "dispatch and combine",
              "routing tables": "dispatch and combine"}  # a mixture of experts' parts besides its experts' matmuls


def part_of(k: Kernel) -> str:
    """Which part of the step a kernel is charged to."""
    if k.phase == "recompute":
        return "recompute (checkpointing)"
    if k.phase == "accumulate":
        return "gradient accumulation"
    if k.phase == "optimizer":
        return "fp32 master copies" if k.op in ("_to_copy", "copy_") else "optimizer (AdamW)"
    if k.scope == "attention core":
        return "attention core"
    if k.scope in MOE_SCOPES:
        return MOE_SCOPES[k.scope]
    if k.scope == "experts" and k.unit == "tensor":
        return "expert matmuls"  # each routed expert's GEMMs on its T·k/E tokens
    if k.unit == "tensor":
        return "logits matmul" if k.count_kind == "logits" else "layer matmuls"
    if k.scope in ("logits", "loss"):
        return "logits and loss"
    if k.scope in ("norm1", "norm2", "final norm"):
        return "norms"
    if k.scope in ("embedding", "rope tables"):
        return "embedding"
    return "other elementwise"  # q/k norms, RoPE, activations, residual adds, dropout, layout copies, grad sums


def flop_rate(unit: str, dtype: str, gpu: GPU, cal: Calibration) -> float:
    """FLOP/s a kernel of this unit and dtype can reach on this GPU (a matmul: at the measured 8192³ size)."""
    if unit == "tensor":
        return gpu.peak_flops(dtype) * cal.matmul  # tensor-core peak of its dtype (fp32: CUDA cores)
    if unit == "flash":
        return gpu.peak_flops(dtype) * cal.flash
    if not gpu.fp32_tflops:
        check_roofline(gpu)
    return gpu.fp32_tflops * 1e12 * cal.vector  # ATen's elementwise math runs in fp32 (at::opmath_type)


def matmul_dim(flops: int, moved: int, dtype: str) -> float:
    """The harmonic mean of an m×k by k×n matmul's dimensions, 3 / (1/m + 1/n + 1/k), from what it does:
    2mnk FLOPs over the mk + kn + mn elements it reads and writes is 2 / (1/m + 1/n + 1/k)."""
    return 1.5 * flops * ITEMSIZE[dtype] / moved if moved else float(ANCHOR_DIM)


def kernel_rate(k: Kernel, gpu: GPU, cal: Calibration) -> float:
    """flop_rate, and for a matmul its share at its own size (Calibration.matmul_share)."""
    if k.unit != "tensor" or not cal.matmul_dim:
        return flop_rate(k.unit, k.dtype, gpu, cal)
    return gpu.peak_flops(k.dtype) * cal.matmul_share(matmul_dim(k.flops, k.read_bytes + k.write_bytes, k.dtype))


def byte_rate(gpu: GPU, cal: Calibration) -> float:
    if not gpu.bandwidth_gbps:
        check_roofline(gpu)
    return gpu.bandwidth_gbps * 1e9 * cal.bandwidth


def check_roofline(gpu: GPU) -> None:
    """A card whose --gpu file leaves out a rate the roofline needs is timed end to end (--mfu) instead."""
    gaps = roofline_gaps(gpu)
    if gaps:
        raise InputError(f"the roofline needs the {gpu.key}'s {' and '.join(gaps)}, which its --gpu file does not "
                         "give: add them to the file, or time the step with --mfu X")  # fmt: skip


def kernel_seconds(k: Kernel, gpu: GPU, cal: Calibration) -> tuple[float, float, float]:
    """(compute time, memory time, floor): the kernel takes the largest (Williams et al. 2009)."""
    return (k.flops / kernel_rate(k, gpu, cal), (k.read_bytes + k.write_bytes) / byte_rate(gpu, cal),
            cal.launch_seconds)  # fmt: skip


@dataclass(slots=True)
class OpTime:
    """One op of the step in one part and phase: its kernels summed over layers and micro-batches."""

    part: str
    scope: str
    phase: str
    op: str
    unit: str
    calls: int
    flops: int  # executed
    bytes: int  # read + written in HBM
    compute_seconds: float  # time of its kernels that are compute-bound
    memory_seconds: float  # ... memory-bound
    launch_seconds: float  # ... at the launch floor

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.memory_seconds + self.launch_seconds

    @property
    def bound(self) -> str:
        """What most of its time is bound by: compute, memory or launch."""
        split = {"compute": self.compute_seconds, "memory": self.memory_seconds, "launch": self.launch_seconds}
        return max(split, key=split.get)

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (the roofline's x-axis)."""
        return self.flops / self.bytes if self.bytes else float("inf")

    @property
    def name(self) -> str:
        op = self.op.replace("_scaled_dot_product_", "")  # flash_attention(_backward)
        return f"{self.phase}: {self.scope + ' ' if self.scope else ''}{op}"


@dataclass(slots=True)
class Roofline:
    """Predicted time of one optimizer step of one trick set on one GPU, op by op."""

    tricks: Tricks
    gpu: str
    calibration: str  # where the efficiencies came from
    tokens_per_step: int
    peak_flops: float  # dense peak of the precision, for MFU and HFU
    model_flops: int  # per step: 6·W·tokens + 12·L·a·d·s·tokens (PaLM App. B), non-causal
    model_flops_causal: int  # attention halved (Megatron)
    counted_flops: int  # per step, as FlopCounterMode counts: matmuls, recompute and flash's backward QKᵀ
    counted_flops_causal: int  # the same with every attention matmul halved
    kernels: int  # kernels launched per step
    ops: tuple[OpTime, ...]  # the slowest first

    @property
    def step_seconds(self) -> float:
        return sum(op.seconds for op in self.ops)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_seconds / self.peak_flops

    @property
    def mfu_causal(self) -> float:
        return self.model_flops_causal / self.step_seconds / self.peak_flops

    @property
    def hfu(self) -> float:
        return self.counted_flops / self.step_seconds / self.peak_flops

    @property
    def hfu_causal(self) -> float:
        return self.counted_flops_causal / self.step_seconds / self.peak_flops

    @property
    def recompute_seconds(self) -> float:
        """What checkpointing adds: the recompute kernels (every other kernel runs either way)."""
        return sum(op.seconds for op in self.ops if op.phase == "recompute")

    @property
    def memory_bound_seconds(self) -> float:
        return sum(op.memory_seconds for op in self.ops)

    @property
    def compute_bound_seconds(self) -> float:
        return sum(op.compute_seconds for op in self.ops)

    @property
    def parts(self) -> dict[str, tuple[float, str]]:
        """Per part of the step, in PARTS order (those it has): its seconds and what bounds most of
        them (compute, memory or launch)."""
        split: dict[str, list[float]] = {}
        for op in self.ops:
            s = split.setdefault(op.part, [0.0, 0.0, 0.0])
            s[0] += op.compute_seconds
            s[1] += op.memory_seconds
            s[2] += op.launch_seconds
        return {p: (sum(split[p]), ("compute", "memory", "launch")[split[p].index(max(split[p]))])
                for p in PARTS if p in split}  # fmt: skip


def repeats(k: Kernel, n_layers: int, grad_accum: int, tricks: Tricks, shape: ModelShape | None = None,
            finetune: Finetune = FULL) -> int:  # fmt: skip
    """How often a traced kernel runs in the step: per block like its own (memcalc.exact.kernels.block_weight:
    of its kind, dense or MoE, with a shape), per micro-batch (accumulation adds into the gradients from the
    second micro-batch on; the optimizer runs once)."""
    per_step = grad_accum if k.phase in STEP_PHASES else grad_accum - 1 if k.phase == "accumulate" else 1
    return per_step * block_weight(k, n_layers, tricks, shape, finetune)


def roofline(shape: ModelShape, seq_len: int, micro_batch: int, grad_accum: int, tricks: Tricks, gpu: GPU,
              cal: Calibration, stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> Roofline:  # fmt: skip
    """The roofline time of one optimizer step of the shape as built (its own parameters), trained as the
    stack trains it (memcalc.exact.kernels.kernels_of: its model, autocast's casts, its optimizer)."""
    rates: dict[tuple[str, str], float] = {}
    bandwidth, floor = byte_rate(gpu, cal), cal.launch_seconds
    groups: dict[tuple, list] = {}
    counted = attention = kernels = 0
    for k in kernels_of(shape, seq_len, micro_batch, tricks, stack, optimizer):
        n = repeats(k, shape.n_layers, grad_accum, tricks, shape, stack.finetune) * k.count
        if n == 0:
            continue
        moved = k.read_bytes + k.write_bytes
        if k.unit == "tensor" and cal.matmul_dim:
            rate = kernel_rate(k, gpu, cal)
        else:
            rate = rates.get((k.unit, k.dtype)) or rates.setdefault((k.unit, k.dtype), flop_rate(k.unit, k.dtype, gpu, cal))
        compute, memory = k.flops / rate, moved / bandwidth
        kernels += n
        counted += n * k.counted
        if k.count_kind == "attention":
            attention += n * k.counted
        g = groups.get((k.scope, k.phase, k.op, k.unit))
        if g is None:
            g = groups[(k.scope, k.phase, k.op, k.unit)] = [part_of(k), 0, 0, 0, 0.0, 0.0, 0.0]
        g[1] += n
        g[2] += n * k.flops
        g[3] += n * moved
        if compute >= memory and compute >= floor:
            g[4] += n * compute
        elif memory >= floor:
            g[5] += n * memory
        else:
            g[6] += n * floor
    ops = [OpTime(g[0], *key, *g[1:]) for key, g in groups.items()]
    ops.sort(key=lambda op: -op.seconds)
    tokens = seq_len * micro_batch
    model, model_causal = model_flops(shape, seq_len, tokens)
    label = cal.origin if cal.origin == "memcalc defaults" else cal.origin.rsplit("/", 1)[-1]
    return Roofline(tricks, gpu.key, label, tokens * grad_accum, gpu.peak_flops(tricks.precision),
                    model * grad_accum, model_causal * grad_accum, counted, counted - attention // 2, kernels,
                    tuple(ops))  # fmt: skip


def traceable(shape: ModelShape) -> bool:
    """Whether the step's kernels can be traced (memcalc.exact builds the shape); else time it by --mfu."""
    return not shape_not_replayed(shape)


def rooflines(model, setup, gpu: GPU, trick_sets: tuple[Tricks, ...], cal: Calibration) -> tuple[Roofline, ...]:
    """roofline for a memcalc Model and an estimate Setup, one per trick set (those with recompute
    first, so that the plain ones reuse their traces)."""
    s, times = setup, {}
    for t in recompute_first(trick_sets):
        times[t] = roofline(model.shape, s.seq_len, s.micro_batch, s.grad_accum, t, gpu, cal, s.stack, s.optimizer)
    return tuple(times[t] for t in trick_sets)
