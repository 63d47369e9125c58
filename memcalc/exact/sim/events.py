"""What each allocation of a simulated step is, for the timeline (memcalc.exact.timeline): which storage
was made when, by which op, in which block and part of the model, and what it turned out to be (saved for
backward, a parameter's gradient, a temporary), and when it was freed.

A Recording rides along a Graph whose LiveBytes keeps a timeline (memcalc.exact.replay.meta.simulate(timeline=True)):
Graph.storage() makes RecordedStorages through it, which note their allocation's index in the timeline and,
as they die, their free's. Nothing here runs in a step without a timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tensors import LiveBytes, Storage


@dataclass
class Origin:
    """One allocation: the storage's kind (activation, param, buffer, input, state, cached), the op that made
    it, the block (None outside them) and part of the model running, the phase (forward, backward,
    recompute: backward rebuilding a checkpointed region, optimizer; "" while building and in the
    warm-up), and its role once known
    ("saved" by an op; a parameter's "gradient", "master" copy or optimizer "state": memcalc.exact.timeline
    .describe names them)."""

    kind: str
    op: str
    layer: int | None
    scope: str
    stage: str
    role: str = ""  # "saved" | "gradient" | "master" | "state" (a parameter's optimizer state) | "" (as made)
    detail: str = ""  # what saved it ("mm: input"), or the parameter's name (its gradient, master, state)
    stream: int = 0  # the CUDA stream it was allocated on (Graph.stream): 0 the default


class RecordedStorage(Storage):
    """A storage that knows its allocation's place in the timeline, and notes its free's."""

    __slots__ = ("event", "recording")

    def __init__(self, recording: Recording, mem: LiveBytes, nbytes: int, op: str, kind: str, copies: int):
        super().__init__(mem, nbytes, op, kind, copies)
        self.recording, self.event = recording, len(mem.timeline) - 1

    def __del__(self) -> None:
        super().__del__()
        self.recording.freed[self.event] = len(self.mem.timeline) - 1


class Recording:
    """Every allocation's Origin (by its index in mem.timeline) and where each was freed."""

    def __init__(self, mem: LiveBytes):
        self.mem = mem
        self.origins: dict[int, Origin] = {}
        self.freed: dict[int, int] = {}  # allocation's index -> its free's index
        self.loaded = 0  # the timeline's length once the model, its state and the inputs are made
        self.elsewhere: set[int] = set()  # allocations not on this GPU: stand-ins, state kept in host memory

    def storage(self, g, nbytes: int, op: str, kind: str, copies: int) -> RecordedStorage:
        """A new storage of graph g, its origin noted from what g runs now."""
        s = RecordedStorage(self, self.mem, nbytes, op, kind, copies)
        stage = "recompute" if g.rebuilding is not None or g.recomputing else self.mem.phase
        self.origins[s.event] = Origin(kind, op, g.layer, g.scope, stage, stream=g.stream)
        return s

    def note(self, storage: Storage, role: str, detail: str) -> None:
        """What a storage turned out to be (Origin.role): saved for backward (detail: the op and what), or the
        gradient, master copy or optimizer state of the parameter named detail. The first role sticks (a
        gradient saved later stays a gradient)."""
        origin = self.origins.get(getattr(storage, "event", -1))
        if origin is not None and not origin.role:
            origin.role, origin.detail = role, detail
