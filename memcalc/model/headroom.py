"""What PyTorch holds on a GPU beyond what the step's tensors allocate, which every fit verdict keeps back:
usable = the card's memory (or --gpu-memory) - headroom.

  context    the CUDA (or HIP) context: driver state and the kernels loaded lazily, never seen by the allocator
  cublas     cuBLAS / hipBLAS(Lt) workspaces, one per (handle, stream): the forward's thread and autograd's
  nccl       NCCL's buffers for each communicator the layout opens (none on one GPU)
  allocator  the caching allocator's rounding and fragmentation: reserved but not allocated, a default share

The first three leave the caching allocator its room (allocator_room): where memcalc.exact replays the step,
the verdict replays the allocator in that room (memcalc.parallel.verdict) and keeps no share back for it; the
share is for the verdicts the textbook decides.
--headroom SIZE replaces the whole account with SIZE; --headroom 10% keeps the parts and sets the allocator's
share; --headroom 0 keeps nothing back (planning to the last byte). Either way the share is then every
verdict's, and the allocator is not replayed.
"""

from __future__ import annotations

import math
from functools import lru_cache

from memcalc.errors import InputError
from memcalc.records import record

from .gpus import GPU, MAX_MEMORY_MIB, MIB
from .sizes import parse_bytes

# pytorch/pytorch#86509 (CUDA_MODULE_LOADING=LAZY, PyTorch's default since 1.13): 287,047,680 bytes used after a
# first tensor; unslothai/unsloth-zoo#1053: 426 MiB on an RTX 6000 Ada under PyTorch 2.10 + CUDA 13.0. The later
# figure on every card (no per-generation measurement is published; ROCm's HIP context likewise unmeasured).
CONTEXT_BYTES = 426 * MIB
CONTEXT_SOURCE = "CUDA context: 426 MiB measured under PyTorch 2.10 (unslothai/unsloth-zoo#1053), lazy loading"
# pytorch/pytorch aten/src/ATen/cuda/CublasHandlePool.cpp @ 26a39059ec580351411f180816c47e2ef5134ae1,
# parseChosenWorkspaceSize: ":4096:2:16:8" (8 MiB + 128 KiB) by default, 32 MiB on sm90; ROCm 32 MiB, 128 MiB on
# gfx94x/gfx95x. parseCUDABlasLtWorkspaceSize: 1 MiB for cuBLASLt (its own pool unless TORCH_CUBLASLT_UNIFIED_WORKSPACE
# is set, getCUDABlasLtWorkspace), 76 MiB for hipBLASLt. Each allocated through the caching allocator per (handle,
# stream); a handle per thread (DeviceThreadHandlePool): the forward's and autograd's device thread (engine.cpp).
CUBLAS_THREADS = 2
CUBLAS_SOURCE = "cuBLAS: CublasHandlePool.cpp getChosenWorkspaceSize @ 26a3905, one per thread (forward, autograd)"
# NCCL docs, Environment Variables: NCCL_BUFFSIZE defaults to 4194304 (4 MiB), the buffer between a pair of
# GPUs on a channel; a ring channel connects each rank to two peers (src/include/device.h @ 0524aef: struct
# ncclRing prev/next). Channels per communicator: NCCL picks them by topology, up to MAXCHANNELS (64, device.h);
# 16 is memcalc's assumption (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS fix it). One communicator per parallel
# dimension of more than one GPU (tp, cp, pp, dp, ep).
NCCL_BUFFSIZE = 4 * MIB
NCCL_CHANNELS = 16
NCCL_PEERS = 2
NCCL_SOURCE = "NCCL: NCCL_BUFFSIZE 4 MiB x 2 peers x 16 channels (assumed) per communicator"
# The caching allocator's reserved-but-unallocated share: GMLake (Guo et al., ASPLOS 2024, arXiv:2401.08156)
# measures PyTorch's fragmentation at 15% on average (up to 33%) for LLM fine-tuning with recompute, offload and
# LoRA on A100-80GB; OOM reports show 3.5% (threestudio-project/threestudio#403: 1.22 of 34.51 GiB reserved
# unallocated) to 9% (abacaj/fine-tune-mistral#3: 2.06 of 22.68 GiB). 5% of what the fixed parts leave: a default,
# not a measurement. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True maps more memory onto one segment instead of
# adding segments, so freed blocks merge and most of this share returns (docs/gpus.md).
ALLOCATOR_SHARE = 0.05
ALLOCATOR_SOURCE = "allocator: 5% a default, not a measurement (GMLake arXiv:2401.08156 measures 15% mean)"


@record(frozen=True)
class Headroom:
    """One GPU's memory that the step's tensors cannot have, by part; total_bytes = the sum of the parts."""

    context_bytes: int
    cublas_bytes: int
    nccl_bytes: int
    allocator_bytes: int
    allocator_share: float  # of what the card (or --gpu-memory) less the fixed parts leaves
    communicators: int  # NCCL communicators counted
    given: str  # --headroom as given ("" for memcalc's default)
    source: str
    colocated_bytes: int = 0  # an engine's beside the step in its process (GPU.colocated_bytes: TRL's colocated vLLM)
    colocated: str = ""

    @property
    def total_bytes(self) -> int:
        return self.context_bytes + self.cublas_bytes + self.nccl_bytes + self.allocator_bytes + self.colocated_bytes


