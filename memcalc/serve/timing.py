"""Prefill and decode on the roofline (Williams et al. 2009), with training's calibration.

A forward step is two parts, each at the larger of its compute and its memory time:

  linear    2 FLOPs per active parameter per token (Kaplan et al. 2020, eq. 2.2: C_forward = 2N) at the
            matmul efficiency of the compute dtype's peak (fp8 weights: the fp8 peak where the GPU has one;
            int8 and int4 weight-only kernels dequantize to 16 bits: the bf16 peak), against the bytes of
            the weights the step reads at the bandwidth efficiency: every weight but the embedding table,
            and of each MoE block's experts those its tokens reach
  attention 2 (d_k + d_v) FLOPs per query head per key a query sees, at the flash efficiency, against
            the KV cache's bytes read (decode) at the bandwidth efficiency. MLA decodes in the latent
            (vLLM absorbs kv_b into the query and output): 2 (2 r_kv + d_rope) FLOPs per head per key

Prefill runs one request's `context` tokens (causal: query i sees min(i, window) keys); its time is the
time to first token. Decode runs `batch` requests, one token each, each reading `context` keys per layer
(a sliding layer its window): the time per output token, and batch / that the tokens per second.
With pipeline stages a token crosses every stage in turn: a step is the stages' steps summed.
Not modelled: scheduling and sampling, CPU overheads and kernel launches (CUDA graphs remove most of
them in decode), tensor parallel's all-reduces, chunked prefill mixing prefills into decode steps.
"""

from __future__ import annotations

from memcalc.records import record
from memcalc.time.calibration import Calibration

from .job import ServeJob
from .kv import KVCache
from .weights import Weights, experts_touched


@record(frozen=True)
class Roof:
    """One part of a step: FLOPs and bytes, and the time of each at its calibrated rate."""

    flops: float
    bytes: float
    compute_seconds: float
    memory_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def total(parts: tuple[Roof, ...]) -> Roof:
    """Parts run one after another: FLOPs, bytes and each time added."""
    return Roof(sum(r.flops for r in parts), sum(r.bytes for r in parts), sum(r.compute_seconds for r in parts),
                sum(r.memory_seconds for r in parts))  # fmt: skip


@record(frozen=True)
class Step:
    """A forward step of `tokens` tokens: its linear and attention parts on each stage's GPU in turn."""

    tokens: int
    linears: tuple[Roof, ...]  # one per pipeline stage
    attentions: tuple[Roof, ...]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.linears + self.attentions)

    @property
    def linear(self) -> Roof:
        return total(self.linears)

    @property
    def attention(self) -> Roof:
        return total(self.attentions)


@record(frozen=True)
class ServeTime:
    """Time to first token, time per output token and tokens per second at a batch."""

    batch: int
    prefill: Step
    decode: Step

    @property
    def ttft_seconds(self) -> float:
        return self.prefill.seconds

    @property
    def tpot_seconds(self) -> float:
        return self.decode.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.decode.seconds


def compute_peak(job: ServeJob) -> float:
    """Dense FLOP/s the job's matmuls run at: fp8 on fp8 tensor cores, else 16 bits."""
    return job.gpu.peak_flops("fp8-e4m3" if job.weights in ("fp8", "fp8-block") and job.gpu.fp8_tflops else job.half)


def roof(flops: float, moved: float, peak: float, efficiency: float, job: ServeJob, cal: Calibration) -> Roof:
    bandwidth = job.gpu.bandwidth_gbps * 1e9 * cal.bandwidth
    return Roof(flops, moved, flops / (peak * efficiency), moved / bandwidth)


def keys_seen(context: int, window: int) -> int:
    """Keys all `context` queries of a causal prefill see together: sum over i of min(i, window)."""
    if not window or context <= window:
        return context * (context + 1) // 2
    return window * (window + 1) // 2 + (context - window) * window


def attention_flops_per_key(job: ServeJob, decode: bool) -> int:
    """FLOPs per query per key in one layer on one GPU (see the module)."""
    shape = job.model.shape
    heads = shape.n_heads // job.tp
    if shape.is_mla and decode:
        return 2 * heads * (2 * shape.kv_lora_rank + shape.qk_rope_head_dim)
    return 2 * heads * (shape.head_dim + shape.v_dim)


def prefill_step(job: ServeJob, weights: Weights, kv: KVCache, cal: Calibration) -> Step:
    shape, P = job.model.shape, job.context
    touched = experts_touched(weights.local_experts, shape.n_experts, shape.experts_per_token, P)
    per_token = experts_touched(weights.local_experts, shape.n_experts, shape.experts_per_token, 1)
    linear = roof(2 * P * weights.active_params(per_token), weights.read_bytes(touched), compute_peak(job),
                  cal.matmul, job, cal)  # fmt: skip
    keys = sum(k.count * keys_seen(P, k.window) for k in kv.layers)
    written = sum(k.count * k.bytes_per_token * k.kept(P) for k in kv.layers)
    attention = roof(keys * attention_flops_per_key(job, False), written, job.gpu.peak_flops(job.half), cal.flash,
                     job, cal)  # fmt: skip
    return Step(P, (linear,), (attention,))


def decode_step(job: ServeJob, weights: Weights, kv: KVCache, batch: int, cal: Calibration) -> Step:
    shape = job.model.shape
    touched = experts_touched(weights.local_experts, shape.n_experts, shape.experts_per_token, batch)
    per_token = experts_touched(weights.local_experts, shape.n_experts, shape.experts_per_token, 1)
    linear = roof(2 * batch * weights.active_params(per_token), weights.read_bytes(touched), compute_peak(job),
                  cal.matmul, job, cal)  # fmt: skip
    keys = sum(k.count * (min(job.context, k.window) if k.window else job.context) for k in kv.layers)
    attention = roof(batch * keys * attention_flops_per_key(job, True), batch * kv.request_bytes,
                     job.gpu.peak_flops(job.half), cal.flash, job, cal)  # fmt: skip
    return Step(batch, (linear,), (attention,))


def summed(steps: list[Step]) -> Step:
    """The stages' steps one after another."""
    return Step(steps[0].tokens, sum((s.linears for s in steps), ()), sum((s.attentions for s in steps), ()))


def serve_time(job: ServeJob, stages: tuple[tuple[Weights, KVCache], ...], batch: int) -> ServeTime:
    cal = job.calibration
    prefill = summed([prefill_step(job, w, kv, cal) for w, kv in stages])
    decode = summed([decode_step(job, w, kv, batch, cal) for w, kv in stages])
    return ServeTime(batch, prefill, decode)
