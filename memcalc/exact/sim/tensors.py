"""Bytes, and what holds them: LiveBytes counts live bytes and their peaks (the whole step's, and each
segment's: a block's part of a phase, or what runs before the first block or after the last); a Storage
is bytes that exist while something refers to them (a c10 StorageImpl, freed by CPython's reference
count as a StorageImpl is freed by its own); a Tensor is a shape and dtype over a storage (views share
it), its grad_fn the memcalc.exact.sim.graph.Node that made it.

Identical work is simulated once: a Storage or Tensor with `copies` > 1 stands for that many equal ones
(a layer's routed experts that receive the same number of tokens, their weights, gradients and optimizer
state), its storage holding all their bytes. Work that runs the copies one after another (each expert's
forward, its backward, the optimizer's per-tensor loop) runs once inside a Region, which turns the one
copy's allocations and frees into the peak the copies reach in turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..base.config import ITEMSIZE

if TYPE_CHECKING:
    from .graph import Node


def nbytes(x) -> int:
    """Bytes a kernel moves for an operand: an int as given; a tensor's elements, but no more than
    its storage holds (an expanded view is read once)."""
    return x if x.__class__ is int else x.nbytes


@dataclass
class LiveBytes:
    """Live bytes, and the peak since reset_peak() with the op that reached it; and the peak of each
    segment of the step (segment_peaks): a block's part of a phase, or what runs before the first
    block or after the last (memcalc.exact.growth.grown_phases grows two- and three-block steps from them)."""

    live_bytes: int = 0
    peak_bytes: int = 0
    peak_at: str = ""
    phase: str = ""
    timeline: list[tuple[str, str, int, int]] | None = None  # (phase, op, ±bytes, live) when recording
    segment: object = "before"  # a block's index, or "before" / "after" the blocks
    segment_peaks: dict = field(default_factory=dict)  # segment -> (its highest live bytes since reset_peak(), op)
    blocks_seen: list = field(default_factory=list)  # the blocks in the order the phase reached them
    segments: dict = field(default_factory=dict)  # phase -> (its segment_peaks, its blocks_seen), kept by the step
    region: Region | None = None  # copies run one after another, simulated once (open_region)

    def alloc(self, nbytes: int, op: str, copies: int = 1) -> None:
        self.live_bytes += nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, op, nbytes, self.live_bytes))
        if self.region is not None:
            self.region.note(nbytes, copies, op)
        else:
            self.reached(self.live_bytes, op)

    def free(self, nbytes: int, op: str, copies: int = 1) -> None:
        self.live_bytes -= nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, "free " + op, -nbytes, self.live_bytes))
        if self.region is not None:
            self.region.note(-nbytes, copies, op)

    def reached(self, live: int, op: str) -> None:
        """Live bytes at `live` just after op allocated: the step's and the segment's peaks, the first to
        reach a peak naming it."""
        if live > self.peak_bytes:
            self.peak_bytes, self.peak_at = live, f"{self.phase}: {op}"
        if live > self.segment_peaks.get(self.segment, (0, ""))[0]:
            self.segment_peaks[self.segment] = (live, f"{self.phase}: {op}")

    def open_region(self, copies: int) -> None:
        """What runs until close_region is one of `copies` equal copies run in turn (see Region)."""
        if self.region is not None or self.timeline is not None:
            raise RuntimeError("a region inside a region, or under a timeline (which replays every copy)")
        self.region = Region(copies, self.live_bytes, self.segment)

    def close_region(self) -> None:
        """The copies' peak, as they reached it in turn (Region.peaks), into the step's and the segment's."""
        region, self.region = self.region, None
        for live, op in region.peaks():
            self.reached(live, op)

    def enter(self, layer: int | None) -> None:
        """What runs from now on belongs to block `layer`, or (None) to before or after the blocks."""
        if layer is None:
            self.segment = "after" if self.blocks_seen else "before"
        else:
            if layer not in self.blocks_seen:
                self.blocks_seen.append(layer)
            self.segment = layer
        if self.region is not None and self.segment != self.region.segment:
            if self.region.events:
                raise RuntimeError("a region's copies run inside one segment")
            self.region.segment = self.segment  # entered as the first copy starts: a per-tensor loop's layer
        # a segment holds at least what is live on entering it (a fused optimizer's block allocates nothing)
        self.segment_peaks.setdefault(self.segment, (self.live_bytes, f"{self.phase}: (entering {self.segment})"))

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: (start)"
        self.segment, self.segment_peaks, self.blocks_seen = "before", {"start": (self.live_bytes, self.peak_at)}, []


