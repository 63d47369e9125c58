"""The allocator as torch.cuda.memory._snapshot() reports it: its trace, recorded from one event on (as
torch.cuda.memory._record_memory_history starts recording), and its segments and their blocks after the
last event (the state when the snapshot is taken).

Read from c10/cuda/CUDACachingAllocator.cpp @ 001074d25084fdb87a799823e395a50f5ec044d3: snapshot() reports a
segment from each head block (a block whose previous one is not mapped: an expandable segment's mapped runs
each count as one), its blocks walked in address order while they are mapped; a block is allocated, or
inactive (cached, free).
"""

from __future__ import annotations

from memcalc.records import record

from .caching import CachingAllocator
from .replay import drive

RESERVING = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}  # reserved_bytes' changes


@record(frozen=True)
class BlockState:
    """One block of a segment (snapshot's BlockInfo)."""

    address: int
    size: int
    requested_size: int  # what was asked for, before rounding (0 for an inactive block)
    key: object  # the event key of the storage it holds (None: inactive)


@record(frozen=True)
class SegmentState:
    """One segment (snapshot's SegmentInfo): a cudaMalloc'd range, or an expandable segment's mapped run."""

    address: int
    stream: int
    small: bool  # segment_type "small" (the small pool's) or "large"
    expandable: bool
    blocks: tuple[BlockState, ...]
    made_by: int  # the event whose request took it from the driver (-1: not on the trace)

    @property
    def total_size(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def allocated_size(self) -> int:
        return sum(b.size for b in self.blocks if b.key is not None)

    @property
    def requested_size(self) -> int:
        return sum(b.requested_size for b in self.blocks)


@record(frozen=True)
class Dump:
    """What a snapshot taken after the last event holds, the trace recorded from event `start` on."""

    trace: tuple[tuple[str, int, int, int, int], ...]  # (action, address, bytes, stream, event), in order
    segments: tuple[SegmentState, ...]  # in address order (snapshot sorts them so)
    reserved_bytes: tuple[int, ...]  # reserved after each event, from the first (not only the traced)


def dump(events: list[tuple], start: int = 0, expandable: bool = False) -> Dump:
    """The events (memcalc.exact.allocator.replay's) through an allocator with no limit, its trace kept from
    event `start` on; the segments it holds after the last."""
    trace: list = []
    a = CachingAllocator(None, expandable, trace)
    run = drive(a, events)
    kept, reserved, made, event, now = [], [], {}, -1, 0
    for action, addr, nbytes, stream in trace:
        if action == "event":
            if addr > 0:
                reserved.append(now)
            event = addr
            continue
        now += RESERVING.get(action, 0) * nbytes
        if action in ("segment_alloc", "segment_map"):
            made.setdefault(addr, event)
        if event >= start:
            kept.append((action, addr, nbytes, stream, event))
    reserved.append(now)
    return Dump(tuple(kept), tuple(segments_of(a, run.live, made)), tuple(reserved))


def segments_of(a: CachingAllocator, live: dict, made: dict[int, int]) -> list[SegmentState]:
    """snapshot(): every block (get_all_blocks: the pools' cached blocks and the allocated ones, live by key),
    a segment from each head block; made: the event that took each segment's address from the driver."""
    keys = {id(b): k for k, b in live.items()}
    blocks = [b for pool in a.pools.values() for b in pool.blocks.values()] + list(live.values())
    out = []
    for head in sorted(blocks, key=lambda b: b.addr):
        if head.prev is not None and head.prev.mapped:  # "if (head_block->prev && head_block->prev->mapped)"
            continue
        run = []
        b = head
        while b is not None and b.mapped:
            key = keys.get(id(b))
            run.append(BlockState(b.addr, b.size, b.requested if key is not None else 0, key))
            b = b.next
        out.append(SegmentState(head.addr, head.stream, head.small, head.expandable, tuple(run),
                                made.get(head.addr, -1)))  # fmt: skip
    return out
