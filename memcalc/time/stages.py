"""One GPU of a parallel layout on the roofline: the same kernels as memcalc.time.roofline's step, traced
on the shapes that GPU holds (one TP rank's heads and widths, one CP rank's tokens), timed one by one
against the roofs, and summed by where they sit in a pipeline stage (StageKernels: a block's forward,
backward, recompute and accumulation, what runs before the first block and after the last, the optimizer
step). Sequence parallelism, ring attention, ZeRO's shards and expert parallelism rescale the parts they
split (stage_kernels); memcalc.parallel.comm composes the pipeline from them. block_lower_bound is the
least one block can take at a larger micro-batch, from the kernels of one sequence.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from memcalc.exact.base.kernel import STEP_PHASES, Kernel
from memcalc.exact.kernels import full_twin, kernels_of, traced_blocks
from memcalc.model.gpus import GPU
from memcalc.model.shape import ModelShape
from memcalc.model.finetune import FULL, Finetune
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks

from .calibration import Calibration
from .roofline import byte_rate, kernel_seconds

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
def kernel_parts(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, stack: Stack = DEFAULT_STACK,
                 optimizer: str = "adamw") -> dict[str, tuple[tuple[Kernel, float], ...]]:  # fmt: skip
    """Each part of a stage (see StageKernels; 'block_sequence', 'block_core', 'last_core' and
    'last_sequence' hold the kernels SP and ring attention rescale) as its kernels, each with its weight:
    the share of the model's blocks that run it (memcalc.exact.kernels.block_weight / L) times its count.
    A block kernel's share is 1, or with dense and MoE blocks traced apart (or ckpt:N's plain and
    checkpointed ones), that kind's share, so that a block part is the average block. What the GPU and
    calibration do not change: kernel_table times it on each. The routed experts are moe_kernels'."""
    parts: dict[str, list[tuple[Kernel, float]]] = {}
    twin = full_twin(shape, tricks, stack, optimizer)
    if twin is not None:  # traced once with full recompute, the plain step is that less its recompute
        kernels_of(shape, seq_len, micro_batch, twin, stack, optimizer)
    shares = block_shares(shape, tricks, stack.finetune)
    for k in kernels_of(shape, seq_len, micro_batch, tricks, stack, optimizer):
        if not routed(k):  # timed per layout by moe_kernels
            parts.setdefault(part_key(k), []).append((k, k.count * shares.get(k.layer, 1.0)))
    return {key: tuple(kernels) for key, kernels in parts.items()}


