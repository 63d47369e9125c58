"""Bytes, and what holds them: Memory counts live bytes and their peaks (the whole step's, and each
segment's: a block's part of a phase, or what runs before the first block or after the last); a Storage
is bytes that exist while something refers to them (a c10 StorageImpl, freed by CPython's reference
count as a StorageImpl is freed by its own); a Tensor is a shape and dtype over a storage (views share
it), its grad_fn the memcalc.exact.sim.Node that made it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import ITEMSIZE

if TYPE_CHECKING:
    from .sim import Node


def nbytes(x) -> int:
    """Bytes a kernel moves for an operand: an int as given; a tensor's elements, but no more than
    its storage holds (an expanded view is read once)."""
    return x if x.__class__ is int else x.nbytes


@dataclass
class Memory:
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

    def alloc(self, nbytes: int, op: str) -> None:
        self.live_bytes += nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, op, nbytes, self.live_bytes))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: {op}"
        if self.live_bytes > self.segment_peaks.get(self.segment, (0, ""))[0]:
            self.segment_peaks[self.segment] = (self.live_bytes, f"{self.phase}: {op}")

    def free(self, nbytes: int, op: str) -> None:
        self.live_bytes -= nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, "free " + op, -nbytes, self.live_bytes))

    def enter(self, layer: int | None) -> None:
        """What runs from now on belongs to block `layer`, or (None) to before or after the blocks."""
        if layer is None:
            self.segment = "after" if self.blocks_seen else "before"
        else:
            if layer not in self.blocks_seen:
                self.blocks_seen.append(layer)
            self.segment = layer
        # a segment holds at least what is live on entering it (a fused optimizer's block allocates nothing)
        self.segment_peaks.setdefault(self.segment, (self.live_bytes, f"{self.phase}: (entering {self.segment})"))

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: (start)"
        self.segment, self.segment_peaks, self.blocks_seen = "before", {"start": (self.live_bytes, self.peak_at)}, []


class Storage:
    __slots__ = ("mem", "nbytes", "op", "kind")

    # kind: activation | param | buffer | input | state | cached (an activation a selective checkpoint keeps)
    def __init__(self, mem: Memory, nbytes: int, op: str, kind: str = "activation"):
        self.mem, self.nbytes, self.op, self.kind = mem, nbytes, op, kind
        mem.alloc(nbytes, op)

    def __del__(self) -> None:
        self.mem.free(self.nbytes, self.op)


class Tensor:
    __slots__ = ("storage", "shape", "dtype", "grad_fn", "output_nr", "grad", "name", "numel", "nbytes")

    def __init__(self, storage: Storage, shape, dtype: str, numel: int | None = None):
        self.storage, self.shape, self.dtype = storage, tuple(shape), dtype
        self.grad_fn: Node | None = None
        self.output_nr = 0
        self.grad: Tensor | None = None
        self.name = ""
        self.numel = elements(self.shape) if numel is None else numel
        # what a kernel reads or writes of it: its elements, no more than its storage (an expanded view)
        self.nbytes = min(self.numel * ITEMSIZE[dtype], storage.nbytes)

    @property
    def requires_grad(self) -> bool:
        return self.grad_fn is not None


def elements(shape) -> int:
    """The product of a shape as a plain int (a product of memcalc.exact's Syms would build a name)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n

