"""Memory and step time against one swept input: --sweep seq=1024:65536 or micro-batch=1:64."""

from __future__ import annotations

from dataclasses import dataclass, replace

from memcalc.errors import InputError
from memcalc.memory.estimate import Setup, compute_for, memory_for
from memcalc.model.gpus import GPU
from memcalc.model.shape import BINARY, DECIMAL, MAX_BATCH, MAX_SEQ, Model, check_positions, parse_count
from memcalc.model.tricks import Tricks

from .calibration import Calibration
from .roofline import step_times

# name -> Setup field, limit, suffixes (a sequence of 8k is 8,192 tokens)
SWEEPABLE = {"seq": ("seq_len", MAX_SEQ, BINARY), "micro-batch": ("micro_batch", MAX_BATCH, DECIMAL)}
MAX_POINTS = 64


@dataclass(slots=True)
class SweepPoint:
    value: int
    tricks: Tricks
    memory_bytes: int  # peak per GPU: model state + activations + logits (+ ZeRO-3 buffers)
    fits: bool
    step_seconds: float
    tokens_per_second: float


@dataclass(slots=True)
class Sweep:
    name: str  # seq or micro-batch
    values: tuple[int, ...]
    gpu: str
    usable_bytes: int
    points: tuple[SweepPoint, ...]  # value-major: every trick set at the first value, then the next
    time_model: str = "roofline"  # or --mfu


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


def sweep(model: Model, setup: Setup, gpu: GPU, trick_sets: tuple[Tricks, ...], name: str,
          values: tuple[int, ...], cal: Calibration | None = None) -> Sweep:  # fmt: skip
    """Memory and step time at each value: the roofline's time under cal, else --mfu's."""
    field = SWEEPABLE[name][0]
    for tricks in trick_sets:  # the sweep charts the textbook's memory (memory_for)
        if tricks.recompute == "op":
            raise InputError(f"--sweep charts the textbook's memory, which has no formula for {tricks.label}")
    points = []
    for value in values:
        at = replace(setup, **{field: value})
        check_positions(model.shape, at.seq_len)
        if cal is None:
            times = tuple(compute_for(model, at, gpu, tricks) for tricks in trick_sets)
        else:
            times = step_times(model, at, gpu, trick_sets, cal)
        for tricks, time in zip(trick_sets, times):
            memory = memory_for(model, at, gpu, tricks)[3]
            points.append(SweepPoint(value, tricks, memory.total_bytes, memory.fits, time.step_seconds,
                                     time.tokens_per_second))  # fmt: skip
    return Sweep(name, values, gpu.key, gpu.usable_bytes, tuple(points), "--mfu" if cal is None else "roofline")