def parse_headroom(text: str) -> tuple[int | None, float | None]:
    """--headroom: a size ('2GB', '0') replaces the parts, a share ('10%', '0.1') sets the allocator's."""
    raw = text.strip().lower()
    if raw in ("0", "0%", "none"):
        return 0, None
    if raw.endswith("%") or raw.replace(".", "", 1).isdigit() and float(raw) < 1:
        try:
            share = float(raw.rstrip("%")) / (100 if raw.endswith("%") else 1)
        except ValueError:
            raise InputError(f"--headroom takes a size (2GB) or the allocator's share (10%); got {text!r}") from None
        if not (math.isfinite(share) and 0 <= share < 1):
            raise InputError(f"--headroom share must be in [0%, 100%), got {text!r}")
        return None, share
    if not raw.rstrip("0123456789.eE+-"):  # '2' (or 5e9) is neither 2 bytes nor 2 GB: say which
        raise InputError(f"--headroom {text!r}: give a size with its unit (2GB) or a share (10%)")
    return parse_bytes(text, "headroom", MAX_MEMORY_MIB * MIB), None


def cublas_workspace(arch: str) -> int:
    """One thread's cuBLAS + cuBLASLt workspaces (hipBLAS + hipBLASLt on ROCm), per CublasHandlePool.cpp."""
    if arch.startswith("gfx"):
        blas = 128 * MIB if arch.startswith(("gfx94", "gfx95")) else 32 * MIB
        return blas + 76 * MIB
    blas = 32 * MIB if arch == "sm90" else 4096 * 1024 * 2 + 16 * 1024 * 8
    return blas + MIB  # cuBLASLt's own workspace: 1 MiB


@lru_cache(maxsize=4096)  # the planner asks it of every layout it searches
def headroom(gpu: GPU, groups: tuple[int, ...] = ()) -> Headroom:
    """The headroom of one GPU of a job whose parallel groups have these sizes (a communicator each > 1)."""
    fixed, share = parse_headroom(gpu.headroom_spec) if gpu.headroom_spec else (None, None)
    memory = gpu.memory_bytes
    if fixed is not None:
        if fixed + gpu.colocated_bytes >= memory:
            raise InputError(f"--headroom {gpu.headroom_spec} leaves nothing of the {gpu.name}'s {memory:,} bytes")
        return Headroom(0, 0, 0, fixed, 0.0, 0, gpu.headroom_spec, f"--headroom {gpu.headroom_spec}, as given",
                        gpu.colocated_bytes, gpu.colocated)  # fmt: skip
    comms = sum(1 for g in groups if g > 1)
    context, cublas = CONTEXT_BYTES, CUBLAS_THREADS * cublas_workspace(gpu.arch)
    nccl = comms * NCCL_CHANNELS * NCCL_PEERS * NCCL_BUFFSIZE
    left = memory - context - cublas - nccl - gpu.colocated_bytes
    if left <= 0 and gpu.colocated_bytes:
        raise InputError(f"the {gpu.name}'s {memory:,} bytes hold less than PyTorch's own context and workspaces "
                         f"and {gpu.colocated} ({gpu.colocated_bytes:,} bytes) beside the step")  # fmt: skip
    if left <= 0:
        raise InputError(f"the {gpu.name}'s {memory:,} bytes hold less than PyTorch's own context, workspaces and "
                         f"NCCL buffers ({context + cublas + nccl:,} bytes)")  # fmt: skip
    share = ALLOCATOR_SHARE if share is None else share
    source = "; ".join((CONTEXT_SOURCE, CUBLAS_SOURCE, NCCL_SOURCE, ALLOCATOR_SOURCE if gpu.headroom_spec == ""
                        else f"allocator: {share:.0%} from --headroom {gpu.headroom_spec}"))  # fmt: skip
    return Headroom(context, cublas, nccl, int(left * share), share, comms, gpu.headroom_spec, source,
                    gpu.colocated_bytes, gpu.colocated)  # fmt: skip


def usable_bytes(gpu: GPU, groups: tuple[int, ...] = ()) -> int:
    """What the step's tensors may hold on one GPU: its memory less the headroom."""
    return gpu.memory_bytes - headroom(gpu, groups).total_bytes


def allocator_room(gpu: GPU, groups: tuple[int, ...] = ()) -> int:
    """What the driver can give PyTorch's caching allocator on one GPU: its memory less the CUDA context,
    cuBLAS's workspaces and NCCL's buffers (the headroom but the allocator's share)."""
    h = headroom(gpu, groups)
    return gpu.memory_bytes - h.total_bytes + h.allocator_bytes
