"""Counting bytes without a CUDA allocator: live storages, and tensors saved for backward.

LiveBytes is a TorchDispatchMode: every op's output storage on the watched device type is counted
from the op that creates it until the storage is freed (a weakref.finalize on the storage object,
which PyTorch keeps for exactly the storage's lifetime). Storages made before the mode was entered
(parameters, buffers, inputs) must be registered with track() first, or the first view of a weight
would count as a new tensor. It sees what the dispatcher sees: on meta, everything there is; on
CUDA it would miss a kernel's private workspace, which is why CUDA is measured with its allocator.

SavedBytes is a pair of saved_tensors_hooks: it records each storage saved for backward once
(views of one storage, and tensors saved by several ops, are counted once), leaving out the
storages of parameters, buffers and inputs. data_ptr() is 0 on meta, so storages are told apart by
identity (_cdata); the pack hook holds each storage until forward ends, so no address is reused.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def unwrapped(cls: type) -> bool:
    """A tensor subclass whose ops are counted by what it runs on its plain tensors (torchao's
    Float8TrainingTensor: its mm lays out and scales its float8 data, allocating on the way)."""
    return cls.__module__.startswith("torchao.")


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """Live bytes on one device type, the peak since reset_peak(), and where the peak happened."""

    def __init__(self, device_type: str, timeline: bool = False, addresses: bool = False):
        super().__init__()
        self.device_type = device_type
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_at = ""  # "phase: op" at the peak
        self.phase = ""  # set by the caller: forward, backward, optimizer...
        self.sizes: dict[int, int] = {}  # storage key -> bytes
        self.creators: dict[int, str] = {}  # storage key -> op that made it
        self.timeline: list[tuple[str, str, int, int]] | None = [] if timeline else None  # (phase, op, ±bytes, live)
        # (±bytes, data_ptr) of every storage made and freed, for real tensors (tests/test_tracker.py)
        self.events: list[tuple[int, int]] | None = [] if addresses else None
        self.ptrs: dict[int, int] = {}

    def track(self, tensors: Iterable[torch.Tensor], label: str = "registered") -> None:
        """Count tensors made outside the mode: parameters, buffers, inputs."""
        for t in tensors:
            if t is not None and t.device.type == self.device_type:
                self._add(t.untyped_storage(), label)

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_at = self.live_bytes, self.phase + ": (start)"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(unwrapped(t) for t in types):  # the subclass's own ops reach this mode: it counts what they make
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._add(t.untyped_storage(), name)
        return out

    def _add(self, storage: torch.UntypedStorage, op: str) -> None:
        key, size = storage._cdata, storage.nbytes()
        old = self.sizes.get(key)
        if old == size:
            return
        if old is None:
            weakref.finalize(storage, self._free, key)
            self.creators[key] = op
            if self.events is not None:
                self.ptrs[key] = storage.data_ptr()
                self.events.append((size, self.ptrs[key]))
        self.sizes[key] = size
        self.live_bytes += size - (old or 0)
        if self.timeline is not None:
            self.timeline.append((self.phase, op, size - (old or 0), self.live_bytes))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: {op}"

    def _free(self, key: int) -> None:
        size = self.sizes.pop(key)
        self.live_bytes -= size
        op = self.creators.pop(key, "?")
        if self.events is not None:
            self.events.append((-size, self.ptrs.pop(key)))
        if self.timeline is not None:
            self.timeline.append((self.phase, "free " + op, -size, self.live_bytes))

    @contextlib.contextmanager
    def over(self, mode: contextlib.AbstractContextManager):
        """mode (a dispatch mode, or FlopCounterMode) entered beneath this one (every op reaches LiveBytes first): an op
        that mode decomposes, as FlopCounterMode decomposes aten.silu_backward, is still one op here. gc stays off.
        Called while this mode is the one entered last, as it is between ops."""
        super().__exit__(None, None, None)
        try:
            with mode:
                super().__enter__()
                try:
                    yield mode
                finally:
                    super().__exit__(None, None, None)
        finally:
            super().__enter__()

    def __enter__(self):
        gc.collect()  # storages in old reference cycles would otherwise be freed mid-measurement
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc):
        gc.enable()
        return super().__exit__(*exc)


@dataclass(frozen=True)
class Saved:
    """One storage saved for backward."""

    nbytes: int
    dtype: str
    shape: tuple[int, ...]  # of the first tensor that saved it
    op: str  # the op that created it, when a LiveBytes mode was watching


class SavedBytes:
    """Bytes saved for backward during forward, one count per storage."""

    def __init__(self, exclude: Iterable[torch.Tensor], live: LiveBytes | None = None):
        self.excluded = {storage_key(t) for t in exclude if t is not None}
        self.live = live
        self.saved: dict[int, Saved] = {}  # one entry per storage saved, in order
        self.alive: dict[int, int] = {}  # storage key -> its entry, while the storage lives

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count a saved storage once; one freed during forward (saved by a node nothing needs, such as a
        checkpoint's _NoopSaveInputs in a frozen block) is let go, and a later storage at its key is new."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.excluded and key not in self.alive:
            op = self.live.creators.get(key, "?") if self.live is not None else "?"
            self.alive[key] = len(self.saved)
            self.saved[len(self.saved)] = Saved(storage.nbytes(), str(t.dtype).removeprefix("torch."),
                                                tuple(t.shape), op)  # fmt: skip
            weakref.finalize(storage, self.alive.pop, key, None)
        return t

    def keep(self, tensors) -> None:
        """Tensors kept for backward outside autograd's saved tensors: the outputs a selective
        checkpoint's policy keeps (verify/builder.py's sac_policy shows them here)."""
        for t in tensors:
            self.pack(t)

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self.pack, lambda t: t)

    def release(self) -> None:
        """Forget this forward's storages (call once forward is over): a later forward's are counted anew."""
        self.alive.clear()

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved.values())

    def by_op(self) -> dict[str, int]:
        """Saved bytes per (creating op, dtype, shape): the measured side of memcalc.exact's terms."""
        out: dict[str, int] = {}
        for s in self.saved.values():
            key = f"{s.op} {s.dtype} {list(s.shape)}"
            out[key] = out.get(key, 0) + s.nbytes
        return out
