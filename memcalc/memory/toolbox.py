"""Does it fit, and if not, what to do: the OOM toolbox in order of cost, and the fit solver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memcalc.exact.kernels import step_flops
from memcalc.model.gpus import GPU
from memcalc.model.shape import MAX_BATCH, MAX_SEQ, Model, check_positions, longest_seq
from memcalc.model.tricks import Tricks

from .estimate import Memory, Setup, check_textbook, memory_for
from .exact import ExactMemory, exact_memory, not_replayed_for

MAX_ZERO_GPUS = 4096  # the ZeRO search tries 2, 4, ... up to this many data-parallel GPUs


@dataclass(frozen=True)
class Config:
    tricks: Tricks
    setup: Setup


@dataclass(slots=True)
class ToolStep:
    name: str
    cost: str  # what it costs, computed for this config
    saves_alone_bytes: int  # applied on its own to the starting config
    memory: Memory | ExactMemory  # after this step and every one before it
    tricks: Tricks
    setup: Setup


@dataclass(slots=True)
class Toolbox:
    start: Memory | ExactMemory
    steps: tuple[ToolStep, ...]

    @property
    def fits_at(self) -> int | None:
        """Index of the first step after which it fits (-1: it fits already; None: never)."""
        if self.start.fits:
            return -1
        return next((i for i, s in enumerate(self.steps) if s.memory.fits), None)


# A tool looks at the current config and returns (name, change, cost), or None where it does not
# apply. The change is a function of a config, so "saves on its own" applies the same change to the start.
Change = Callable[[Config], Config]
# How a config's memory is measured: the stack's step replayed (exact_memory, the verdict) or the textbook.
Measure = Callable[[Model, Setup, GPU, Tricks], "Memory | ExactMemory"]
Tool = Callable[[Model, GPU, Config, Measure], "tuple[str, Change, str] | None"]


def textbook(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> Memory:
    """The textbook's memory (Korthikanti et al. 2022 and friends): the lesson's reference."""
    return memory_for(model, setup, gpu, tricks)[3]


def verdict_measure(setup: Setup, tricks: Tricks, shape=None) -> Measure:
    """The replayed step (exact_memory) where the exact model replays the stack (and the shape, when given),
    for the trick set and the bf16 the tools may switch it to; else the textbook, as estimate's verdict falls back."""
    gap = not_replayed_for(setup, (tricks, replace(tricks, precision="bf16")), shape)
    if gap:
        check_textbook((tricks,), gap)
    return textbook if gap else exact_memory


def use_bf16(model: Model, gpu: GPU, c: Config, measure: Measure) -> tuple[str, Change, str] | None:
    if c.tricks.precision != "fp32":
        return None
    speed = gpu.bf16_tflops / gpu.fp32_tflops
    return "bf16 mixed precision", with_tricks(precision="bf16"), f"none: {speed:.1f}x the fp32 matmul peak"


def use_flash(model: Model, gpu: GPU, c: Config, measure: Measure) -> tuple[str, Change, str] | None:
    if c.tricks.flash:
        return None
    return "FlashAttention", with_tricks(flash=True, precision="bf16"), "none: faster, no s×s through HBM"


def use_smaller_batch(model: Model, gpu: GPU, c: Config, measure: Measure) -> tuple[str, Change, str] | None:
    b = c.setup.micro_batch
    if b == 1:
        return None

    def change(x: Config) -> Config:
        return Config(x.tricks, replace(x.setup, micro_batch=1, grad_accum=x.setup.grad_accum * b))

    return f"micro-batch 1, {b}x accumulation", change, f"{b}x more, smaller passes"


def use_checkpointing(model: Model, gpu: GPU, c: Config, measure: Measure) -> tuple[str, Change, str] | None:
    if c.tricks.recompute == "full" and c.tricks.ckpt_every == 1:
        return None
    change = with_tricks(recompute="full", ckpt_every=1)  # every block (from ckpt:N, sac or less)
    before = step_flops(model.shape, c.setup.seq_len, c.tricks).hardware_per_token
    after = step_flops(model.shape, c.setup.seq_len, change(c).tricks).hardware_per_token
    return "full activation checkpointing", change, f"+{after / before - 1:.0%} FLOPs per step"


def use_zero(model: Model, gpu: GPU, c: Config, measure: Measure) -> tuple[str, Change, str] | None:
    """The fewest GPUs (powers of two), then the lowest ZeRO stage, that fit; else ZeRO-3 on the most."""
    p = c.setup.parallel
    counts = [n for n in (1 << k for k in range(1, 13)) if max(2, p.gpus) <= n <= MAX_ZERO_GPUS] or [p.gpus]
    choice = next(
        ((n, z) for n in counts for z in range(max(p.zero, 1), 4) if memory_of(model, gpu, with_zero(n, z)(c), measure).fits),
        (counts[-1], 3),
    )
    gpus, stage = choice
    # Rajbhandari et al. 2019, sec. 7: stages 1-2 move as much data as data parallel, stage 3 1.5x
    comm = "1.5x" if stage == 3 else "1x"
    return f"ZeRO-{stage} over {gpus} GPUs", with_zero(gpus, stage), f"{gpus} GPUs, {comm} data-parallel traffic"


