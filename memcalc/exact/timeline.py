"""One training step's live memory, allocation by allocation: the replay's own events (memcalc.exact.replay.meta
simulate(timeline=True), at full depth, each allocation's origin noted by memcalc.exact.sim.events), so the
series' highest point is the peak that replay reaches, and the verdict's (memcalc.engine.answer checks).

A point is one allocation of the measured step (a warm-up, where the stack runs one, is left out), or the
frees between two allocations taken together (step_points): the op that made it ("free"), its bytes
(negative for frees), the live bytes just after it, the block it belongs to and what it is (labels:
weights, gradients, saved for backward by which op, a temporary of which phase). Its storages are the
same replay as the caching allocator sees it, from the model's build on (memcalc.report.snapshot and
trace_events export them through memcalc.exact.allocator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks

from .growth import as_run
from .replay.zero import Sharding
from .reserved import allocator_events
from .sim.events import Origin
from .sim.graph import layer_of

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Span:
    """One phase of the step: its allocations' indexes, start to end (exclusive)."""

    phase: str
    start: int
    end: int


@dataclass(frozen=True)
class LiveGroup:
    """Tensors live at the peak that are the same thing, in one or more blocks."""

    what: str
    layers: str  # the blocks they belong to ("0-31"; "" outside the blocks)
    tensors: int
    bytes: int


@dataclass(frozen=True)
class Storages:
    """The step's storages as the caching allocator sees them (memcalc.exact.reserved.allocator_events), from
    the model's build to the step's last point (parallel tuples, one entry per allocation or free); a free
    described by the allocation it frees."""

    events: tuple[tuple[int, int, int], ...]  # (key, ±bytes, stream): memcalc.exact.allocator.replay's events
    points: tuple[int, ...]  # the Timeline point each is in (a run of frees is one point); -1 before the step
    ops: tuple[str, ...]  # the op that made the storage
    what: tuple[int, ...]  # what the storage is: an index into labels
    layers: tuple[int | None, ...]  # the block it belongs to (None outside the blocks)
    labels: tuple[str, ...]

    @property
    def start(self) -> int:
        """The step's first event (those before it build the model and its state)."""
        return next(i for i, p in enumerate(self.points) if p >= 0)


@dataclass(frozen=True)
class Timeline:
    """One trick set's step, allocation by allocation (parallel tuples, one entry per point: an allocation, or
    the frees between two)."""

    tricks: Tricks
    stack: str
    start_bytes: int  # live as the step starts: the model state and the inputs
    end_bytes: int  # live after its last point
    ops: tuple[str, ...]  # the op that made it; "free" for frees
    nbytes: tuple[int, ...]  # its bytes (negative: freed)
    live_bytes: tuple[int, ...]  # live just after it
    layers: tuple[int | None, ...]  # the block it belongs to (None outside the blocks)
    what: tuple[int, ...]  # what it is: an index into labels
    labels: tuple[str, ...]
    phases: tuple[Span, ...]  # in order; forward and backward once per micro-batch; a phase with no point is left out
    peak_index: int  # the first point to reach the highest live bytes (an allocation)
    at_peak: tuple[LiveGroup, ...]  # what is live at the peak, grouped, the largest first
    storages: Storages | None = field(default=None, repr=False, compare=False, metadata={"json": False})  # exports'
    kinds: tuple[str, ...] = ()  # what is live, coarsely (KINDS' order, those the step holds)
    live_by_kind: tuple[tuple[int, ...], ...] = ()  # per kind, the bytes of it live just after each point
    micro_batches: int = 1  # the micro-batches drawn (forward and backward each)
    accumulated: int = 1  # the step's: from the third on each repeats the one before (memcalc.exact.reserved)

    @property
    def peak_bytes(self) -> int:
        return self.live_bytes[self.peak_index]

    @property
    def peak_phase(self) -> str:
        return phase_at(self.phases, self.peak_index)

    @property
    def peak_at(self) -> str:
        """'backward: mm', as the verdict names its peak."""
        return f"{self.peak_phase}: {self.ops[self.peak_index]}"

    @property
    def peak_what(self) -> str:
        return self.labels[self.what[self.peak_index]]


