"""--timeline --snapshot FILE.pickle: the step's memory as PyTorch's own snapshot, the dict
torch.cuda.memory._snapshot() returns, pickled as torch.cuda.memory._dump_snapshot(filename) pickles it
(torch/cuda/memory.py `_snapshot`, `_dump_snapshot`), with the standard library's pickle: it opens in
pytorch.org/memory_viz and in torch.cuda._memory_viz (trace_plot, segment_plot, memory, segments).

Its addresses, segments and blocks are memcalc.exact.allocator's: the caching allocator replayed over the
Timeline's storages (Timeline.storages, from the model's build on), its trace recorded from the step's
first event (as torch.cuda.memory._record_memory_history would be called just before the step) and its
segments as they stand after the step's last event (the state when _dump_snapshot is called: the step's
end, not its peak). The allocator has no limit here, as the Timeline has none. A trick set is a device:
device k holds the k-th trick set's step (memory_viz picks one at a time).

A stack (frames) is memcalc's account of the storage, not Python's: innermost first, as torch's
CapturedTraceback gives it, [{filename: what it is, line: its event in the step, name: the op that made
it}, {filename: the phase, line: 0, name: the block}]; a free carries its allocation's, as the allocator's
free does with no context of its own (CUDACachingAllocator.cpp `free`: context ? context :
block->context_when_allocated).
"""

from __future__ import annotations

import pickle

from memcalc.exact.allocator.snapshot import Dump, SegmentState, dump
from memcalc.exact.timeline import Timeline, phase_at


def dumps(timelines) -> list[Dump]:
    """Each Timeline's storages through the caching allocator, traced from the step's first event."""
    return [dump(list(t.storages.events), t.storages.start) for t in timelines]


def snapshot_bytes(timelines, dumped: list[Dump]) -> bytes:
    """The snapshot, pickled as _dump_snapshot pickles it (pickle.dump of the dict), at protocol 4: memory_viz's
    own unpickler reads protocols 2 to 4 (torch/utils/viz/MemoryViz.js `unpickle`), and Python's default may
    be newer."""
    return pickle.dumps(snapshot(timelines, dumped), protocol=4)


def snapshot(timelines, dumped: list[Dump]) -> dict:
    """_snapshot()'s dict: "segments" (every device's) and "device_traces" (one list per device)."""
    segments, traces = [], []
    for device, (t, d) in enumerate(zip(timelines, dumped, strict=True)):
        stacks = stacks_of(t)
        segments += [segment_dict(s, device, t, stacks) for s in d.segments]
        traces.append([trace_dict(entry, t, stacks) for entry in d.trace])
    return {"segments": segments, "device_traces": traces}


def stacks_of(t: Timeline) -> dict[int, list[dict]]:
    """Each allocation's frames, by its event key (one list each, shared by its allocation and its free)."""
    s = t.storages
    out = {}
    for i, (key, nbytes, _) in enumerate(s.events):
        if nbytes > 0:
            p = s.points[i]
            phase = phase_at(t.phases, p) if p >= 0 else "before the step"
            block = "outside the blocks" if s.layers[i] is None else f"block {s.layers[i]}"
            out[key] = [{"filename": s.labels[s.what[i]], "line": p + 1, "name": s.ops[i]},
                        {"filename": phase, "line": 0, "name": block}]  # fmt: skip
    return out


def segment_dict(s: SegmentState, device: int, t: Timeline, stacks: dict[int, list[dict]]) -> dict:
    """A Segment (torch/cuda/memory.py `_snapshot`'s TypedDict) and its blocks; every block active is
    allocated (no block waits on another stream), so active_size is allocated_size. Its frames: the
    allocation whose request took it from the driver (context_when_segment_allocated)."""
    maker = [] if s.made_by < 0 else stacks[t.storages.events[s.made_by][0]]
    return {
        "device": device, "address": s.address, "total_size": s.total_size, "allocated_size": s.allocated_size,
        "active_size": s.allocated_size, "requested_size": s.requested_size, "stream": s.stream,
        "segment_type": "small" if s.small else "large", "segment_pool_id": (0, 0), "is_expandable": s.expandable,
        "frames": maker,
        "blocks": [{"address": b.address, "size": b.size, "requested_size": b.requested_size,
                    "state": "inactive" if b.key is None else "active_allocated",
                    "frames": [] if b.key is None else stacks[b.key]} for b in s.blocks],
    }  # fmt: skip


def trace_dict(entry: tuple, t: Timeline, stacks: dict[int, list[dict]]) -> dict:
    """A TraceEntry (torch/cuda/memory.py `_snapshot`): the action, its address and bytes, the stream, the
    frames of the storage whose event made it; time_us: the event's place in the step (memcalc keeps no
    clock), the chart's event number."""
    action, addr, nbytes, stream, event = entry
    key = t.storages.events[event][0]
    return {"action": action, "addr": addr, "size": nbytes, "stream": stream, "time_us": t.storages.points[event] + 1,
            "frames": stacks[key]}  # fmt: skip
