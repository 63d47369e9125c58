"""The headroom's one line: what each fit verdict keeps back of the GPU, part by part, with its sources; and,
where a verdict sits within the allocator's share of the limit, what expandable_segments changes."""

from __future__ import annotations

from collections.abc import Iterable

from memcalc.model.headroom import Headroom

from . import units as u


def headroom_line(h: Headroom, units: str = "gb") -> str:
    """'Headroom 4.766 GB: CUDA context 0.447 GB (unsloth-zoo#1053) + ...', each part with its source."""
    total = u.size(h.total_bytes, units)
    if h.given and not h.context_bytes:
        return f"Headroom {total} kept back of each GPU, as --headroom {h.given} gives it"
    parts = [f"CUDA context {u.size(h.context_bytes, units)} (unsloth-zoo#1053)",
             f"cuBLAS {u.size(h.cublas_bytes, units)} (CublasHandlePool.cpp)"]  # fmt: skip
    if h.communicators:
        plural = "s" if h.communicators > 1 else ""
        parts.append(f"NCCL {u.size(h.nccl_bytes, units)} ({h.communicators} communicator{plural}, NCCL_BUFFSIZE)")
    why = f"--headroom {h.given}" if h.given else "a default, not a measurement: GMLake measures 15%"
    parts.append(f"allocator {h.allocator_share:.0%} {u.size(h.allocator_bytes, units)} ({why})")
    return f"Headroom {total}: " + " + ".join(parts) + "; docs/gpus.md"


def fragmentation_note(h: Headroom, free: Iterable[int]) -> list[str]:
    """One line where a verdict fits, or misses, by less than the allocator's share (free: each verdict's free
    bytes, negative when over): there, how much the caching allocator reserves beyond the tensors decides it,
    and expandable_segments lowers that."""
    close = [f for f in free if abs(f) < h.allocator_bytes]
    if not close:
        return []
    return [f"  within the allocator's {h.allocator_share:.0%} of the limit: PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True grows one segment instead of adding more, so freed blocks merge and less "
            "is reserved but unallocated"]  # fmt: skip