def use_offload(model: Model, gpu: GPU, c: Config, measure: Measure) -> tuple[str, Change, str] | None:
    if c.setup.parallel.offload or not c.setup.parallel.can_offload:
        return None  # already offloaded, or ZeRO 0 over several GPUs: a layout the engine refuses

    def change(x: Config) -> Config:
        return Config(x.tricks, replace(x.setup, parallel=replace(x.setup.parallel, offload=True)))

    return "CPU offload of optimizer state", change, "optimizer step on the CPU, PCIe traffic"


def with_tricks(**changes: object) -> Change:
    def change(c: Config) -> Config:
        fields = dict(changes)
        if fields.get("precision") == "bf16" and c.tricks.precision != "fp32":
            del fields["precision"]  # keep fp16 where it was chosen; only fp32 must become 16-bit
        return Config(replace(c.tricks, **fields), c.setup)

    return change


def with_zero(gpus: int, stage: int) -> Change:
    def change(c: Config) -> Config:
        return Config(c.tricks, replace(c.setup, parallel=replace(c.setup.parallel, gpus=gpus, zero=stage)))

    return change


TOOLS: tuple[Tool, ...] = (use_bf16, use_flash, use_smaller_batch, use_checkpointing, use_zero, use_offload)


def memory_of(model: Model, gpu: GPU, c: Config, measure: Measure) -> Memory | ExactMemory:
    return measure(model, c.setup, gpu, c.tricks)


def toolbox(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, measure: Measure = exact_memory) -> Toolbox:
    """Apply the tools in order of cost, each on top of the last, until the config fits.

    ZeRO is the first tool that needs more GPUs; offload follows as the alternative that stays on
    the GPUs you had: it is applied to the config before ZeRO.
    """
    start = Config(tricks, setup)
    start_memory = memory_of(model, gpu, start, measure)
    current, before_zero, steps = start, start, []
    for tool in TOOLS:
        base = before_zero if tool is use_offload else current
        applied = tool(model, gpu, base, measure)
        if applied is None:
            continue
        name, change, cost = applied
        after = change(base)
        saves = start_memory.total_bytes - memory_of(model, gpu, change(start), measure).total_bytes
        memory = memory_of(model, gpu, after, measure)
        steps.append(ToolStep(name, cost, saves, memory, after.tricks, after.setup))
        if memory.fits and tool is not use_zero:
            break
        if tool is not use_zero:
            before_zero = after
        current = after
    return Toolbox(start_memory, tuple(steps))


@dataclass(slots=True)
class FitLimits:
    """The longest sequence and the largest micro-batch that fit one GPU under a trick set."""

    tricks: Tricks
    gpu: str
    usable_bytes: int
    seq_len: int  # the sequence length the micro-batch limit is computed at
    micro_batch: int  # the micro-batch the sequence limit is computed at
    max_seq_len: int  # 0: not even one token fits
    max_micro_batch: int  # 0: not even one sequence fits
    memory_at_max_seq: Memory | ExactMemory | None
    memory_at_max_batch: Memory | ExactMemory | None
    seq_limit: int  # the longest sequence the model embeds (a learned position table), else MAX_SEQ

    @property
    def seq_capped(self) -> bool:
        """Whether the position table, not memory, ends the sequence."""
        return self.max_seq_len == self.seq_limit < MAX_SEQ


def largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for fits monotone decreasing; 0 if none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fit_limits(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, measure: Measure = exact_memory) -> FitLimits:
    """The longest sequence (no longer than the model's position table) and the largest micro-batch."""
    check_positions(model.shape, setup.seq_len)

    def memory(seq_len: int, micro_batch: int) -> Memory | ExactMemory:
        return measure(model, replace(setup, seq_len=seq_len, micro_batch=micro_batch), gpu, tricks)

    seq_limit = longest_seq(model.shape)
    max_seq = largest(lambda s: memory(s, setup.micro_batch).fits, seq_limit)
    max_batch = largest(lambda b: memory(setup.seq_len, b).fits, MAX_BATCH)
    return FitLimits(
        tricks=tricks,
        gpu=gpu.key,
        usable_bytes=gpu.usable_bytes,
        seq_len=setup.seq_len,
        micro_batch=setup.micro_batch,
        max_seq_len=max_seq,
        max_micro_batch=max_batch,
        memory_at_max_seq=memory(max_seq, setup.micro_batch) if max_seq else None,
        memory_at_max_batch=memory(setup.seq_len, max_batch) if max_batch else None,
        seq_limit=seq_limit,
    )