def phase_at(spans: tuple[Span, ...], index: int) -> str:
    return next(s.phase for s in spans if s.start <= index < s.end)


def step_timeline(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                  stack: Stack = DEFAULT_STACK, optimizer: str = "adamw", sharding: Sharding | None = None,
                  drawn: int | None = None) -> Timeline:  # fmt: skip
    """One GPU's step (sharding: one data-parallel rank's under ZeRO) replayed at full depth with every
    allocation recorded, as memcalc.exact.step's step_phases replays it (no warm-up where the reference
    recipe makes its first step's state instead); drawn: its first micro-batches only (all by default)."""
    from .replay.meta import simulate
    from .step import config

    cfg = config(shape, seq_len, micro_batch, as_run(tricks, shape.n_layers), grad_accum, stack, optimizer)
    _, g, mem = simulate(cfg, timeline=True, warm_up=False, sharding=sharding, drawn=drawn)
    return timeline_of(g, mem, tricks, stack.label)


def timeline_of(g, mem, tricks: Tricks, stack: str) -> Timeline:
    """The Timeline of a replay simulated with timeline=True (its graph and memory)."""
    return from_events(mem.timeline, g.recording, tricks, stack)


def step_points(timeline: list) -> tuple[list[tuple[str, str, int, int, list[int]]], int]:
    """The measured step's points out of a step's events (phase, op, ±bytes, live): each allocation, and
    each run of frees between two allocations of one phase as one point (op "free", the bytes freed, the live
    bytes after the run: the same whatever order the run's frees come in), as (phase, op, ±bytes, live, the
    events' indexes); and the step's first event (before it: the build and any warm-up). Events of no bytes
    (an empty storage) are left out; so is the teardown after the step."""
    first = next(i for i, e in enumerate(timeline) if e[0])
    last = max(i for i, e in enumerate(timeline) if e[0])
    points: list = []
    for i in range(first, last + 1):
        phase, op, nbytes, live = timeline[i]
        if not phase or nbytes == 0:
            continue
        if nbytes < 0 and points and points[-1][1] == "free" and points[-1][0] == phase:
            points[-1] = (phase, "free", points[-1][2] + nbytes, live, points[-1][4] + [i])
        else:
            points.append((phase, op if nbytes > 0 else "free", nbytes, live, [i]))
    return points, first


def from_events(timeline: list, recording, tricks: Tricks, stack: str) -> Timeline:
    """The measured step's points out of a replay's events (and its memcalc.exact.sim.events.Recording), each
    one described: an allocation by its origin, a run of frees by the origin of the largest storage it frees."""
    origins, freed = recording.origins, recording.freed
    points, first = step_points(timeline)
    made = {f: a for a, f in freed.items()}  # a free's event -> its allocation's
    labels: dict[str, int] = {}
    what, layers = [], []
    for _, op, _, _, events in points:
        allocation = events[0] if op != "free" else max((made[i] for i in events), key=lambda a: timeline[a][2])
        text, layer = describe(origins[allocation])
        what.append(labels.setdefault(text, len(labels)))
        layers.append(layer)
    live = tuple(p[3] for p in points)
    peak = live.index(max(live))
    kinds, by_kind = live_by_kind(timeline, origins, made, [p[4][-1] for p in points])
    return Timeline(tricks, stack, timeline[first][3] - timeline[first][2], points[-1][3],
                    tuple(p[1] for p in points), tuple(p[2] for p in points), live, tuple(layers), tuple(what),
                    tuple(labels), spans([p[0] for p in points]), peak,
                    live_at(points[peak][4][0], timeline, origins, freed),
                    storages_of(timeline, recording, [p[4] for p in points]), kinds, by_kind)  # fmt: skip


KINDS = ("weights", "fp32 master weights", "optimizer state", "gradients", "saved for backward", "temporaries",
         "inputs", "buffers")  # fmt: skip


def kind_of(o: Origin) -> str:
    """What describe() names an allocation, coarsely: one of KINDS."""
    if o.kind == "param":
        return "weights"
    if o.kind in ("buffer", "input"):
        return o.kind + "s"
    if o.kind == "state":
        return "fp32 master weights" if o.role == "master" else "optimizer state"
    if o.role == "gradient":
        return "gradients"
    return "saved for backward" if o.role == "saved" or o.kind == "cached" else "temporaries"


