"""Does it fit, and if not, what to do: the OOM toolbox, in order of cost, over the verdict.

Each tool changes the job (its trick set, its micro-batch, its data-parallel GPUs, ZeRO stage or offload)
and is measured by the same verdict as the job itself (memcalc.parallel.verdict.gpu_verdict). The free
tools, which make the step faster (bf16, FlashAttention), are always applied; a tool that costs time
(smaller micro-batches, recompute) is kept only where it lowers the peak, and one that saves nothing or
costs memory is listed as such and not applied. Of the combinations that fit, the toolbox recommends the
cheapest: the fewest GPU-seconds per token (GPUs x step time / tokens per step), timed as the job is
(memcalc.parallel.comm.step_time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

from memcalc.errors import InputError
from memcalc.exact.kernels import step_flops
from memcalc.memory.setup import Setup
from memcalc.model.gpus import GPU, half_precision
from memcalc.model.layout import Layout
from memcalc.model.shape import Model
from memcalc.model.tricks import Tricks
from memcalc.parallel.checks import check_layout
from memcalc.parallel.engines import check_engine, engine_layout
from memcalc.parallel.plan import layout_estimate
from memcalc.parallel.verdict import Verdict, gpu_verdict
from memcalc.records import record
from memcalc.time.calibration import Calibration

from .job import check_finetune

MAX_ZERO_GPUS = 4096  # the ZeRO search tries 2, 4, ... up to this many data-parallel GPUs


@record(frozen=True)
class Combination:
    """One combination the toolbox tries: a trick set, a step, a data-parallel layout."""

    tricks: Tricks
    setup: Setup
    layout: Layout


@record(slots=True)
class ToolStep:
    """One tool of the OOM toolbox, applied after the kept ones before it, and what it saves."""

    name: str
    cost: str  # what it costs, computed for this config
    saves_alone_bytes: int  # applied on its own to the starting config (negative: it costs memory)
    saves_bytes: int  # applied to the config before it (negative: it costs memory)
    kept: bool  # applied: a free tool, or one that lowered the peak (one that saves nothing is shown, not applied)
    verdict: Verdict  # after this step and every kept one before it
    gpu_seconds_per_token: float  # GPUs x step time / tokens per step, for the cheapest among those that fit
    combination: Combination

    @property
    def tricks(self) -> Tricks:
        return self.combination.tricks

    @property
    def setup(self) -> Setup:
        return self.combination.setup

    @property
    def layout(self) -> Layout:
        return self.combination.layout


# Where a job fits (Toolbox.outcome): as it is, after the step fits_at names, or neither
FITS_AS_IT_IS, FITS_AFTER_A_STEP, FITS_NOWHERE = "fits as it is", "fits after a step", "fits nowhere"
Outcome = Literal["fits as it is", "fits after a step", "fits nowhere"]


@record(slots=True)
class Toolbox:
    """The first trick set's verdict, then the toolbox's steps in order."""

    start: Verdict
    steps: tuple[ToolStep, ...]

    @property
    def fits_at(self) -> int | None:
        """The recommended step, an index into steps: of the kept steps that fit, the cheapest per token. None
        where no step is recommended: the job fits as it is, or nothing fits (outcome says which)."""
        if self.start.fits:
            return None
        fitting = [i for i, s in enumerate(self.steps) if s.kept and s.verdict.fits]
        return min(fitting, key=lambda i: self.steps[i].gpu_seconds_per_token) if fitting else None

    @property
    def outcome(self) -> Outcome:
        """Where the job fits: as it is (start), after a step (steps[fits_at]), or nowhere: neither the job
        nor any step the toolbox kept fits."""
        if self.start.fits:
            return FITS_AS_IT_IS
        return FITS_NOWHERE if self.fits_at is None else FITS_AFTER_A_STEP


# A tool looks at a config and returns (name, change, cost), or None where it does not apply. The change is
# a function of a config, so "saves on its own" applies the same change to the start.
Change = Callable[[Combination], Combination]
Measure = Callable[[Combination], Verdict]
Tool = Callable[[Model, GPU, Combination, Measure], "tuple[str, Change, str] | None"]


def use_bf16(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    half = half_precision(gpu)  # Volta and Turing have no bf16 tensor cores
    if c.tricks.precision != "fp32" or not gpu.peak_flops(half):  # a --gpu file may give no 16-bit rate
        return None
    speed = gpu.peak_flops(half) / gpu.peak_flops("fp32")
    return f"{half} mixed precision", with_tricks(precision=half), f"none: {speed:.1f}x the fp32 matmul peak"


def use_flash(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    half = half_precision(gpu)  # flash runs in 16 bits
    if c.tricks.flash or not gpu.peak_flops(half):
        return None
    return "FlashAttention", with_tricks(flash=True, precision=half), "none: faster, no s×s through HBM"


def use_smaller_batch(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    b, per = c.setup.samples, c.setup.per_sample  # DPO: its pairs, two sequences each
    if b == 1:
        return None

    def change(x: Combination) -> Combination:
        return replace(x, setup=replace(x.setup, micro_batch=per, grad_accum=x.setup.grad_accum * b))

    return f"micro-batch 1, {b}x accumulation", change, f"{b}x more, smaller passes"


def use_checkpointing(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    if c.tricks.recompute == "full" and c.tricks.ckpt_every == 1:
        return None
    change = with_tricks(recompute="full", ckpt_every=1)  # every block (from ckpt:N, sac or less)
    before = step_flops(model.shape, c.setup.seq_len, c.tricks).hardware_per_token
    after = step_flops(model.shape, c.setup.seq_len, change(c).tricks).hardware_per_token
    return "full activation checkpointing", change, f"+{after / before - 1:.0%} FLOPs per step"


def use_quantized_base(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    """LoRA over a 16-bit base: the base in 4 bits, QLoRA (bitsandbytes nf4 with double quantisation: about half
    a byte a weight, memcalc.model.finetune.nf4_bytes), each 4-bit weight dequantised to run its matmuls."""
    ft, online = c.setup.stack.finetune, c.setup.stack.online
    if not ft.lora or ft.quantize or (online is not None and online.vllm):  # vLLM's bitsandbytes weights: refused
        return None

    def change(x: Combination) -> Combination:
        stack = x.setup.stack
        quantized = replace(stack, finetune=replace(stack.finetune, quantize="nf4"))
        return replace(x, setup=replace(x.setup, stack=quantized))

    if not runs(model, change(c)):
        return None
    return "QLoRA: the base in 4 bits (--quantize nf4)", change, "each weight dequantised at every use"


def use_zero(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    """The fewest GPUs (powers of two), then the lowest ZeRO stage, that fit; else ZeRO-3 on the most."""
    lay = c.layout
    counts = [n for n in (1 << k for k in range(1, 13)) if max(2, lay.dp) <= n <= MAX_ZERO_GPUS] or [lay.dp]
    stages = [z for z in range(max(lay.zero, 1), 4) if runs(model, with_zero(counts[0], z)(c))]  # the engine's
    if not stages:
        return None
    i = first(len(counts), lambda i: measure(with_zero(counts[i], stages[-1])(c)).fits)  # the top stage holds least
    if i is None:
        gpus, stage = counts[-1], stages[-1]
    else:
        gpus = counts[i]
        stage = next(z for z in stages if z == stages[-1] or measure(with_zero(gpus, z)(c)).fits)
    # Rajbhandari et al. 2019, sec. 7: stages 1-2 move as much data as data parallel, stage 3 1.5x
    comm = "1.5x" if stage == 3 else "1x"
    return f"ZeRO-{stage} over {gpus} GPUs", with_zero(gpus, stage), f"{gpus} GPUs, {comm} data-parallel traffic"


def use_offload(model: Model, gpu: GPU, c: Combination, measure: Measure) -> tuple[str, Change, str] | None:
    lay = c.layout
    if lay.offload_optimizer or (lay.zero == 0 and lay.shard_ranks > 1):
        return None  # already offloaded, or ZeRO 0 over several GPUs: a layout the engines refuse

    def change(x: Combination) -> Combination:
        return replace(x, layout=replace(x.layout, offload_optimizer=True))

    if not runs(model, change(c)):
        return None  # an offload the stack's engine does not run (FSDP2 offloads the parameters too)
    return "CPU offload of optimizer state", change, "optimizer step on the CPU, PCIe traffic"


def runs(model: Model, c: Combination) -> bool:
    """Whether the stack's engine runs this layout of this model (memcalc.parallel.engines, layout), and the
    fine-tuning is replayed on it (LoRA and frozen weights: plain data parallelism, memcalc.engine.job)."""
    engine = c.setup.stack.engine
    try:
        layout = engine_layout(c.layout, engine)
        check_engine(layout, engine)
        check_layout(layout, model.shape, c.setup.seq_len, c.tricks, c.setup.grad_accum, engine)
        check_finetune(model, c.setup, layout, (c.tricks,))
    except InputError:
        return False
    return True


def first(n: int, holds: Callable[[int], bool]) -> int | None:
    """The least i in [0, n) where holds(i), for holds monotone (False, then True); None if none."""
    if n == 0 or not holds(n - 1):
        return None
    lo, hi = -1, n - 1  # holds(hi); not holds(lo) (lo = -1 stands before the first)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def with_tricks(**changes: object) -> Change:
    def change(c: Combination) -> Combination:
        fields = dict(changes)
        if "precision" in fields and c.tricks.precision != "fp32":
            del fields["precision"]  # keep the 16-bit recipe chosen; only fp32 must become 16-bit
        return replace(c, tricks=replace(c.tricks, **fields))

    return change


def with_zero(gpus: int, stage: int) -> Change:
    def change(c: Combination) -> Combination:
        return replace(c, layout=replace(c.layout, dp=gpus, zero=stage))

    return change


TOOLS: tuple[Tool, ...] = (use_bf16, use_flash, use_smaller_batch, use_checkpointing, use_quantized_base, use_zero,
                           use_offload)  # fmt: skip
FREE = (use_bf16, use_flash)  # faster as well as (mostly) smaller: applied whatever they save


def toolbox(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout = Layout(),
            timing: Calibration | float | None = None) -> Toolbox:  # fmt: skip
    """Apply the tools in order of cost, each on top of the last it kept, until the config fits.

    ZeRO is the first tool that needs more GPUs; offload follows as the alternative that stays on the GPUs
    you had: it is applied to the config before ZeRO. A tool that costs time and saved nothing on the GPUs
    you had is tried again under ZeRO, where the state no longer hides what it saves."""

    def measure(c: Combination) -> Verdict:
        return gpu_verdict(model, c.setup, gpu, c.tricks, c.layout)

    def step(name: str, what: str, change: Change, base: Combination, free: bool) -> ToolStep:
        after, before = change(base), measure(base)
        verdict = measure(after)
        kept = free or verdict.peak_bytes < before.peak_bytes
        alone = start_verdict.peak_bytes - measure(change(start)).peak_bytes
        price = cost(model, gpu, after, timing) if kept and verdict.fits else 0.0
        return ToolStep(name, what, alone, before.peak_bytes - verdict.peak_bytes, kept, verdict, price,
                        after if kept else base)  # fmt: skip

    start = Combination(tricks, setup, layout)
    start_verdict = measure(start)
    current, before_zero, steps, passed, zeroed = start, start, [], [], False
    for tool in TOOLS:
        base = before_zero if tool is use_offload else current
        applied = tool(model, gpu, base, measure)
        if applied is None:
            continue
        name, change, what = applied
        try:
            steps.append(step(name, what, change, base, tool in FREE))
        except InputError:  # the change leaves what the verdict can answer (sac with accumulation): no tool here
            continue
        zeroed = zeroed or tool is use_zero
        if not steps[-1].kept:
            passed.append((name, change, before_zero))
            continue
        if steps[-1].verdict.fits and tool is not use_zero:
            break
        if tool is not use_zero:
            before_zero = steps[-1].combination
        current = steps[-1].combination
    for name, change, base in passed if zeroed else ():  # under ZeRO, what the state hid on the GPUs you had
        zero = use_zero(model, gpu, change(base), measure)
        if zero is not None:
            try:
                steps.append(step(f"{name}, then {zero[0]}", zero[2], lambda c, z=zero[1], ch=change: z(ch(c)), base,
                                  False))  # fmt: skip
            except InputError:
                continue
    return Toolbox(start_verdict, tuple(steps))


def cost(model: Model, gpu: GPU, c: Combination, timing: Calibration | float | None) -> float:
    """GPU-seconds per token: GPUs x step time / tokens per step, timed as estimate times the job."""
    t = layout_estimate(model, c.setup, gpu, c.tricks, c.layout, ends_only=True, timing=timing).time
    return c.layout.world * t.step_seconds / t.tokens_per_step
