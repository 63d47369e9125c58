"""The headroom's one line: what each fit verdict keeps back of the GPU, part by part, with its sources."""

from __future__ import annotations

from memcalc.model.headroom import Headroom

from . import units as u


def headroom_line(h: Headroom, units: str = "gb") -> str:
    """'Headroom 4.894 GB kept back: CUDA context ... + allocator 5% ...', each part with its source."""
    total = u.size(h.total_bytes, units)
    if h.given and not h.context_bytes:
        return f"Headroom {total} kept back of each GPU, as --headroom {h.given} gives it"
    comms = f"{h.communicators} communicator{'s' if h.communicators != 1 else ''}"
    share = (f"--headroom {h.given}" if h.given
             else "a default, not a measurement: GMLake measures 15%; --headroom sets it")
    nccl = f" + NCCL {u.size(h.nccl_bytes, units)} ({comms}, NCCL_BUFFSIZE)" if h.communicators else ""
    return (f"Headroom {total} kept back: CUDA context {u.size(h.context_bytes, units)} (unsloth-zoo#1053)"
            f" + cuBLAS {u.size(h.cublas_bytes, units)} (CublasHandlePool.cpp){nccl}"
            f" + allocator {h.allocator_share:.0%} {u.size(h.allocator_bytes, units)} ({share}; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lowers it; docs/gpus.md)")
