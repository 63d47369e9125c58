"""--timeline --trace FILE.json: the step in the Trace Event Format (JSON), which ui.perfetto.dev and
chrome://tracing open: per trick set a process with two counters over the step, the allocated bytes (the
Timeline's live bytes) and the bytes the caching allocator reserves for them (memcalc.exact.allocator,
replayed as the snapshot replays it: memcalc.report.snapshot), a thread with the phases and the peak, and a
thread with each event of the step named by its op.

The format's fields, as the Trace Event Format document defines them: "ph" C (counter: one track per
name, the args' values), X (complete: a slice from ts for dur), i (instant; "s": "t", on its thread) and M
(metadata: process_name, thread_name); ts and dur in microseconds. memcalc keeps no clock: event k of the
step (the chart's event number, from 1) runs from k - 1 to k microseconds and the bytes after it stand from
k; at 0 stand those the step starts with (the model state and the inputs).
"""

from __future__ import annotations

import json

from memcalc.exact.allocator.snapshot import Dump
from memcalc.exact.timeline import Timeline

PHASES, EVENTS = 1, 2  # the threads of a trick set's process


def trace_text(timelines, dumped: list[Dump]) -> str:
    """The trace as JSON text."""
    return json.dumps(trace_events(timelines, dumped), separators=(",", ":"))


def trace_events(timelines, dumped: list[Dump]) -> dict:
    """{"traceEvents": [...]}: each trick set's step as process k + 1; the names first, then in time order
    (a viewer need not sort them)."""
    events: list[dict] = []
    for k, (t, d) in enumerate(zip(timelines, dumped, strict=True)):
        pid = k + 1
        events += names(pid, f"{t.tricks.label} ({t.stack})")
        events += counters(pid, t, reserved_by_point(t, d))
        events += phase_slices(pid, t)
        events += event_slices(pid, t)
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))  # stable: a time's events keep their order
    return {"traceEvents": events,
            "otherData": {"memcalc": "one microsecond per event of the step (an allocation, or the frees between "
                                     "two); the bytes are the replay's"}}  # fmt: skip


def names(pid: int, process: str) -> list[dict]:
    """The process and its threads named (ph M)."""
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}]
    for tid, name in ((PHASES, "phases"), (EVENTS, "events")):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    return out


def reserved_by_point(t: Timeline, d: Dump) -> list[int]:
    """The reserved bytes as the step starts, then after each of its points (Dump.reserved_bytes is after
    each of the storages' events; a point's are its last event's)."""
    s = t.storages
    out = [d.reserved_bytes[s.start - 1] if s.start > 0 else 0] + [-1] * len(t.ops)
    for i in range(s.start, len(s.events)):
        out[s.points[i] + 1] = d.reserved_bytes[i]
    for k in range(1, len(out)):
        out[k] = out[k] if out[k] >= 0 else out[k - 1]  # a point with no allocator event (none on this GPU)
    return out


def counters(pid: int, t: Timeline, reserved: list[int]) -> list[dict]:
    """The allocated and reserved bytes at 0 (the step's start) and after each event (ph C)."""
    allocated = [t.start_bytes, *t.live_bytes]
    out = []
    for ts, (a, r) in enumerate(zip(allocated, reserved, strict=True)):
        out.append({"ph": "C", "name": "allocated", "pid": pid, "ts": ts, "args": {"bytes": a}})
        out.append({"ph": "C", "name": "reserved", "pid": pid, "ts": ts, "args": {"bytes": r}})
    return out


def phase_slices(pid: int, t: Timeline) -> list[dict]:
    """Each phase as a slice over its events (ph X), and the peak as an instant at its event (ph i)."""
    out = [{"ph": "X", "name": sp.phase, "cat": "phase", "pid": pid, "tid": PHASES, "ts": sp.start,
            "dur": sp.end - sp.start} for sp in t.phases]  # fmt: skip
    out.append({"ph": "i", "s": "t", "name": f"peak: {t.peak_at}", "cat": "peak", "pid": pid, "tid": PHASES,
                "ts": t.peak_index + 1, "args": {"bytes": t.peak_bytes, "what": t.peak_what}})  # fmt: skip
    return out


def event_slices(pid: int, t: Timeline) -> list[dict]:
    """Each event of the step as a one-microsecond slice named by its op (ph X): its bytes, what it is, its
    block."""
    rows = zip(t.ops, t.nbytes, t.live_bytes, t.what, t.layers, strict=True)
    return [{"ph": "X", "name": op, "cat": "free" if nbytes < 0 else "alloc", "pid": pid, "tid": EVENTS, "ts": i,
             "dur": 1, "args": {"bytes": nbytes, "live_bytes": live, "what": t.labels[what], "layer": layer}}
            for i, (op, nbytes, live, what, layer) in enumerate(rows)]  # fmt: skip
