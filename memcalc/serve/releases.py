"""vLLM's releases as they differ in the memory budget (--vllm-version), each read from its PyPI wheel's source.

Every V1 release sizes the KV cache in gpu_worker.py Worker.determine_available_memory, after a profile run
(gpu_model_runner.py profile_run: a forward of max_num_batched_tokens tokens over min(max_num_seqs, tokens)
requests, then _dummy_sampler_run on their last hidden states). Where they differ:

  0.8   vllm 0.8.5 vllm/v1/worker/gpu_worker.py determine_available_memory: total x utilization - (torch's
        allocated peak + (total - free - torch's allocated after empty_cache)): the second term is all
        memory outside torch's tensors, the CUDA context included. `vllm serve`'s defaults take 8,192 tokens
        and 1,024 sequences on any card of 70 GiB or more (engine/arg_utils.py _set_default_args).
  0.9   vllm 0.9.2 and 0.10.1.1 (1da94e673): total x utilization - (weights + torch peak increase + non-torch
        increase) (vllm/utils/__init__.py memory_profiling); the baseline snapshot (Worker.init_device,
        MemorySnapshot()) is taken before init_worker_distributed_environment, so NCCL's buffers are in
        the increase. A100s keep 2,048 and 256 (arg_utils.py: "a100" not in device_name).
  0.11  vllm 0.11.0 (f71952c1c) and 0.13.0 (72506c983): the same, the baseline taken after
        init_worker_distributed_environment ("This ensures NCCL buffers are allocated before we measure").
  0.20  vllm 0.20.0 gpu_worker.py determine_available_memory: 0.11's budget less
        profile_cudagraph_memory's estimate (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: envs.py's default turns
        from "0" in 0.18 and 0.19, where the estimate is computed but not subtracted, to "1"), and
        config/cache.py's gpu_memory_utilization default from 0.9 to 0.92. The estimate is
        a capture of two graphs per mode measured by mem_get_info and extrapolated, which memcalc takes as the
        log prints it ("Estimated CUDA graph memory: X GiB total"; --cudagraph-memory), not as a formula.
  0.21  vllm 0.21.0 and 0.26.0: 0.20's budget, the sampler FlashInfer's by default (below), whose profile run
        samples a second time through forward_native (gpu_model_runner.py _dummy_sampler_run). From 0.22 vLLM
        runs some models on its V2 model runner by default (memcalc.serve.runners), which profiles otherwise.
  0.27  vllm 0.27.0, 0.30.0 and 0.33.0 utils/mem_utils.py memory_profiling: non_kv_cache_memory = total_consumed
        (the init snapshot's free memory less the free memory after profile_run and empty_cache) +
        transient_peak_headroom (torch's allocated peak less its allocated after the profile run). Beside the
        weights, the peak and the non-torch memory, that counts every tensor the model runner keeps from its
        construction on (memcalc.serve.budget.kept_bytes) and what the allocator holds unallocated
        after empty_cache (not modelled: its fragmentation). From 0.28 a card of 160 GiB or more takes 16,384
        batched tokens (arg_utils.py); 0.33 creates cuBLAS's handles before the snapshot (init_device), which
        moves them out of the non-torch memory (not split out of NON_TORCH below). vllm 0.34 sizes an
        extensible KV cache after warm-up (v1/worker/extensible_kv_cache.py measure_kv_cache_bytes, utilization
        1.0 by default): not modelled.

The sampler of the profile run is PyTorch's (vllm/v1/sample/ops/topk_topp_sampler.py forward_native) by default
up to 0.20: FlashInfer's is taken only where flashinfer is installed (an extra, not a dependency, of the 0.10
and 0.11 wheels' METADATA) and is opt-in from 0.13 to 0.20 (VLLM_USE_FLASHINFER_SAMPLER=1). From 0.21 it is
FlashInfer's by default (envs.py VLLM_USE_FLASHINFER_SAMPLER: bool = True; flashinfer-python a dependency:
0.6.8.post1 in 0.21, 0.6.14 in 0.26, 0.7.2.post1 in 0.33). PyTorch's path sorts the logits up to 0.16 and,
from 0.17, masks them with a Triton kernel where 8 rows or more are sampled (memcalc.serve.profile).

What the profile measures outside torch's allocator has no formula in vLLM's source; memcalc takes the
CUDA context (memcalc.model.headroom's) where the release counts it, NCCL's communicator buffers where the
release counts them and tp > 1, and the rest (cuBLAS handles, the kernels loaded lazily) as published
startup logs print it: see NON_TORCH below. NCCL's buffers are charged on the cards behind NVSwitch's
NVLink 4 and 5 (Hopper, Blackwell), where they were measured (1.79 GiB, an H100 pair) and where NCCL runs
the most channels and adds NVLink SHARP's: NVIDIA/nccl src/transport/nvls.cc (5067397c) ncclNvlsInit turns
NVLS on where the device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED and allocates nvlsTotalSize =
nChannels x 2 x buffSize x nHeads per GPU. On other links (PCIe, an A100's NVLink 3, a group across nodes)
the published logs show no rise over the tp 1 median (below), and nothing is added.
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

GIB = 1 << 30
# vLLM 0.6.5-0.8 (V0 engine) logs print "non_torch_memory takes X GiB" (worker.py determine_num_available_
# blocks): 0.35 (RTX 3090, vllm-project/vllm#10517), 0.25 (2 x RTX 4090 at tp 2, #13061), 0.20 (RTX 3090,
# #14447), 0.34, 0.38, 0.43 (4 x A100 40GB at tp 4, #16570); their median, 0.345 GiB, stands for cuBLAS's
# handles and the kernels loaded during the profile run where the release measures them. The tp 2 and 4 logs
# hold NCCL too (vllm 0.8.5 worker.py init_device takes the baseline before init_worker_distributed_environment)
# and are no higher than the tp 1 ones: on those links NCCL adds nothing memcalc can see.
NON_TORCH_BYTES = int(0.345 * GIB)
# NCCL's buffers on each GPU of a tp > 1 group behind NVSwitch's NVLink 4/5: the difference of
# vllm-project/vllm#10511's two H100 SXM runs, non_torch_memory 3.58 GiB at tp 2 against 1.79 at tp 1
# (Llama-3-8B, custom all-reduce's buffers included)
NCCL_BYTES = int((3.58 - 1.79) * GIB)
NVLS_LINKS = ("nvlink4", "nvlink5", "nvlink-h800")  # memcalc.parallel.links keys: NVLink 4/5 via NVSwitch


@record(frozen=True)
class Release:
    """How one span of vLLM releases sizes the KV cache (see the module)."""

    key: str  # "0.11": the span's first release
    label: str  # "vLLM 0.11 to 0.19"
    counts_context: bool  # the CUDA context is inside the measured non-torch memory (0.8)
    counts_nccl: bool  # NCCL's buffers are inside the measured increase (0.8 to 0.10)
    a100_large_defaults: bool  # an A100 80GB takes the 8,192 / 1,024 defaults (0.8)
    source: str
    cudagraph_estimate: bool = False  # the budget subtracts profile_cudagraph_memory's estimate (0.20 to 0.26)
    sampler: str = "torch"  # the profile run's sampler by default: PyTorch's sort, or FlashInfer's (0.21 on)
    flashinfer_buffer: int = 0  # FlashInfer's cached row-states buffer of top_k_mask_logits (flashinfer 0.6: 1 MiB)
    utilization: float = 0.9  # gpu_memory_utilization's default (vllm/config/cache.py CacheConfig): 0.92 from 0.20
    counts_persistent: bool = False  # total_consumed: the runner's kept tensors count in the budget (0.27 on)


RELEASES = {
    r.key: r
    for r in (
        Release("0.8", "vLLM 0.8", True, True, True, "vllm 0.8.5 vllm/v1/worker/gpu_worker.py"),
        Release("0.9", "vLLM 0.9 to 0.10", False, True, False,
                "vllm 0.10.1.1 (1da94e673) vllm/v1/worker/gpu_worker.py, vllm/utils/__init__.py memory_profiling"),
        Release("0.11", "vLLM 0.11 to 0.19", False, False, False,
                "vllm 0.11.0 (f71952c1c), 0.13.0 (72506c983), 0.19.0 vllm/v1/worker/gpu_worker.py, memory_profiling"),
        Release("0.20", "vLLM 0.20", False, False, False,
                "vllm 0.20.0 vllm/v1/worker/gpu_worker.py determine_available_memory, envs.py, config/cache.py",
                True, "torch", 0, 0.92),
        Release("0.21", "vLLM 0.21 to 0.26", False, False, False,
                "vllm 0.21.0, 0.26.0 vllm/v1/worker/gpu_worker.py determine_available_memory", True, "flashinfer",
                1 << 20, 0.92),  # flashinfer-python 0.6.8.post1 sampling.py top_k_mask_logits: _get_cache_buf(1 MB)
        Release("0.27", "vLLM 0.27 to 0.33", False, False, False,
                "vllm 0.27.0, 0.30.0, 0.33.0 vllm/v1/worker/gpu_worker.py determine_available_memory, "
                "utils/mem_utils.py memory_profiling", True, "flashinfer", 1 << 20, 0.92, True),
    )  # flashinfer-python 0.7.2.post1 (0.33's) keeps the 1 MB buffer
}
DEFAULT_RELEASE = "0.11"
LAST_MODELLED = (0, 33)  # 0.34 sizes an extensible KV cache after warm-up


def release_line(text: str) -> str:
    """--vllm-version: a release number (0.10.1.1, 0.9, v0.23.0) as its line, "0.10", checked to be modelled."""
    parts = text.strip().lstrip("v").split(".")
    try:
        major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else -1
    except ValueError:
        raise InputError(f"--vllm-version takes a release number such as 0.10.1 or 0.11, got {text!r}") from None
    if minor < 0 or major != 0:
        raise InputError(f"--vllm-version takes a release number such as 0.10.1 or 0.11, got {text!r}")
    if minor < 8:
        raise InputError(f"vLLM {text.strip()} runs the V0 engine, whose budget memcalc does not model: "
                         "give --vllm-version 0.8 or later")  # fmt: skip
    if (major, minor) > LAST_MODELLED:
        raise InputError(f"vLLM {text.strip()} sizes an extensible KV cache after warm-up (0.34 on: "
                         "extensible_kv_cache.py, from the transient peak of every warm-up step), which memcalc does "
                         "not model: give --vllm-version 0.33 or earlier")  # fmt: skip
    return f"0.{minor}"


def release_for(text: str) -> Release:
    """The span of releases a release number (or line) belongs to: the latest whose first release is not past it."""
    minor = int(release_line(text).split(".")[1])
    return max((r for r in RELEASES.values() if first_minor(r) <= minor), key=first_minor)


def first_minor(release: Release) -> int:
    """The minor number of the span's first release (its key): 11 for 0.11."""
    return int(release.key.split(".")[1])


def counts_nccl(release: Release, gpus: int, intra: str) -> bool:
    """Whether the release's profile holds NCCL's NVLS buffers: it measures NCCL, the group spans GPUs and
    their link is NVSwitch's NVLink 4 or 5 (see the module)."""
    return release.counts_nccl and gpus > 1 and intra in NVLS_LINKS


def non_torch_bytes(release: Release, gpus: int, intra: str, context: int) -> int:
    """What the release's profile counts outside torch's tensors on one GPU of `gpus` joined by `intra`."""
    return NON_TORCH_BYTES + (context if release.counts_context else 0) + \
        (NCCL_BYTES if counts_nccl(release, gpus, intra) else 0)  # fmt: skip
