"""SGLang's KV cache on one GPU, beside vLLM's (--sglang): sglang 0.5.23, read from its PyPI wheel's source.

SGLang sizes its KV pool once, after the weights and before its attention backends, its request table and its
CUDA graphs, which live in what it leaves (mem_cache/kv_cache_configurator.py _profile_available_bytes):

    available = free now - pre_model_load_memory x (1 - mem_fraction_static)
              = mem_fraction_static x pre_model_load_memory - weights

pre_model_load_memory is mem_get_info's free memory once the CUDA context and the parallel groups exist
(distributed/bootstrap.py measure_pre_model_load_memory, after init_distributed_environment: NCCL's and custom
all-reduce's buffers under tp > 1), the least over ranks, in GiB. The pool holds available // cell tokens
(model_executor/pool_configurator.py calculate_pool_sizes, page_size 1 on CUDA), a cell being a token's keys and
values over every layer: KV heads per rank x (head_dim + v_head_dim) x bytes, or MLA's (kv_lora_rank +
qk_rope_head_dim) x bytes on every rank. max_running_requests, unless given, is int(tokens / context x 512)
clamped to [2048, 4096], at most tokens // 2 (kv_cache_configurator.py).

mem_fraction_static, unless given, is arg_groups/memory_hook.py _handle_gpu_memory_settings' heuristic on
nvidia-smi's total (MiB): chunked_prefill_size and the decode CUDA graphs' max batch by the card's memory (TIERS),
then reserved = 512 + 1.5 x max(chunked_prefill_size, 2048) + tp x pp / 8 x 1024 + 2 x decode max batch +
8 x the prefill graphs' buckets (breakable graphs, on by default on CUDA; MLA: 1536), at least 10 GiB on a card
of more than 60 GiB, and mem_fraction_static = round((total - reserved) / total, 3).
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.model.headroom import CONTEXT_BYTES
from memcalc.records import record

from .job import ServeJob
from .kv import kv_layers
from .releases import NCCL_BYTES, NVLS_LINKS

MIB, GIB = 1 << 20, 1 << 30
RELEASE = "0.5.23"
# nvidia-smi's total below (MiB) -> chunked_prefill_size, decode CUDA graph max batch (tp < 4, tp >= 4)
TIERS = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
         (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (1 << 40, 16384, 512, 512))  # fmt: skip


@record(frozen=True)
class SGLangBudget:
    """SGLang's split of one GPU (bytes), and the pool's tokens."""

    mem_fraction_static: float
    given: bool  # --mem-fraction-static, else the heuristic's
    chunked_prefill: int  # the heuristic's inputs (shown where it decides)
    decode_graph_batch: int
    reserved_mib: float
    pre_load: int  # pre_model_load_memory: free memory before the weights
    nccl: int  # NCCL's buffers in it (tp > 1 behind NVSwitch: memcalc.serve.releases.NCCL_BYTES)
    weights: int
    available: int  # mem_fraction_static x pre_load - weights, 0 if the weights exceed it
    cell: int  # a token's keys and values over every layer on this GPU
    tokens: int  # max_total_num_tokens
    max_running_requests: int


def prefill_buckets(max_tokens: int) -> int:
    """The prefill CUDA graphs' sizes (arg_groups/cuda_graph_hook.py generate_prefill_cuda_graph_batch_sizes)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]  # fmt: skip
    return sum(1 for s in sizes if s <= max_tokens)


def default_fraction(job: ServeJob) -> tuple[float, int, int, float]:
    """(mem_fraction_static, chunked_prefill_size, decode graph max batch, reserved MiB): memory_hook.py's rule."""
    total = job.gpu.memory_mib
    _, chunked, small, large = next(t for t in TIERS if total < t[0])
    decode = small if job.tp < 4 else large
    mla = job.model.shape.is_mla
    prefill = 1536 if mla else 8 * prefill_buckets(min(8192, chunked) if mla else chunked)
    reserved = 512 + max(chunked, 2048) * 1.5 + job.tp * job.pp / 8 * 1024 + decode * 2 + prefill
    if total > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((total - reserved) / total, 3), chunked, decode, reserved


def pool_bytes(pre_load: int, free_after_load: int, fraction: float) -> int:
    """_profile_available_bytes: the free memory after the weights less pre_model_load_memory x (1 - fraction)."""
    return max(0, int(free_after_load - pre_load * (1 - fraction)))


def check(job: ServeJob) -> None:
    """What SGLang's budget here does not cover, refused in one line."""
    shape = job.model.shape
    if job.pp > 1 or job.dp > 1 or job.expert_parallel:
        raise InputError("--sglang models one tensor-parallel group: drop --pp, --dp and --expert-parallel")
    if any(shape.window_at(i) for i in range(shape.n_layers)):
        raise InputError(f"--sglang: {shape.name}'s sliding-window layers take SGLang's SWA pool, which memcalc "
                         "does not model")  # fmt: skip


def sglang_budget(job: ServeJob, weights: int) -> SGLangBudget:
    """SGLang 0.5.23's pool for the job's model, card and tp (see the module)."""
    check(job)
    fraction, chunked, decode, reserved = default_fraction(job)
    given = job.mem_fraction_static is not None
    fraction = job.mem_fraction_static if given else fraction
    nccl = NCCL_BYTES if job.tp > 1 and job.gpu.intra in NVLS_LINKS else 0
    pre = job.gpu.cuda_total_bytes - CONTEXT_BYTES - nccl
    available = pool_bytes(pre, pre - weights, fraction)
    cell = sum(k.bytes_per_token * k.count for k in kv_layers(job, range(job.model.shape.n_layers)))
    tokens = available // cell
    estimated = max(min(int(tokens / job.context * 512), 4096), 2048)
    return SGLangBudget(fraction, given, chunked, decode, reserved, pre, nccl, weights, available, cell, tokens,
                        min(estimated, tokens // 2))  # fmt: skip