@lru_cache(maxsize=1024)
def kernel_table(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
                 stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> dict[str, tuple[tuple[float, ...], ...]]:  # fmt: skip
    """kernel_parts on this GPU: each part's kernels as their larger of compute and memory time, sorted,
    with prefix sums of weight · time and of weight: a kernel doing x times its work takes max(x·a, launch
    floor), and the sum over a part is then one bisection (scaled_sum). The kernels are the stack's own
    (its model, autocast's casts, its optimizer's)."""
    table = {}
    for key, kernels in kernel_parts(shape, seq_len, micro_batch, tricks, stack, optimizer).items():
        pairs = sorted((max(kernel_seconds(k, gpu, cal)[:2]), w) for k, w in kernels)
        weighted, weights = [0.0], [0.0]
        for v, w in pairs:
            weighted.append(weighted[-1] + w * v)
            weights.append(weights[-1] + w)
        table[key] = (tuple(v for v, _ in pairs), tuple(weighted), tuple(weights))
    return table


def block_shares(shape: ModelShape, tricks: Tricks, finetune: Finetune = FULL) -> dict[int, float]:
    """The share of the model's blocks each traced block stands for (memcalc.exact.kernels.block_weight /
    L): 1 for every block when all are alike; with dense and MoE blocks, or ckpt:N's plain and checkpointed
    ones, traced apart, its kind's."""
    return {t: n / shape.n_layers for t, n in traced_blocks(shape, tricks, finetune)[1].items()}


ROUTED_SCOPES = ("router", "dispatch", "experts", "combine")  # on SP's 1/t of the tokens; experts over ep


def routed(k: Kernel) -> bool:
    return k.scope in ROUTED_SCOPES and k.phase in STEP_PHASES


@lru_cache(maxsize=256)
def moe_kernels(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
                stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> tuple[tuple[str, float, float, float, float, bool], ...]:  # fmt: skip
    """The router's and the routed experts' kernels, each as (part, share, compute time, weight bytes'
    time, other bytes' time, per expert): an expert matmul reads or writes one expert matrix, h · f_e
    (or its gradient), whatever its tokens; the rest of its bytes and its FLOPs follow the tokens."""
    bandwidth, blocks, shares = byte_rate(gpu, cal), block_shares(shape, tricks, stack.finetune), {}
    for k in kernels_of(shape, seq_len, micro_batch, tricks, stack, optimizer):
        if not routed(k):
            continue
        compute, memory, _ = kernel_seconds(k, gpu, cal)
        expert = k.scope == "experts"
        weight = shape.hidden * shape.routed_ffn * (4 if k.dtype == "fp32" else 2) if expert and k.unit == "tensor" else 0
        key = (part_key(k), compute, weight / bandwidth, memory - weight / bandwidth, expert)
        shares[key] = shares.get(key, 0.0) + k.count * blocks.get(k.layer, 1.0)
    return tuple((key, w, *rest) for (key, *rest), w in shares.items())


@lru_cache(maxsize=4096)
def moe_parts(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
              tokens: int, experts: int, stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> dict[str, float]:  # fmt: skip
    """moe_kernels on one GPU of a layout: the MoE layer routes 1/tokens of the traced tokens (SP's share);
    its experts are 1/experts of them (ep · etp), each receiving `experts` times the traced tokens per
    expert, so a traced expert kernel stands for 1/experts of a kernel with that many times its tokens:
    max(compute/t, weights/(ep·etp) + the rest/t, launch/(ep·etp)) (Lepikhin et al. 2021)."""
    floor, parts = cal.launch_seconds, {}
    for key, w, compute, weights, rest, expert in moe_kernels(shape, seq_len, micro_batch, tricks, gpu, cal, stack,
                                                              optimizer):  # fmt: skip
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
                  experts: int = 1, expert_grad_shards: int = 1, expert_optimizer_shards: int = 1,
                  stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> StageKernels:  # fmt: skip
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
    table = kernel_table(shape, seq_len, micro_batch, tricks, gpu, cal, stack, optimizer)
    unknown = {key for key in table if not key.startswith(PARTS_KNOWN)}
    if unknown:  # a kernel no stage runs would drop out of the step: never silently
        raise ValueError(f"kernels outside every stage part: {sorted(unknown)}")
    floor = cal.launch_seconds
    moe = {} if not shape.n_experts else moe_parts(shape, seq_len, micro_batch, tricks, gpu, cal, sequence_split,
                                                   experts, stack, optimizer)  # fmt: skip

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
def block_kernels_of_one(shape: ModelShape, seq_len: int, tricks: Tricks, gpu: GPU, cal: Calibration,
                         stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> tuple[tuple[float, float, str, float], ...]:  # fmt: skip
    """(compute time, memory time, part key, share) of each forward, backward and recompute kernel of one
    block at one sequence per micro-batch (block_lower_bound's raw material), the router's and routed
    experts' apart (moe_kernels); share: how many of it the average block runs (block_shares)."""
    twin = full_twin(shape, tricks, stack, optimizer)
    if twin is not None:  # as kernel_parts: one trace for both
        kernels_of(shape, seq_len, 1, twin, stack, optimizer)
    out, shares = [], block_shares(shape, tricks, stack.finetune)
    for k in kernels_of(shape, seq_len, 1, tricks, stack, optimizer):
        if k.layer is not None and k.phase in STEP_PHASES and not routed(k):
            compute, memory, _ = kernel_seconds(k, gpu, cal)
            out.append((compute, memory, part_key(k), k.count * shares.get(k.layer, 1.0)))
    return tuple(out)


@lru_cache(maxsize=8192)
def block_lower_bound(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU, cal: Calibration,
                      sequence_split: int = 1, ring: int = 1, experts: int = 1, stack: Stack = DEFAULT_STACK,
                      optimizer: str = "adamw") -> float:  # fmt: skip
    """Seconds one block's forward, backward and recompute take at least at micro_batch b, from the kernels
    of b = 1: each kernel's FLOPs grow b-fold (every one works per token or per sequence) and its bytes do
    not shrink, so it takes at least max(b · compute₁, memory₁, launch floor); a larger micro-batch only
    adds kernels (copies where B > 1 keeps tensors apart). A routed expert's kernel likewise, as moe_parts
    splits it. stage_kernels' block parts are never below it."""
    total = block_lower_bound_unrouted(shape, seq_len, micro_batch, tricks, gpu, cal, sequence_split, ring, stack,
                                       optimizer)  # fmt: skip
    if shape.n_experts:
        floor = cal.launch_seconds
        for key, n, compute, weights, rest, expert in moe_kernels(shape, seq_len, 1, tricks, gpu, cal, stack, optimizer):
            if key.startswith("block_"):
                e = experts if expert else 1
                total += n * max(micro_batch * compute / sequence_split, weights / e + rest / sequence_split, floor / e)
    return total


@lru_cache(maxsize=4096)
def block_lower_bound_unrouted(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, gpu: GPU,
                               cal: Calibration, sequence_split: int = 1, ring: int = 1, stack: Stack = DEFAULT_STACK,
                               optimizer: str = "adamw") -> float:  # fmt: skip
    """block_lower_bound's kernels but the router's and the routed experts': the same for every expert-parallel
    size, remembered apart."""
    floor, total = cal.launch_seconds, 0.0
    for compute, memory, key, n in block_kernels_of_one(shape, seq_len, tricks, gpu, cal, stack, optimizer):
        scale = ring if key.startswith("block_core_") else 1 / sequence_split if "_sequence_" in key else 1.0
        total += n * max(micro_batch * compute * scale, memory * scale, floor)
    return total
