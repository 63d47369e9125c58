"""verify --timeline: the measured step's live bytes at each event (verify/track.py's LiveBytes on meta
or CPU tensors) laid over the prediction's (memcalc.exact.timeline), and where they first differ.

An event (an allocation, or the frees between two: memcalc.exact.timeline.step_points) coincides when the
measured one is made by the same op, of the same bytes, with the same live bytes just after it (what
tests/replay.py holds the replay's allocations to).
"""

from __future__ import annotations

from memcalc.exact.timeline import Span, Timeline, spans, step_points
from memcalc.records import record


@record(frozen=True)
class Measured:
    """A measured step's events (parallel tuples) and its phases."""

    device: str  # meta | cpu
    ops: tuple[str, ...]
    nbytes: tuple[int, ...]
    live_bytes: tuple[int, ...]
    phases: tuple[Span, ...]
    start_bytes: int  # live as the step starts


def measured(timeline: list, device: str) -> Measured:
    """LiveBytes' events (phase, op, ±bytes, live) as the measured step's events (step_points: each allocation,
    the frees between two as one)."""
    points, first = step_points(timeline)
    return Measured(device, tuple(p[1] for p in points), tuple(p[2] for p in points), tuple(p[3] for p in points),
                    spans([p[0] for p in points]), timeline[first][3] - timeline[first][2])  # fmt: skip


@record(frozen=True)
class Overlay:
    """The prediction and the measurement of one step, event by event."""

    predicted: Timeline
    measured: Measured

    @property
    def differing(self) -> tuple[int, ...]:
        """The events where the two differ (op, bytes or live bytes), and those only one side makes."""
        p, m = self.predicted, self.measured
        n = min(len(p.ops), len(m.ops))
        out = [i for i in range(n)
               if (p.ops[i], p.nbytes[i], p.live_bytes[i]) != (m.ops[i], m.nbytes[i], m.live_bytes[i])]
        return tuple(out + list(range(n, max(len(p.ops), len(m.ops)))))

    @property
    def measured_marks(self) -> tuple[int, ...]:
        """The differing events the measured series has (where the prediction runs longer, its extra events
        are past the measurement's end: the first difference names them)."""
        return tuple(i for i in self.differing if i < len(self.measured.live_bytes))

    @property
    def coinciding(self) -> int:
        """How many events coincide."""
        return max(len(self.predicted.ops), len(self.measured.ops)) - len(self.differing)

    @property
    def first_difference(self) -> str:
        """Where the measurement first leaves the prediction, in words ("" where it never does)."""
        if not self.differing:
            return ""
        i, p, m = self.differing[0], self.predicted, self.measured
        return f"event {i + 1:,} differs: predicted {event_text(p, i)}; measured {event_text(m, i)}"


def event_text(s, i: int) -> str:
    """Event i of a series (a Timeline or Measured) in words."""
    return f"{s.ops[i]} of {s.nbytes[i]:,} B, live {s.live_bytes[i]:,} B" if i < len(s.ops) else "nothing"
