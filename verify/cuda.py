"""Measuring on a real device: CUDA with torch.cuda's allocator statistics and CUDA-event timing.

The same code runs on CPU with the LiveBytes tracker standing in for the allocator (CpuStats), so
CI exercises every line of the CUDA path without a GPU, including the fall-back to fewer layers
after an out-of-memory error (CpuStats can be given a memory limit).

Pitfalls handled here: without CUDA, torch.cuda.max_memory_allocated() silently returns 0, so the
CUDA stats are only made when torch.cuda.is_available(); fake 'cuda' tensors abort the process, so
nothing here fakes a device.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.errors import InputError
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks
from memcalc.verification.results import DevicePhases

from .builder import Kernels, build, materialise
from .meta import inputs_for, kernels_for, train_step
from .recipes import DTYPES, Recipe, TorchRecipe, recipe_for
from .track import LiveBytes

OOM = torch.cuda.OutOfMemoryError  # torch.OutOfMemoryError's CUDA name, present in every 2.x
SKIP_RETRIES = 8  # fp16 steps the loss scaler may skip (inf/nan grads) before one is measured


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def device_kernels(tricks: Tricks, device: str = "cuda") -> Kernels:
    """On CUDA: flash-attn where installed, else SDPA restricted to its flash backend; F.dropout
    (which is aten.native_dropout there). On CPU (the stand-in): aten.native_dropout by name, as on
    meta, since CPU's F.dropout keeps a 2-byte mask; no flash kernel."""
    if device != "cuda":
        if tricks.flash:
            raise InputError("flash attention needs CUDA (or the meta device)")
        return kernels_for(tricks, "eager", "native")
    attention = ("flash-attn" if flash_attn_available() else "sdpa-flash") if tricks.flash else "eager"
    return kernels_for(tricks, attention, "functional")


# -- allocator statistics ----------------------------------------------------------------------------