@dataclass
class Region:
    """`copies` equal copies of some work run one after another, simulated once: each allocation or free of
    a storage of that many copies is one copy's share, made by every copy in turn; a free of a single
    storage (one the copies share, such as the tensor their inputs are views of) is the last copy's, as
    the last to let go frees it. Simulated once, the copies' allocations land together; their peak is
    what they reach in turn (peaks)."""

    copies: int
    start: int  # live bytes as the first copy starts
    segment: object  # the segment it runs in (LiveBytes.enter)
    events: list = field(default_factory=list)  # (bytes per copy, bytes of the last copy alone, op)

    def note(self, nbytes: int, copies: int, op: str) -> None:
        if copies == self.copies:
            self.events.append((nbytes // copies, 0, op))
        elif copies == 1 and nbytes < 0:
            self.events.append((0, nbytes, op))
        else:
            raise RuntimeError(f"{op}: {copies} copies allocated or freed in a region of {self.copies}")

    def peaks(self) -> list[tuple[int, str]]:
        """The highest live bytes of the copies run in turn, with the op that first reaches it: copy j
        starts at start + j·D (D: one copy's net bytes), so of the copies before the last the highest is
        the first (D <= 0) or the last but one; the last adds the shared frees."""
        net = sum(each for each, _, _ in self.events)
        out = []
        if self.copies >= 2:
            out.append(self.highest(self.start + (self.copies - 2 if net > 0 else 0) * net, False))
        out.append(self.highest(self.start + (self.copies - 1) * net, True))
        return [(live, op) for live, op in out if op]

    def highest(self, start: int, last: bool) -> tuple[int, str]:
        """One copy's highest live bytes from `start`, and the first op to reach them ("" if none rises)."""
        live, top, at = start, start, ""
        for each, once, op in self.events:
            live += each + (once if last else 0)
            if live > top:
                top, at = live, op
        return top, at


class Storage:
    __slots__ = ("mem", "nbytes", "op", "kind", "copies", "__weakref__")

    # kind: activation | param | buffer | input | state | cached (an activation a selective checkpoint keeps)
    # nbytes: all its copies' bytes (see Region)
    def __init__(self, mem: LiveBytes, nbytes: int, op: str, kind: str = "activation", copies: int = 1):
        self.mem, self.nbytes, self.op, self.kind, self.copies = mem, nbytes, op, kind, copies
        mem.alloc(nbytes, op, copies)

    def __del__(self) -> None:
        self.mem.free(self.nbytes, self.op, self.copies)


class Tensor:
    __slots__ = ("storage", "shape", "dtype", "grad_fn", "output_nr", "grad", "name", "numel", "nbytes", "copies")

    def __init__(self, storage: Storage, shape, dtype: str, numel: int | None = None, copies: int | None = None):
        self.storage, self.shape, self.dtype = storage, tuple(shape), dtype
        self.grad_fn: Node | None = None
        self.output_nr = 0
        self.grad: Tensor | None = None
        self.name = ""
        self.numel = elements(self.shape) if numel is None else numel
        # how many equal tensors it stands for: its storage's, or a view's of one storage each copy reads part of
        self.copies = storage.copies if copies is None else copies
        # what a kernel reads or writes of one copy: its elements, no more than one copy's storage (an expanded view)
        self.nbytes = min(self.numel * ITEMSIZE[dtype], storage.nbytes // storage.copies)

    @property
    def requires_grad(self) -> bool:
        return self.grad_fn is not None


def elements(shape) -> int:
    """The product of a shape as a plain int (a product of memcalc.exact's Syms would build a name)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n