def live_by_kind(timeline: list, origins: dict[int, Origin], made: dict[int, int],
                 ends: list[int]) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:  # fmt: skip
    """The bytes of each kind live after each point (ends: each point's last event), summed event by event from
    the model's build (a free counted as the kind of the storage it frees): together, each point's live bytes."""
    totals = dict.fromkeys(KINDS, 0)
    out: list[list[int]] = [[] for _ in KINDS]
    k = 0
    for i, (_, _, nbytes, _) in enumerate(timeline[: ends[-1] + 1]):
        if nbytes:
            totals[kind_of(origins[i] if nbytes > 0 else origins[made[i]])] += nbytes
        while k < len(ends) and ends[k] == i:
            for series, kind in zip(out, KINDS):
                series.append(totals[kind])
            k += 1
    held = [j for j, series in enumerate(out) if any(series)]
    return tuple(KINDS[j] for j in held), tuple(tuple(out[j]) for j in held)


def storages_of(timeline: list, recording, point_events: list[list[int]]) -> Storages:
    """The allocator's events of a recorded replay up to the step's last point; point_events: each point's
    events (indexes into the timeline), in order."""
    point_of = {i: k for k, events in enumerate(point_events) for i in events}
    last = point_events[-1][-1]
    events, at = allocator_events(timeline[: last + 1], recording)
    labels: dict[str, int] = {}
    points, ops, what, layers = [], [], [], []
    for (key, _, _), i in zip(events, at):
        points.append(point_of.get(i, points[-1] if points else -1))  # in no point (before the step): the last's
        text, layer = describe(recording.origins[key])
        ops.append(recording.origins[key].op)
        what.append(labels.setdefault(text, len(labels)))
        layers.append(layer)
    return Storages(tuple(events), tuple(points), tuple(ops), tuple(what), tuple(layers), tuple(labels))


def spans(phases: list[str]) -> tuple[Span, ...]:
    """Runs of one phase, in order."""
    out, start = [], 0
    for k in range(1, len(phases) + 1):
        if k == len(phases) or phases[k] != phases[start]:
            out.append(Span(phases[start], start, k))
            start = k
    return tuple(out)


def describe(o: Origin) -> tuple[str, int | None]:
    """What an allocation is, and the block it belongs to."""
    if o.kind == "param":
        return "weights", layer_of(o.op)
    if o.kind in ("buffer", "input"):
        return o.kind + "s", None
    if o.kind == "state":
        if o.role == "master":
            return "fp32 master weights", layer_of(o.detail)
        return "optimizer state", layer_of(o.detail) if o.role == "state" else o.layer
    where = f"{o.scope} " if o.scope else ""
    if o.role == "gradient":
        return "gradients", layer_of(o.detail)
    if o.role == "saved" or o.kind == "cached":
        op, _, saved = o.detail.partition(": ")
        made = "recomputed, " if o.stage == "recompute" else ""
        return f"{made}saved for backward by {where}{op} ({saved})", o.layer
    return f"{o.stage or 'warm-up'} temporary: {where}{o.op}", o.layer


def live_at(index: int, timeline: list, origins: dict[int, Origin], freed: dict[int, int]) -> tuple[LiveGroup, ...]:
    """What is live just after allocation `index` (an index into the events), grouped by what it is."""
    groups: dict[str, list] = {}
    for i, origin in origins.items():
        if i <= index and freed.get(i, len(timeline)) > index:
            text, layer = describe(origin)
            group = groups.setdefault(text, [set(), 0, 0])
            group[0].add(layer)
            group[1] += 1
            group[2] += timeline[i][2]
    out = [LiveGroup(text, ranges(sorted(x for x in ls if x is not None)), n, b) for text, (ls, n, b) in groups.items()]
    return tuple(sorted(out, key=lambda g: -g.bytes))


def ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    for x in layers:
        if parts and x == parts[-1][1] + 1:
            parts[-1][1] = x
        else:
            parts.append([x, x])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in parts)
