"""What PyTorch's caching allocator reserves over a run's first two steps on one GPU (or one ZeRO rank): the
stack's step replayed at full depth with every allocation recorded (memcalc.exact.replay.meta, as --timeline
replays it), its allocations and frees, in order, through memcalc.exact.allocator; kept on disk between runs.

The model is taken as loaded: each tensor that lives into the first step is allocated once, in the order the
build makes it, and what the build makes and frees before the first step (ZeRO-3's whole weights before
sharding) never reaches the allocator: the libraries load straight into their shards. Both steps run: the
first makes the optimizer state among the blocks its activations left cached, the second runs on that cache.

On a card, the allocator has what the driver can give it (capacity): where the run's reserve outgrows it,
the allocator releases its cached segments and asks again, so the run may still fit (the reserve is then
the one at that capacity) or runs out of memory though the tensors alone fit (the reserve is the one it
would have taken with no limit, and out_of_memory says where it stopped).

Each step replays at most MICRO_BATCHES of its micro-batches: from the second on, each starts from the same live
tensors and allocates and frees the same ones in the same order, and by the third the allocator's reserve and
peaks have settled (tests/test_reserved_verdict.py holds them to a replay of every micro-batch). Replaying them
all grew with grad_accum (a micro-batch of 4,096 taken as 4,096 micro-batches of one ran out of host memory).
Only the count of the driver's segments can go on growing, where a tight capacity makes each micro-batch release
the cache and ask again: Reserved.segments counts those of the micro-batches replayed.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, replace

from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks

from .allocator.replay import Reserved, replay, replayed
from .base.config import StepConfig
from .growth import as_run
from .replay.zero import Sharding

# a step's micro-batches the allocator replays: the first, the second, and the third on the second's cache
MICRO_BATCHES = 3


def allocator_events(timeline: list, recording) -> tuple[list, list[int]]:
    """The allocator's events out of a recorded replay (memcalc.exact.sim.events.Recording): (key, ±bytes,
    stream: the one the storage was allocated on, Origin.stream), a free keyed by its allocation's index in the
    timeline, with each event's own index there; left out, the storages the build made and freed before the
    first step and those not on this GPU (recording.elsewhere)."""
    made = {f: a for a, f in recording.freed.items()}
    passing = {a for a, f in recording.freed.items() if f < recording.loaded} | recording.elsewhere
    events, at = [], []
    for i, (_, _, nbytes, _) in enumerate(timeline):
        key = i if nbytes > 0 else made.get(i)
        if nbytes == 0 or key in passing:
            continue
        events.append((key, nbytes, recording.origins[key].stream))
        at.append(i)
    return events, at


@functools.lru_cache(maxsize=1024)
def step_reserved(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                  stack: Stack = DEFAULT_STACK, optimizer: str = "adamw", sharding: Sharding | None = None,
                  capacity: int | None = None, expandable: bool = False) -> Reserved:  # fmt: skip
    """The allocator over the first two steps (at most MICRO_BATCHES micro-batches each), on a device that can give
    it `capacity` bytes (None: no limit)."""
    from .base.cache import remembered

    if sharding is not None and sharding.trivial:
        sharding = None
    grad_accum = min(grad_accum, MICRO_BATCHES)

    def run() -> dict:
        from .replay.meta import simulate  # here, not at import: a cached verdict never simulates

        run_as = as_run(tricks, shape.n_layers)
        cfg = StepConfig(shape, seq_len, micro_batch, run_as, stack, optimizer, grad_accum)
        _, g, mem = simulate(cfg, timeline=True, sharding=sharding)
        return asdict(reserved_over(mem.timeline, g.recording, capacity, expandable))

    key = (shape, seq_len, micro_batch, tricks, grad_accum, stack, optimizer, sharding, capacity, expandable)
    return Reserved(**remembered("reserved", key, run))


@functools.lru_cache(maxsize=1024)
def fsdp2_reserved(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, ranks: int,
                   reshard: bool | None, capacity: int | None = None, expandable: bool = False) -> Reserved:  # fmt: skip
    """The allocator over the first two steps of one FSDP2 rank of `ranks` (rank 0, as fsdp2_step replays
    it: memcalc.exact.replay.fsdp2, torchtitan's units, reshard_after_forward `reshard`, None its default),
    each allocation on the stream FSDP2 makes it on (memcalc.exact.replay.fsdp2_units: the all-gather
    copy-in stream, the reduce-scatter stream, the default); kept on disk between runs as step_reserved is."""
    from .base.cache import remembered

    def run() -> dict:
        from .replay.fsdp2 import fsdp2_phases  # here, not at import: a cached verdict never simulates

        _, mem = fsdp2_phases(shape, seq_len, micro_batch, tricks, ranks, reshard, timeline=True, warm_up=True)
        return asdict(reserved_over(mem.timeline, mem.recording, capacity, expandable))

    key = (shape, seq_len, micro_batch, tricks, ranks, reshard, capacity, expandable)
    return Reserved(**remembered("fsdp2-reserved", key, run))


def reserved_over(timeline: list, recording, capacity: int | None, expandable: bool) -> Reserved:
    """A recorded replay's allocations through the allocator (within), each event named by its op."""
    events, at = allocator_events(timeline, recording)
    return within(events, [timeline[i][1] for i in at], capacity, expandable)


def within(events: list, names: list[str], capacity: int | None, expandable: bool) -> Reserved:
    """The run with no limit where its reserve stays within capacity; else at capacity, where the released
    cache may let it fit; else (out of memory there) the reserve it would need, with where it stopped. Without
    expandable segments the run at capacity comes first: where the driver never refused it a segment, it is the
    run with no limit (the capacity enters only there), so one replay answers; expandable segments' address space
    follows the capacity (memcalc.exact.allocator.expandable), so there the run with no limit comes first."""
    if capacity is not None and not expandable:
        tight, refusals = replayed(events, capacity, False, names)
        if not refusals or not tight.out_of_memory:
            return tight
        free = replay(events, None, False, names)
        return replace(free, capacity_bytes=capacity, out_of_memory=tight.out_of_memory, short_bytes=tight.short_bytes)
    free = replay(events, None, expandable, names)
    if capacity is None or free.reserved_bytes <= capacity:
        return replace(free, capacity_bytes=capacity or 0)
    tight = replay(events, capacity, expandable, names)
    if not tight.out_of_memory:
        return tight
    return replace(free, capacity_bytes=capacity, out_of_memory=tight.out_of_memory, short_bytes=tight.short_bytes)
