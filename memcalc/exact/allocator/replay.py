"""A run's allocations and frees, in order, through the caching allocator (memcalc.exact.allocator.caching):
the most it reserves, the most it hands out, how much of the reserve lies idle at its peak, and whether
the driver runs out first.

An event is (key, bytes, stream): bytes > 0 allocates a tensor's storage under key, bytes < 0 frees the one
under key; a storage of no bytes never reaches the allocator (CUDACachingAllocator::allocate returns no
block for size 0). stream: the CUDA stream the storage was allocated on (0, the default stream, unless a
library allocates on its own: FSDP2's all-gather and reduce-scatter streams).
"""

from __future__ import annotations

from collections.abc import Iterable

from memcalc.records import record

from .caching import CachingAllocator, OutOfMemory, allocation_size


@record(frozen=True)
class Reserved:
    """What the caching allocator holds over a run on one GPU."""

    reserved_bytes: int  # its peak reserved (torch.cuda.max_memory_reserved)
    allocated_bytes: int  # its peak allocated: blocks as handed out, rounded (torch.cuda.max_memory_allocated)
    requested_bytes: int  # the peak of the tensors' own bytes (what memcalc's replay counts)
    idle_bytes: int  # reserved but not allocated when the allocated bytes peaked: rounding, splits, cached blocks
    segments: int  # segments taken from the driver (cudaMalloc calls; with expandable segments, mappings)
    expandable: bool  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    capacity_bytes: int  # what the driver could give (0: no limit)
    out_of_memory: str  # "" if the run completes; else the event that found no room, and why
    short_bytes: int = 0  # what the driver lacked there: the segment asked less the room left (0 if none ran out)

    @property
    def fragmentation(self) -> float:
        """The share of the reserve that lies idle when the allocated bytes peak."""
        return self.idle_bytes / (self.allocated_bytes + self.idle_bytes) if self.allocated_bytes else 0.0


def replay(events: Iterable[tuple], capacity: int | None = None, expandable: bool = False,
           names: list[str] | None = None, trace: list | None = None) -> Reserved:  # fmt: skip
    """The events through one device's allocator; capacity: the bytes the driver can give it (None: no limit).
    names: each event's op, to say where an out-of-memory happened. trace: where given, a list the allocator
    appends each of its actions to, (action, address, bytes, stream), with ("event", i, 0, 0) before each
    event's own (CachingAllocator.note)."""
    return replayed(events, capacity, expandable, names, trace)[0]


def replayed(events: Iterable[tuple], capacity: int | None = None, expandable: bool = False,
             names: list[str] | None = None, trace: list | None = None) -> tuple[Reserved, int]:  # fmt: skip
    """replay's result, and how many times the driver refused a segment on the way (0: the run never met the
    capacity, so it is the run with no limit, to the byte)."""
    a = CachingAllocator(capacity, expandable, trace)
    run = drive(a, events, names)
    return Reserved(a.peak_reserved_bytes, a.peak_allocated_bytes, run.peak_requested_bytes,
                    a.reserved_at_allocated_peak - a.peak_allocated_bytes, a.segments, expandable,
                    capacity or 0, run.out_of_memory, run.short_bytes), a.refusals  # fmt: skip


@record(frozen=True)
class Run:
    """The events driven through an allocator: the blocks live after them, by the events' keys."""

    live: dict
    peak_requested_bytes: int  # the peak of the tensors' own bytes
    out_of_memory: str  # "" if every event ran; else the event that found no room, and why
    short_bytes: int = 0  # the segment the failed event asked the driver for, less the room it had left


def drive(a: CachingAllocator, events: Iterable[tuple], names: list[str] | None = None) -> Run:
    """The events through allocator a, in order (stopping at an out-of-memory)."""
    live: dict = {}
    requested = peak_requested = 0
    oom, short = "", 0
    for i, (key, nbytes, stream) in enumerate(events):
        if a.trace is not None:
            a.trace.append(("event", i, 0, 0))
        if nbytes > 0:
            try:
                live[key] = a.malloc(nbytes, stream)
            except OutOfMemory as e:
                where = names[i] if names else f"event {i}"
                oom = f"{where}: {e.size:,} bytes asked, {e.reserved:,} reserved, {e.allocated:,} allocated"
                short = max(1, allocation_size(e.size) - (a.capacity - e.reserved))
                break
            requested += nbytes
            peak_requested = max(peak_requested, requested)
        elif nbytes < 0:
            a.free(live.pop(key))
            requested += nbytes
    return Run(live, peak_requested, oom, short)
