"""What `memcalc serve` is asked (ServeJob), and vLLM's defaults for what it leaves out.

vLLM's defaults, each from its source (vllm-project/vllm):
  gpu_memory_utilization 0.9, 0.92    vllm/config/cache.py CacheConfig.gpu_memory_utilization (0.92 from 0.20:
                                      the release's, memcalc.serve.releases)
  block_size 16, 64 under MLA         vllm/platforms/cuda.py@1c0d9ecf5bad600df3e001bf642dd48c5ed25cc6
                                      CudaPlatformBase.check_and_update_config (FlashMLA forces 64 before
                                      Blackwell)
  max_num_batched_tokens, max_num_seqs   vllm/engine/arg_utils.py@99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b
                                      EngineArgs._set_default_args: `vllm serve` (OPENAI_API_SERVER) takes
                                      8192 and 1024 on a GPU of at least 70 GiB that is no A100, else 2048
                                      and 256 (vllm 0.8.5's: any GPU of 70 GiB; memcalc.serve.releases);
                                      from 0.28, 16384 and 1024 on one of 160 GiB or more (vllm 0.28.0);
                                      the 70 GiB are get_device_total_memory's, mem_get_info's total
  dtype                               the model's 16 bits: bf16, fp16 on a card without bf16 (Volta, Turing:
                                      vllm/v1/worker/gpu_worker.py _check_if_gpu_supports_dtype refuses bf16
                                      below compute capability 8.0; users pass --dtype half there)
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.model.gpus import GPU
from memcalc.model.shape import Model, longest_seq
from memcalc.model.sizes import MAX_BATCH, MAX_SEQ
from memcalc.records import record
from memcalc.time.calibration import Calibration

from .releases import DEFAULT_RELEASE, Release, release_for, release_line
from .runners import V2_FROM, V2_GRAPH_ESTIMATE_FROM, default_runner

GIB = 1 << 30
WEIGHT_FORMATS = ("bf16", "fp16", "fp8", "fp8-block", "int8", "int4-awq", "int4-gptq")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8")
SAMPLERS = ("torch", "flashinfer")  # the profile run's top-k/top-p sampler (memcalc.serve.profile)
RUNNERS = ("v1", "v2")  # vLLM's model runners (memcalc.serve.runners)
LARGEST_DEFAULTS_FROM = 28  # 16,384 batched tokens on a card of 160 GiB or more
V2_SAMPLER_WARMUP_FROM = 33  # V2's profile run samples top-k/top-p (for_sampler_warmup) from 0.33
FLASHINFER_SM80_FROM = 26  # FlashInferBackend.supports_compute_capability: 7.5 up to 0.25, 8.0 from 0.26
FLASHINFER_SMS_FROM = 33  # flashinfer_sampler_supported: more than 16 SMs (FlashInfer 0.7's multi-CTA top-k)
CUDA_BLOCK_SIZE, FLASHMLA_BLOCK_SIZE = 16, 64  # vllm/platforms/cuda.py check_and_update_config


@record(frozen=True)
class ServeJob:
    """One GPU of a vLLM server: the model, the GPU, the context each request holds, the formats, the
    engine's settings (None: vLLM's default for this GPU and model) and the layout over GPUs."""

    model: Model
    gpu: GPU
    context: int  # tokens of one request, prompt and output together (vLLM's max_model_len)
    calibration: Calibration  # the roofline's efficiencies, as training uses them
    weights: str = "bf16"
    kv_dtype: str = "auto"  # auto: the weights' activation dtype (vLLM --kv-cache-dtype auto)
    batch: int | None = None  # requests decoded together for the time; None: the most that fit
    tp: int = 1
    pp: int = 1
    dp: int = 1  # data-parallel replicas; with expert_parallel they share the experts
    expert_parallel: bool = False  # vLLM --enable-expert-parallel: experts split over tp x dp GPUs whole
    gpu_memory_utilization: float | None = None  # None: the release's default (Release.utilization)
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory: int | None = None  # vLLM --kv-cache-memory: the cache's bytes per GPU, no profiling
    vllm: str = DEFAULT_RELEASE  # the vLLM release line, "0.23" (memcalc.serve.releases.release_line)
    sampler: str = ""  # torch (PyTorch's) or flashinfer; "": the release's default (Release.sampler)
    cudagraph_memory: int | None = None  # 0.20 on: the log's "Estimated CUDA graph memory" (0: estimate off)
    model_runner: str = ""  # v1 or v2; "": the release's default for the model (memcalc.serve.runners)
    sglang: bool = False  # SGLang's KV budget beside vLLM's (memcalc.serve.sglang)
    mem_fraction_static: float | None = None  # SGLang's; None: its heuristic's

    def __post_init__(self) -> None:
        shape = self.model.shape
        if self.context > longest_seq(shape):
            raise InputError(f"context {self.context:,} exceeds the {shape.max_positions:,} rows of {shape.name}'s "
                             f"learned position table: give --context {shape.max_positions} or less")  # fmt: skip
        if self.weights not in WEIGHT_FORMATS:
            raise InputError(f"unknown weight format {self.weights!r}; known: {', '.join(WEIGHT_FORMATS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise InputError(f"unknown KV cache dtype {self.kv_dtype!r}; known: {', '.join(KV_DTYPES)}")
        if self.sampler and self.sampler not in SAMPLERS:
            raise InputError(f"unknown sampler {self.sampler!r}; known: {', '.join(SAMPLERS)}")
        if self.sampler and self.kv_cache_memory is not None:
            raise InputError("--sampler names the profile run's sampler, which --kv-cache-memory skips: give one")
        if release_line(self.vllm) != self.vllm:
            raise InputError(f"vllm takes a release line such as 0.11, got {self.vllm!r}")
        self.check_runner()
        self.check_cudagraphs()
        if self.mem_fraction_static is not None and not self.sglang:
            raise InputError("--mem-fraction-static is SGLang's: give it with --sglang")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise InputError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.weights == "bf16" and not self.gpu.bf16_tflops:
            raise InputError(f"bf16 weights need bf16 tensor cores (Ampere or later), which the {self.gpu.name} "
                             "lacks: vLLM refuses them there; give --weights fp16")  # fmt: skip
        if self.weights in ("fp8", "fp8-block") and not self.gpu.bf16_tflops:
            raise InputError(f"vLLM's fp8 weights need compute capability 8.0 or later; the {self.gpu.name} "
                             "has none")  # fmt: skip
        for name in (f"{self.half}_tflops", "bandwidth_gbps"):
            if not getattr(self.gpu, name):
                raise InputError(f"serve's time needs the card's {name}, which its --gpu file does not give")
        if not 1 <= self.context <= MAX_SEQ:
            raise InputError(f"context must be 1 to {MAX_SEQ:,} tokens, got {self.context:,}")
        if not 0 < self.utilization <= 1:
            raise InputError(f"gpu-memory-utilization must be in (0, 1], got {self.utilization}")
        for name in ("tp", "pp", "dp"):
            if not 1 <= getattr(self, name) <= 4096:
                raise InputError(f"--{name} must be 1 to 4,096, got {getattr(self, name)}")
        if shape.n_heads % self.tp:
            raise InputError(f"--tp {self.tp} must divide the {shape.n_heads} attention heads (vLLM splits them)")
        if self.pp > shape.n_layers:
            raise InputError(f"--pp {self.pp} is more stages than the {shape.n_layers} layers")
        if self.expert_parallel and not shape.is_moe:
            raise InputError("--expert-parallel splits a mixture of experts; this model is dense")
        if self.expert_parallel and shape.n_experts % self.ep:
            raise InputError(f"expert parallel over tp x dp = {self.ep} GPUs must divide the {shape.n_experts} experts")
        if self.dp > 1 and not self.expert_parallel:
            raise InputError("--dp without --expert-parallel is that many copies of this server: ask for one")
        for name, value, top in (("batch", self.batch, MAX_BATCH), ("block-size", self.block_size, 1 << 16),
                                 ("max-num-batched-tokens", self.max_num_batched_tokens, MAX_SEQ),
                                 ("max-num-seqs", self.max_num_seqs, MAX_BATCH),
                                 ("kv-cache-memory", self.kv_cache_memory, 1 << 50)):  # fmt: skip
            if value is not None and not 1 <= value <= top:
                raise InputError(f"--{name} must be 1 to {top:,}, got {value:,}")

    def check_runner(self) -> None:
        """--model-runner: V2's from 0.22, and a sampler only where V2's profile run samples top-k/top-p (0.33)
        and, from 0.21, FlashInfer's only where vLLM runs it."""
        if self.model_runner and self.model_runner not in RUNNERS:
            raise InputError(f"unknown model runner {self.model_runner!r}; known: {', '.join(RUNNERS)}")
        if self.model_runner == "v2" and self.minor < V2_FROM:
            raise InputError(f"vLLM's V2 model runner is modelled from 0.22 (VLLM_USE_V2_MODEL_RUNNER); {self.vllm} "
                             "runs V1's: give --model-runner v1 or --vllm-version 0.22 or later")  # fmt: skip
        if self.sampler == "flashinfer" and self.release.sampler == "flashinfer" and not self.flashinfer_runs:
            raise InputError(f"vLLM {self.vllm} refuses FlashInfer's sampler on the {self.gpu.name} (CUDA, compute "
                             "capability 7.5 or later, 8.0 from 0.26): drop --sampler")  # fmt: skip
        if self.sampler and self.runner == "v2" and self.minor < V2_SAMPLER_WARMUP_FROM:
            raise InputError(f"V2's model runner in vLLM {self.vllm} profiles a greedy batch, which no top-k/top-p "
                             "sampler runs: drop --sampler, or give --model-runner v1")  # fmt: skip

    @property
    def counts_kept(self) -> bool:
        """Whether the budget counts the tensors the model runner keeps (total_consumed: 0.27 on, profiling)."""
        return self.release.counts_persistent and self.kv_cache_memory is None

    @property
    def graph_estimate(self) -> bool:
        """Whether the budget subtracts vLLM's own CUDA graph estimate: V1's runner from 0.20, V2's from 0.29."""
        if self.kv_cache_memory is not None:
            return False
        return self.minor >= V2_GRAPH_ESTIMATE_FROM if self.runner == "v2" else self.release.cudagraph_estimate

    def check_cudagraphs(self) -> None:
        """vLLM subtracts its own measured CUDA graph estimate (graph_estimate), which memcalc takes as given."""
        if self.graph_estimate and self.cudagraph_memory is None:
            raise InputError(f"vLLM {self.vllm} ({self.runner.upper()} model runner) subtracts its own measured CUDA "
                             "graph estimate: give --cudagraph-memory as the log prints it ('Estimated CUDA graph "
                             "memory: X GiB'), or 0 under VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0")  # fmt: skip
        if not self.graph_estimate and self.cudagraph_memory is not None:
            raise InputError("--cudagraph-memory is vLLM's own estimate, subtracted where it profiles from 0.20 (V2's "
                             "model runner: from 0.29): give --vllm-version 0.20 or later, without "
                             "--kv-cache-memory")  # fmt: skip

    @property
    def minor(self) -> int:
        """The release line's minor number: 23 for 0.23."""
        return int(self.vllm.split(".")[1])

    @property
    def runner(self) -> str:
        """The model runner: --model-runner, else the release's default for the model (memcalc.serve.runners)."""
        return self.model_runner or default_runner(self.minor, self.model.shape, self.weights)

    @property
    def utilization(self) -> float:
        """gpu_memory_utilization: as given, else the release's default (0.9; 0.92 from vLLM 0.20)."""
        return self.release.utilization if self.gpu_memory_utilization is None else self.gpu_memory_utilization

    @property
    def profile_sampler(self) -> str:
        """The profile run's sampler: --sampler, else the release's default where the card runs it (FlashInfer's
        from 0.21 falls back to PyTorch's elsewhere: topk_topp_sampler.py TopKTopPSampler.__init__)."""
        if self.sampler:
            return self.sampler
        return "torch" if self.release.sampler == "flashinfer" and not self.flashinfer_runs else self.release.sampler

    @property
    def sampled_by(self) -> str:
        """What samples in the profile run: "greedy" (V2's dummy batch before 0.33), else profile_sampler."""
        return "greedy" if self.runner == "v2" and self.minor < V2_SAMPLER_WARMUP_FROM else self.profile_sampler

    @property
    def flashinfer_runs(self) -> bool:
        """FlashInfer's sampler runs on the card (0.21 on): CUDA, compute capability 7.5 to 12.1, from 0.26 8.0
        to 12.1 (v1/attention/backends/flashinfer.py supports_compute_capability), more than 16 SMs (0.33)."""
        capability = self.gpu.capability
        if capability is None:
            return False
        floor = 80 if self.minor >= FLASHINFER_SM80_FROM else 75
        return floor <= capability <= 121 and (self.gpu.sms > 16 or self.minor < FLASHINFER_SMS_FROM)

    @property
    def ep(self) -> int:
        """GPUs the experts are split over: tp x dp under expert parallel (vLLM's EP group), else none."""
        return self.tp * self.dp if self.expert_parallel else 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def release(self) -> Release:
        return release_for(self.vllm)

    @property
    def large_gpu(self) -> bool:
        """vLLM's larger batch defaults: at least 70 GiB (mem_get_info's total) and, from 0.9, not an A100
        (arg_utils.py, PR #17885)."""
        a100 = "a100" in self.gpu.key and not self.release.a100_large_defaults
        return self.gpu.cuda_total_bytes >= 70 * GIB and not a100

    @property
    def largest_gpu(self) -> bool:
        """vLLM's largest batch defaults (0.28 on, arg_utils.py "GPUs like B200/B300"): at least 160 GiB."""
        return self.minor >= LARGEST_DEFAULTS_FROM and self.gpu.cuda_total_bytes >= 160 * GIB

    @property
    def batched_tokens(self) -> int:
        """max_num_batched_tokens: the tokens one step schedules, the profile run's size."""
        return self.max_num_batched_tokens or (16384 if self.largest_gpu else 8192 if self.large_gpu else 2048)

    @property
    def seqs(self) -> int:
        """max_num_seqs, as vLLM caps it: never more than max_num_batched_tokens (arg_utils.py)."""
        return self.max_num_seqs or min(1024 if self.large_gpu or self.largest_gpu else 256, self.batched_tokens)

    @property
    def page_tokens(self) -> int:
        """Tokens per KV block: --block-size, else 16; 64 under MLA on a GPU FlashMLA runs on (Hopper and
        Blackwell datacenter parts, sm90 and sm100: vllm/attention/ops/flashmla.py is_flashmla_supported; elsewhere
        vLLM's Triton MLA keeps 16)."""
        flashmla = self.model.shape.is_mla and self.gpu.arch in ("sm90", "sm100")
        return self.block_size or (FLASHMLA_BLOCK_SIZE if flashmla else CUDA_BLOCK_SIZE)

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation: 2, every weight format computing in 16 bits (bf16 or fp16; fp8 and the
        weight-only int formats dequantize to them)."""
        return 2

    @property
    def half(self) -> str:
        """The 16-bit type the model computes in: bf16, or fp16 on a card without bf16 tensor cores."""
        return "bf16" if self.gpu.bf16_tflops else "fp16"

    @property
    def kv_bytes(self) -> int:
        """Bytes of one cached element: 1 for fp8 (vLLM --kv-cache-dtype fp8, per-tensor scales), else 2."""
        return 1 if self.kv_dtype == "fp8" else self.activation_bytes
