"""Step time from the hardware: each kernel of the step against the GPU's two roofs.

For every kernel of a training step (memcalc.exact.mirror.trace: the same per-op inventory the exact
memory model replays, forward, backward, checkpoint recompute, gradient accumulation, the optimizer
and the bf16<->fp32 copies), its time on one GPU is

    t = max(FLOPs / (efficiency · peak), bytes / (bandwidth efficiency · HBM bandwidth), launch floor)

(Williams et al. 2009, the roofline model), with matmuls at the tensor-core peak of their dtype (fp32:
the CUDA-core peak, TF32 off), the flash kernel at its own efficiency, and elementwise kernels at
the FP32 CUDA-core peak (ATen computes bf16/fp16 elementwise in float: at::opmath_type). Kernels run
one after another on one stream, as eager PyTorch runs them: the step is their sum.

One layer is traced and multiplied: every block runs the same kernels (tests/test_roofline.py checks
it against full-depth traces), so a step costs one one-layer simulation, ~1-3 ms.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from functools import lru_cache

from memcalc.exact.config import shape_not_replayed
from memcalc.exact.kernels import STEP_PHASES, Kernel, block_weight, kernels_of, recompute_first, traced_blocks
from memcalc.model.flops import model_flops
from memcalc.model.gpus import GPU
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks

from .calibration import Calibration

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
    """FLOP/s a kernel of this unit and dtype can reach on this GPU."""
    if unit == "tensor":
        return gpu.peak_flops(dtype) * cal.matmul  # tensor-core peak of its dtype (fp32: CUDA cores)
    if unit == "flash":
        return gpu.peak_flops(dtype) * cal.flash
    return gpu.fp32_tflops * 1e12 * cal.vector  # ATen's elementwise math runs in fp32 (at::opmath_type)


def byte_rate(gpu: GPU, cal: Calibration) -> float:
    return gpu.bandwidth_gbps * 1e9 * cal.bandwidth


def kernel_seconds(k: Kernel, gpu: GPU, cal: Calibration) -> tuple[float, float, float]:
    """(compute time, memory time, floor): the kernel takes the largest (Williams et al. 2009)."""
    return (k.flops / flop_rate(k.unit, k.dtype, gpu, cal), (k.read_bytes + k.write_bytes) / byte_rate(gpu, cal),
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
class StepTime:
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


def repeats(k: Kernel, n_layers: int, grad_accum: int, tricks: Tricks, shape: ModelShape | None = None) -> int:
    """How often a traced kernel runs in the step: per block like its own (memcalc.exact.kernels.block_weight:
    of its kind, dense or MoE, with a shape), per micro-batch (accumulation adds into the gradients from the
    second micro-batch on; the optimizer runs once)."""
    per_step = grad_accum if k.phase in STEP_PHASES else grad_accum - 1 if k.phase == "accumulate" else 1
    return per_step * block_weight(k, n_layers, tricks, shape)


def step_time(shape: ModelShape, seq_len: int, micro_batch: int, grad_accum: int, tricks: Tricks, gpu: GPU,
              cal: Calibration, stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> StepTime:  # fmt: skip
    """The roofline time of one optimizer step of the shape as built (its own parameters), trained as the
    stack trains it (memcalc.exact.kernels.kernels_of: its model, autocast's casts, its optimizer)."""
    rates: dict[tuple[str, str], float] = {}
    bandwidth, floor = byte_rate(gpu, cal), cal.launch_seconds
    groups: dict[tuple, list] = {}
    counted = attention = kernels = 0
    for k in kernels_of(shape, seq_len, micro_batch, tricks, stack, optimizer):
        n = repeats(k, shape.n_layers, grad_accum, tricks, shape)
        if n == 0:
            continue
        rate = rates.get((k.unit, k.dtype)) or rates.setdefault((k.unit, k.dtype), flop_rate(k.unit, k.dtype, gpu, cal))
        moved = k.read_bytes + k.write_bytes
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
    return StepTime(tricks, gpu.key, label, tokens * grad_accum, gpu.peak_flops(tricks.precision),
                    model * grad_accum, model_causal * grad_accum, counted, counted - attention // 2, kernels,
                    tuple(ops))  # fmt: skip


def traceable(shape: ModelShape) -> bool:
    """Whether the step's kernels can be traced (memcalc.exact builds the shape); else time it by --mfu."""
    return not shape_not_replayed(shape)


def step_times(model, setup, gpu: GPU, trick_sets: tuple[Tricks, ...], cal: Calibration) -> tuple[StepTime, ...]:
    """step_time for a memcalc Model and an estimate Setup, one per trick set (those with recompute
    first, so that the plain ones reuse their traces)."""
    s, times = setup, {}
    for t in recompute_first(trick_sets):
        times[t] = step_time(model.shape, s.seq_len, s.micro_batch, s.grad_accum, t, gpu, cal, s.stack, s.optimizer)
    return tuple(times[t] for t in trick_sets)


# ---- one GPU of a layout: the same kernels, on the shapes that GPU holds -----------------------------

SEQUENCE_SPLIT = ("norm1", "norm2", "attention dropout", "mlp dropout", "")  # outside TP's column/row pairs


@dataclass(frozen=True, slots=True)
class StageKernels:
    """Roofline seconds of one GPU's kernels for one micro-batch, by where they sit, from one traced block
    of the shape that GPU holds (memcalc.parallel.comm composes pipeline stages from them).

    Per block: forward, backward, recompute and the attention core within them (ring attention's window);
    accumulate: one block's gradient accumulation, run from the second micro-batch on. first: the embedding
    (and rotary tables), on the first stage; last: the final norm, logits and loss, on the last stage.
    optimizer_block, optimizer_rest: the optimizer step over one block's parameters and the rest, once per step.
    """

    block_forward: float
    block_backward: float
    block_recompute: float
    block_attention: float
    block_accumulate: float
    first_forward: float
    first_backward: float
    last_forward: float
    last_backward: float
    last_recompute: float  # a module after the blocks rebuilt in backward (DeepSeek-V3's MTP block)
    last_accumulate: float
    optimizer_block: float
    optimizer_rest: float


@lru_cache(maxsize=1024)
def kernel_table(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU,
                 cal: Calibration) -> dict[str, tuple[tuple[float, ...], ...]]:  # fmt: skip
    """Each part of a stage (see StageKernels; 'block_sequence', 'block_core', 'last_core' and
    'last_sequence' hold the kernels SP and ring attention rescale), as its kernels' larger of compute and memory time, sorted, with
    prefix sums of weight · time and of weight: a kernel doing x times its work takes max(x·a, launch floor),
    and the sum over a part is then one bisection (scaled_sum). A block kernel's weight is the share of the
    model's blocks that run it (memcalc.exact.kernels.block_weight / L): 1, or with dense and MoE blocks
    traced apart, that kind's share, so that a block part is the average block."""
    parts: dict[str, list[tuple[float, float]]] = {}
    if tricks.recompute == "none":  # traced once with full recompute, the plain step is that less its recompute
        kernels_of(shape, seq_len, micro_batch, replace(tricks, recompute="full"))
    shares = block_shares(shape, tricks)
    for k, n in collapsed(shape, seq_len, micro_batch, tricks):
        if routed(k):
            continue  # timed per layout by moe_kernels
        compute, memory, _ = kernel_seconds(k, gpu, cal)
        parts.setdefault(part_key(k), []).append((max(compute, memory), n * shares.get(k.layer, 1.0)))
    table = {}
    for key, pairs in parts.items():
        pairs.sort()
        weighted, weights = [0.0], [0.0]
        for v, w in pairs:
            weighted.append(weighted[-1] + w * v)
            weights.append(weights[-1] + w)
        table[key] = (tuple(v for v, _ in pairs), tuple(weighted), tuple(weights))
    return table


def block_shares(shape: ModelShape, tricks: Tricks) -> dict[int, float]:
    """The share of the model's blocks each traced block stands for (memcalc.exact.kernels.block_weight /
    L): 1 for every block when all are alike; with dense and MoE blocks traced apart, its kind's."""
    if not shape.n_experts:
        return {}
    return {t: n / shape.n_layers for t, n in traced_blocks(shape, tricks)[1].items()}


@lru_cache(maxsize=256)
def collapsed(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks) -> tuple[tuple[Kernel, int], ...]:
    """The step's kernels with the equal ones of a block counted once (every routed expert runs the same)."""
    if not shape.n_experts:  # a dense block repeats few kernels: not worth the keys
        return tuple((k, 1) for k in kernels_of(shape, seq_len, micro_batch, tricks))
    seen: dict[tuple, list] = {}
    for k in kernels_of(shape, seq_len, micro_batch, tricks):
        key = (k.key(), k.layer)
        entry = seen.get(key)
        if entry is None:
            seen[key] = [k, 1]
        else:
            entry[1] += 1
    return tuple((k, n) for k, n in seen.values())


ROUTED_SCOPES = ("router", "dispatch", "experts", "combine")  # on SP's 1/t of the tokens; experts over ep


def routed(k: Kernel) -> bool:
    return k.scope in ROUTED_SCOPES and k.phase in STEP_PHASES


@lru_cache(maxsize=256)
def moe_kernels(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU,
                cal: Calibration) -> tuple[tuple[str, float, float, float, float, bool], ...]:  # fmt: skip
    """The router's and the routed experts' kernels, each as (part, share, compute time, weight bytes'
    time, other bytes' time, per expert): an expert matmul reads or writes one expert matrix, h · f_e
    (or its gradient), whatever its tokens; the rest of its bytes and its FLOPs follow the tokens."""
    bandwidth, blocks, shares = byte_rate(gpu, cal), block_shares(shape, tricks), {}
    for k, n in collapsed(shape, seq_len, micro_batch, tricks):
        if not routed(k):
            continue
        compute, memory, _ = kernel_seconds(k, gpu, cal)
        expert = k.scope == "experts"
        weight = shape.hidden * shape.routed_ffn * (4 if k.dtype == "fp32" else 2) if expert and k.unit == "tensor" else 0
        key = (part_key(k), compute, weight / bandwidth, memory - weight / bandwidth, expert)
        shares[key] = shares.get(key, 0.0) + n * blocks.get(k.layer, 1.0)
    return tuple((key, w, *rest) for (key, *rest), w in shares.items())


@lru_cache(maxsize=4096)
def moe_parts(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
              tokens: int, experts: int) -> dict[str, float]:  # fmt: skip
    """moe_kernels on one GPU of a layout: the MoE layer routes 1/tokens of the traced tokens (SP's share);
    its experts are 1/experts of them (ep · etp), each receiving `experts` times the traced tokens per
    expert, so a traced expert kernel stands for 1/experts of a kernel with that many times its tokens:
    max(compute/t, weights/(ep·etp) + the rest/t, launch/(ep·etp)) (Lepikhin et al. 2021)."""
    floor, parts = cal.launch_seconds, {}
    for key, w, compute, weights, rest, expert in moe_kernels(shape, seq_len, micro_batch, tricks, gpu, cal):
        n = experts if expert else 1
        seconds = max(compute / tokens, weights / n + rest / tokens, floor / n)
        parts[key] = parts.get(key, 0.0) + w * seconds
    return parts


def part_key(k: Kernel) -> str:
    """Where a kernel sits in a stage, and whether SP or ring attention rescales it."""
    experts = "_experts" if k.scope == "experts" else ""  # routed experts' weights: split over ep, sharded over edp
    if k.phase == "optimizer":
        return ("optimizer_block" if k.layer is not None else "optimizer_rest") + experts
    where = "block" if k.layer is not None else "first" if k.scope in ("embedding", "rope tables") else "last"
    if k.phase == "accumulate":
        return f"{where}_accumulate{experts}"
    phase = k.phase
    if k.scope == "attention core":  # a block's, or the MTP module's after the blocks
        return f"{where}_core_{phase}"
    if (k.scope in SEQUENCE_SPLIT and k.layer is not None) or k.scope == "final norm":
        return f"{where}_sequence_{phase}"
    return f"{where}_{phase}"


def scaled_sum(entry: tuple[tuple[float, ...], ...] | None, scale: float, floor: float) -> float:
    """Σ w·max(scale·a, floor) over a part's sorted times a and weights w: the kernels at or under
    floor/scale take the floor."""
    if entry is None:
        return 0.0
    values, weighted, weights = entry
    cut = bisect_right(values, floor / scale)
    return floor * weights[cut] + scale * (weighted[-1] - weighted[cut])


@lru_cache(maxsize=8192)
def stage_kernels(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
                  sequence_split: int = 1, ring: int = 1, grad_shards: int = 1, optimizer_shards: int = 1,
                  experts: int = 1, expert_grad_shards: int = 1, expert_optimizer_shards: int = 1) -> StageKernels:  # fmt: skip
    """The kernels of `shape` (one TP rank's: heads, KV heads, MLP width and vocabulary split) at seq_len
    tokens per sequence (one CP rank's), timed one by one as step_time times them, then:
      sequence_split t   with SP the norms, dropouts and residual adds run on 1/t of the tokens
                         (Korthikanti et al. 2022, sec. 4.2.2), as does the final norm
      ring c             ring attention runs c blocks of (s/c)² per layer: the core does c times the traced work
      grad_shards n      gradients accumulate into 1/n shards (ZeRO-2, ZeRO-3)
      optimizer_shards n the optimizer updates 1/n of the parameters (ZeRO >= 1)
      experts e          a MoE layer's router and experts run on SP's 1/t of the tokens, its routed
                         experts over e = ep · etp GPUs (moe_parts)
      expert_grad_shards, expert_optimizer_shards
                         the routed experts' gradients and optimizer step: 1/e of their tensors, each
                         1/n of its size over their ZeRO shards (the launches fall with e only)
    With every factor 1 the step that trace implies is step_time's, kernel for kernel."""
    table = kernel_table(shape, seq_len, micro_batch, tricks, gpu, cal)
    unknown = {key for key in table if not key.startswith(PARTS_KNOWN)}
    if unknown:  # a kernel no stage runs would drop out of the step: never silently
        raise ValueError(f"kernels outside every stage part: {sorted(unknown)}")
    floor = cal.launch_seconds
    moe = moe_parts(shape, seq_len, micro_batch, tricks, gpu, cal, sequence_split, experts) if shape.n_experts else {}

    def part(key: str, scale: float = 1.0) -> float:
        return scaled_sum(table.get(key), scale, floor)

    def phase(where: str, name: str) -> float:
        core = part(f"{where}_core_{name}", ring)
        routed = moe.get(f"{where}_{name}", 0.0) + moe.get(f"{where}_sequence_{name}", 0.0)
        return part(f"{where}_{name}") + part(f"{where}_sequence_{name}", 1 / sequence_split) + core + routed

    return StageKernels(
        block_forward=phase("block", "forward"),
        block_backward=phase("block", "backward"),
        block_recompute=phase("block", "recompute"),
        block_attention=sum(part(f"block_core_{name}", ring) for name in ("forward", "backward", "recompute")),
        block_accumulate=part("block_accumulate", 1 / grad_shards)
        + part("block_accumulate_experts", 1 / expert_grad_shards) / experts,
        first_forward=phase("first", "forward"),
        first_backward=phase("first", "backward"),
        last_forward=phase("last", "forward"),
        last_backward=phase("last", "backward"),
        last_recompute=phase("last", "recompute"),
        last_accumulate=part("last_accumulate", 1 / grad_shards) + part("first_accumulate", 1 / grad_shards)
        + part("last_accumulate_experts", 1 / expert_grad_shards) / experts,
        optimizer_block=part("optimizer_block", 1 / optimizer_shards)
        + part("optimizer_block_experts", 1 / expert_optimizer_shards) / experts,
        optimizer_rest=part("optimizer_rest", 1 / optimizer_shards)
        + part("optimizer_rest_experts", 1 / expert_optimizer_shards) / experts,
    )


PARTS_KNOWN = (
    "block_forward", "block_backward", "block_recompute", "block_sequence_", "block_core_", "block_accumulate",
    "first_forward", "first_backward", "first_sequence_forward", "first_sequence_backward", "first_accumulate",
    "last_forward", "last_backward", "last_recompute", "last_core_", "last_sequence_", "last_accumulate",
    "optimizer_block", "optimizer_rest",
)  # fmt: skip


@lru_cache(maxsize=1024)
def block_kernels_of_one(shape: ModelShape, seq_len: int, tricks: Tricks, gpu: GPU,
                         cal: Calibration) -> tuple[tuple[float, float, str, float], ...]:  # fmt: skip
    """(compute time, memory time, part key, share) of each forward, backward and recompute kernel of one
    block at one sequence per micro-batch (block_lower_bound's raw material), the router's and routed
    experts' apart (moe_kernels); share: how many of it the average block runs (block_shares)."""
    if tricks.recompute == "none":
        kernels_of(shape, seq_len, 1, replace(tricks, recompute="full"))
    out, shares = [], block_shares(shape, tricks)
    for k, n in collapsed(shape, seq_len, 1, tricks):
        if k.layer is not None and k.phase in STEP_PHASES and not routed(k):
            compute, memory, _ = kernel_seconds(k, gpu, cal)
            out.append((compute, memory, part_key(k), n * shares.get(k.layer, 1.0)))
    return tuple(out)


@lru_cache(maxsize=8192)
def block_lower_bound(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
                      sequence_split: int = 1, ring: int = 1, experts: int = 1) -> float:  # fmt: skip
    """Seconds one block's forward, backward and recompute take at least at micro_batch b, from the kernels
    of b = 1: each kernel's FLOPs grow b-fold (every one works per token or per sequence) and its bytes do
    not shrink, so it takes at least max(b · compute₁, memory₁, launch floor); a larger micro-batch only
    adds kernels (copies where B > 1 keeps tensors apart). A routed expert's kernel likewise, as moe_parts
    splits it. stage_kernels' block parts are never below it."""
    floor, total = cal.launch_seconds, 0.0
    for compute, memory, key, n in block_kernels_of_one(shape, seq_len, tricks, gpu, cal):
        scale = ring if key.startswith("block_core_") else 1 / sequence_split if "_sequence_" in key else 1.0
        total += n * max(micro_batch * compute * scale, memory * scale, floor)
    if shape.n_experts:
        for key, n, compute, weights, rest, expert in moe_kernels(shape, seq_len, 1, tricks, gpu, cal):
            if key.startswith("block_"):
                e = experts if expert else 1
                total += n * max(micro_batch * compute / sequence_split, weights / e + rest / sequence_split, floor / e)
    return total