class CudaStats:
    """torch.cuda's caching-allocator counters and CUDA-event timing."""

    device = "cuda"

    def sync(self) -> None:
        torch.cuda.synchronize()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def max_reserved(self) -> int:
        return torch.cuda.max_memory_reserved()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info()[0]

    def context(self):
        return fp32_accumulation()

    def release(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    def time(self, fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@contextlib.contextmanager
def fp32_accumulation():
    """16-bit matmuls accumulate in fp32 (no reduced-precision split-K reductions)."""
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = old


class LimitedLiveBytes(LiveBytes):
    """LiveBytes that raises an out-of-memory error past a limit, like a full GPU."""

    def __init__(self, device_type: str, limit_bytes: int | None):
        super().__init__(device_type)
        self.limit_bytes = limit_bytes

    def _add(self, storage, op: str) -> None:
        super()._add(storage, op)
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            raise OOM(f"CpuStats: {self.live_bytes:,} bytes live, limit {self.limit_bytes:,}")


class CpuStats:
    """The allocator counters of CudaStats, for real CPU tensors, from the LiveBytes tracker."""

    device = "cpu"

    def __init__(self, limit_bytes: int | None = None):
        self.live = LimitedLiveBytes("cpu", limit_bytes)
        self.peak_reserved = 0

    def sync(self) -> None:
        pass

    def allocated(self) -> int:
        return self.live.live_bytes

    def max_allocated(self) -> int:
        return self.live.peak_bytes

    def max_reserved(self) -> int:
        return self.live.peak_bytes

    def reset_peak(self) -> None:
        self.live.reset_peak()

    def free_bytes(self) -> int:
        limit = self.live.limit_bytes
        return (limit - self.live.live_bytes) if limit is not None else 1 << 62

    def context(self):
        return self.live

    def release(self) -> None:
        gc.collect()

    def time(self, fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class AttentionOps(TorchDispatchMode):
    """Which attention kernels the dispatcher ran (the evidence for 'SDPA backend used')."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name or "flash" in name:
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


# -- one measurement ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRun:
    """One depth measured on the device."""

    layers: int
    phases: DevicePhases
    step_seconds: tuple[float, ...]  # the timed steps after warm-up
    attention_ops: tuple[str, ...]  # attention kernels seen in the first forward


def measure_device(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, stats, steps: int = 3,
                   grad_accum: int = 1, kernels: Kernels | None = None, stack: Stack = DEFAULT_STACK,
                   optimizer: str = "adamw") -> DeviceRun:  # fmt: skip
    """Build on meta, materialise on the device, one warm-up step, one measured step phase by phase,
    then `steps` timed steps, trained by the stack's recipe. Allocator counters are taken relative to
    before the build."""
    device = stats.device
    kernels = kernels or device_kernels(tricks, device)
    with stats.context():
        stats.sync()
        base = stats.allocated()
        model = materialise(build(shape, kernels, seq_len, DTYPES[tricks.precision]), device)
        stats.sync()
        after_build = stats.allocated() - base
        idx, targets = inputs_for(shape, seq_len, micro_batch, device)
        recipe = recipe_for(model, tricks.precision, stack, optimizer)
        probe = AttentionOps()
        with probe:
            loss = recipe.forward(idx, targets)
        recipe.backward(loss)
        del loss
        for _ in range(grad_accum - 1):
            loss = recipe.forward(idx, targets)
            recipe.backward(loss)
            del loss
        stepped = recipe.update()
        for _ in range(SKIP_RETRIES):  # fp16: until the loss scale lets a step through (m, v made)
            if stepped:
                break
            stepped = train_step(recipe, idx, targets, grad_accum)
        stats.sync()
        after_first = stats.allocated() - base
        for _ in range(SKIP_RETRIES):  # the measured step; again if the loss scaler skipped it
            phases = measured_step(recipe, idx, targets, grad_accum, stats, base)
            if recipe.skipped == phases[-1]:
                break
        retained, fwd, bwd, opt, reserved, _ = phases
        one_step = functools.partial(train_step, recipe, idx, targets, grad_accum)
        times = tuple(stats.time(one_step) for _ in range(steps))
        del one_step
        del model, recipe, idx, targets
    stats.release()
    phases = DevicePhases(after_build, after_first, retained, fwd, bwd, opt, reserved)
    return DeviceRun(shape.n_layers, phases, times, tuple(sorted(probe.ops)))


def measured_step(recipe: Recipe | TorchRecipe, idx, targets, grad_accum: int, stats, base: int) -> tuple:
    """One step phase by phase: (retained, forward, backward and optimizer peaks, reserved, skips before)."""
    skipped = recipe.skipped
    before = stats.allocated()
    fwd = bwd = reserved = 0
    retained = None
    for _ in range(grad_accum):
        stats.reset_peak()
        loss = recipe.forward(idx, targets)
        stats.sync()
        retained = stats.allocated() - before if retained is None else retained
        fwd, reserved = max(fwd, stats.max_allocated() - base), max(reserved, stats.max_reserved())
        stats.reset_peak()
        recipe.backward(loss)
        del loss
        stats.sync()
        bwd, reserved = max(bwd, stats.max_allocated() - base), max(reserved, stats.max_reserved())
    stats.reset_peak()
    recipe.update()
    stats.sync()
    opt, reserved = stats.max_allocated() - base, max(reserved, stats.max_reserved())
    return retained, fwd, bwd, opt, reserved, skipped


def measure_retained(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, stats,
                     kernels: Kernels | None = None) -> int:  # fmt: skip
    """Bytes one forward leaves alive (saved tensors and the loss): the second depth of the linearity check."""
    kernels = kernels or device_kernels(tricks, stats.device)
    with stats.context():
        model = materialise(build(shape, kernels, seq_len, DTYPES[tricks.precision]), stats.device)
        idx, targets = inputs_for(shape, seq_len, micro_batch, stats.device)
        stats.sync()
        before = stats.allocated()
        loss = model(idx, targets)
        stats.sync()
        retained = stats.allocated() - before
        del loss, model, idx, targets
    stats.release()
    return retained


def deepest_fit(shape: ModelShape, fits) -> int:
    """The most layers (at most shape.n_layers) for which fits(layers) holds; 0 if none."""
    lo, hi = 0, shape.n_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def with_layers(shape: ModelShape, layers: int) -> ModelShape:
    return shape if layers == shape.n_layers else replace(shape, n_layers=layers)


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")
