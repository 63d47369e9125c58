"""Memory and step time against one swept input: --sweep seq=1024:65536 or micro-batch=1:64."""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.exact.allocator.replay import Reserved
from memcalc.memory.setup import Setup
from memcalc.model.gpus import GPU
from memcalc.model.headroom import Headroom, headroom
from memcalc.model.layout import Layout
from memcalc.model.shape import BINARY, DECIMAL, MAX_BATCH, MAX_SEQ, Model, check_positions, parse_count
from memcalc.model.tricks import Tricks
from memcalc.parallel.plan import layout_estimate
from memcalc.parallel.verdict import gpu_verdict
from memcalc.records import record
from memcalc.time.calibration import Calibration

# name -> Setup field, limit, suffixes (a sequence of 8k is 8,192 tokens)
SWEEPABLE = {"seq": ("seq_len", MAX_SEQ, BINARY), "micro-batch": ("micro_batch", MAX_BATCH, DECIMAL)}
MAX_POINTS = 64


@record(slots=True)
class SweepPoint:
    """One trick set at one value of the swept setting: its peak, whether it fits, its step time."""

    value: int
    tricks: Tricks
    memory_bytes: int  # what the verdict holds to the usable bytes (memcalc.parallel.verdict: total_bytes)
    fits: bool
    free_bytes: int  # what is left of its usable bytes (negative: over)
    reserved: Reserved | None  # the caching allocator replayed, where the verdict ran it
    keeps_share: bool  # its usable bytes keep the allocator's share back (memcalc.parallel.verdict)
    step_seconds: float
    tokens_per_second: float


@record(slots=True)
class Sweep:
    """A job's trick sets over a range of one setting (seq or micro-batch)."""

    name: str  # seq or micro-batch
    values: tuple[int, ...]
    gpu: str
    usable_bytes: int  # the least the points' verdicts may use (memcalc.parallel.verdict: usable_bytes)
    points: tuple[SweepPoint, ...]  # value-major: every trick set at the first value, then the next
    time_model: str = "roofline"  # or --mfu
    headroom: Headroom | None = None  # what usable_bytes keeps back, by part


def parse_sweep(spec: str) -> tuple[str, tuple[int, ...]]:
    """'seq=1024:65536' (doubling), 'seq=1024:8192:1024' (a step), or 'micro-batch=1,2,8'."""
    name, sep, values = spec.partition("=")
    name = name.strip().lower()
    if not sep or name not in SWEEPABLE:
        raise InputError(f"--sweep takes seq=A:B or micro-batch=A:B, got {spec!r}")
    _, limit, suffixes = SWEEPABLE[name]

    def count(text: str, what: str = name) -> int:
        return parse_count(text, what, limit, suffixes)

    if "," in values:
        points = tuple(count(v) for v in values.split(","))
    else:
        parts = values.split(":")
        if len(parts) not in (2, 3):
            raise InputError(f"--sweep {name}= takes A:B (doubling), A:B:STEP or a list A,B,C; got {values!r}")
        start, stop = count(parts[0]), count(parts[1])
        if stop < start:
            raise InputError(f"--sweep {name}: {stop} is below {start}")
        points = doubling(start, stop) if len(parts) == 2 else stepping(start, stop, count(parts[2], "step"))
    if len(points) > MAX_POINTS:
        raise InputError(f"--sweep gives {len(points)} points; at most {MAX_POINTS}")
    return name, points


def doubling(start: int, stop: int) -> tuple[int, ...]:
    out = [start]
    while out[-1] * 2 <= stop:
        out.append(out[-1] * 2)
    return tuple(out)


def stepping(start: int, stop: int, step: int) -> tuple[int, ...]:
    if (stop - start) // step + 1 > MAX_POINTS:
        raise InputError(f"--sweep gives {(stop - start) // step + 1} points; at most {MAX_POINTS}")
    return tuple(range(start, stop + 1, step))


def sweep(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...], name: str, values: tuple[int, ...],
          timing: Calibration | float | None = None, layout: Layout = Layout()) -> Sweep:  # fmt: skip
    """Memory (the verdict, as estimate gives it) and step time (timed as estimate times it: the roofline at
    the calibration, or --mfu's rate) at each value."""
    field = SWEEPABLE[name][0]
    points, usable = [], gpu.memory_bytes
    for value in values:
        at = replace(setup, **{field: value * (setup.per_sample if field == "micro_batch" else 1)})  # DPO: pairs
        check_positions(model.shape, at.seq_len)
        for tricks in trick_sets:
            verdict = gpu_verdict(model, at, gpu, tricks, layout)
            time = layout_estimate(model, at, gpu, tricks, layout, ends_only=True, timing=timing).time
            points.append(SweepPoint(value, tricks, verdict.total_bytes, verdict.fits, verdict.free_bytes,
                                     verdict.reserved, verdict.keeps_share, time.step_seconds, time.tokens_per_second))  # fmt: skip
            usable = min(usable, verdict.usable_bytes)
    time_model = "--mfu" if isinstance(timing, float) else "roofline"
    return Sweep(name, values, gpu.key, usable, tuple(points), time_model, headroom(gpu, layout.groups))
