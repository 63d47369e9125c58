"""The headroom's one line: what each fit verdict keeps back of the GPU, part by part, with its sources; the
caching allocator's line where the verdict replayed it; and, where a verdict that keeps the allocator's share
back sits within that share of the limit, what expandable_segments changes."""

from __future__ import annotations

from collections.abc import Iterable

from memcalc.model.headroom import Headroom

from . import units as u


def headroom_line(h: Headroom, units: str, verdicts: Iterable) -> str:
    """'Headroom 0.516 GB: CUDA context 0.447 GB (unsloth-zoo#1053) + ...; the rest PyTorch's caching allocator's
    ...', each part with its source; the allocator's share named where a verdict keeps it back (keeps_share)."""
    total = u.size(h.total_bytes, units)
    if h.given and not h.context_bytes:
        beside = f", and {h.colocated} {u.size(h.colocated_bytes, units)}" if h.colocated_bytes else ""
        return f"Headroom {total} kept back of each GPU, as --headroom {h.given} gives it{beside}"
    parts = [f"CUDA context {u.size(h.context_bytes, units)} (unsloth-zoo#1053)",
             f"cuBLAS {u.size(h.cublas_bytes, units)} (CublasHandlePool.cpp)"]  # fmt: skip
    if h.communicators:
        plural = "s" if h.communicators > 1 else ""
        parts.append(f"NCCL {u.size(h.nccl_bytes, units)} ({h.communicators} communicator{plural}, NCCL_BUFFSIZE)")
    if h.colocated_bytes:
        parts.append(f"{h.colocated} {u.size(h.colocated_bytes, units)}")
    share = f"{h.allocator_share:.0%} {u.size(h.allocator_bytes, units)}"
    if h.given:
        return f"Headroom {total}: " + " + ".join(parts + [f"allocator {share} (--headroom {h.given})"]) + "; docs/gpus.md"
    kept = any(v.keeps_share for v in verdicts)
    rest = "; the rest the caching allocator's, replayed when close"
    if kept:
        rest += f"; a share of {share} kept back where it is not replayed (a default: GMLake measures 15%)"
    return f"Headroom {u.size(h.total_bytes - h.allocator_bytes, units)}: " + " + ".join(parts) + rest + "; docs/gpus.md"


def allocator_note(verdicts: Iterable, units: str = "gb", labels: Iterable[str] = ()) -> list[str]:
    """One line per verdict whose allocator was replayed: its reserve at the peak and the idle part of it, or
    where it ran out though the tensors fit; each named by its label, else by its tricks."""
    out = []
    verdicts = list(verdicts)
    for v, label in zip(verdicts, [*labels] or [v.tricks.label for v in verdicts], strict=True):
        r = v.reserved
        if r is None:
            continue
        mode = "expandable segments" if r.expandable else "segments as cudaMalloc gives them"
        if r.out_of_memory:
            out.append(f"  {label}: the tensors fit, but the caching allocator runs out ({r.out_of_memory}); "
                       f"it would reserve {u.size(r.reserved_bytes, units)} ({mode})")  # fmt: skip
        else:
            out.append(f"  {label}: the caching allocator reserves {u.size(r.reserved_bytes, units)} at most "
                       f"over two steps; {u.size(r.idle_bytes, units)} of its reserve is idle when the tensors peak "
                       f"({r.fragmentation:.1%}; {mode})")  # fmt: skip
    return out


def fragmentation_note(h: Headroom, verdicts: Iterable) -> list[str]:
    """One line where a verdict that keeps the allocator's share back fits, or misses, by less than that share
    (verdicts: each with free_bytes, negative when over, and keeps_share): there,
    how much the caching allocator reserves beyond the tensors decides it, and expandable_segments lowers that."""
    close = [v for v in verdicts if v.keeps_share and abs(v.free_bytes) < h.allocator_bytes]
    if not close:
        return []
    return [f"  within the allocator's {h.allocator_share:.0%} of the limit: PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True grows one segment instead of adding more, so freed blocks merge and less "
            "is reserved but unallocated (--expandable-segments)"]  # fmt: skip
