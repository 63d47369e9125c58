"""A ServeJob in, its ServeAnswer out: the weights, the KV cache, vLLM's budget and blocks, the requests
and context that fit, the time on the roofline, and what to change when the job does not fit."""

from __future__ import annotations

from dataclasses import replace

from memcalc.model.shape import longest_seq
from memcalc.records import record

from .budget import Budget, budget, longest_context
from .job import WEIGHT_FORMATS, ServeJob
from .kv import KVCache, kv_layers
from .profile import ActivationPeak, activation_peak
from .sglang import SGLangBudget, sglang_budget
from .stages import Stage, pipeline_stages
from .timing import ServeTime, serve_time
from .weights import Weights, serving_weights


@record(frozen=True)
class Change:
    """One change to the job, and the requests at the context it would fit."""

    change: str
    requests: int
    longest_context: int


@record(frozen=True)
class ServeAnswer:
    """What one GPU of the server holds and does (bytes are integers, one GPU's)."""

    job: ServeJob
    weights: Weights  # the binding stage's GPU (every GPU without pipeline parallel)
    kv: KVCache
    activations: ActivationPeak
    budget: Budget
    max_concurrency: float  # vLLM's "Maximum concurrency for N tokens per request": blocks / a request's
    requests: int  # requests at the context the cache holds at once, at most max_num_seqs
    longest_context: int  # the longest single request the cache holds
    time: ServeTime
    changes: tuple[Change, ...] = ()  # what would fit, when this does not (or not the batch asked)
    sglang: SGLangBudget | None = None  # SGLang's pool on the same GPU (--sglang)
    model_runner: str = ""  # the runner the budget follows: --model-runner, else the release's (ServeJob.runner)
    sampler: str = ""  # what samples in the profile run: greedy (V2 before 0.33), torch or flashinfer
    release: str = ""  # the span of releases whose rule applies ("vLLM 0.21 to 0.26")

    @property
    def fits(self) -> bool:
        return self.requests >= (self.job.batch or 1)


@record(frozen=True)
class StageParts:
    """One pipeline stage's GPU: its weights, KV cache and profile-run peak."""

    stage: Stage
    weights: Weights
    kv: KVCache
    activations: ActivationPeak


def stage_parts(job: ServeJob) -> tuple[StageParts, ...]:
    out = []
    for st in pipeline_stages(job.model.shape.n_layers, job.pp):
        kv = KVCache(kv_layers(job, st.layers()), job.context, job.kv_bytes)
        out.append(StageParts(st, serving_weights(job, st), kv, activation_peak(job, st)))
    return tuple(out)


def fitting(job: ServeJob) -> tuple[tuple[StageParts, ...], Budget, float, int, int]:
    parts = stage_parts(job)
    b = budget(job, tuple((p.stage, p.weights, p.activations) for p in parts))
    concurrency = b.num_blocks / b.request_blocks(job.context, job.batched_tokens)
    longest = longest_context(b, job.batched_tokens, longest_seq(job.model.shape))
    return parts, b, concurrency, min(int(concurrency), job.seqs), longest


def serve(job: ServeJob, advise: bool = True) -> ServeAnswer:
    """The answer for the job; with advise, the changes that would fit it where it does not. The memory
    shown is the binding stage's GPU (the one with the fewest blocks); the time crosses every stage."""
    parts, b, concurrency, requests, longest = fitting(job)
    batch = job.batch or max(1, requests)
    time = serve_time(job, tuple((p.weights, p.kv) for p in parts), batch)
    one = parts[b.binding.stage.index]
    pool = sglang_budget(job, one.weights.total_bytes) if job.sglang else None
    answer = ServeAnswer(job, one.weights, one.kv, one.activations, b, concurrency, requests, longest, time,
                         sglang=pool, model_runner=job.runner, sampler=job.sampled_by,
                         release=job.release.label)  # fmt: skip
    if advise and not answer.fits:
        answer = replace(answer, changes=changes(job))
    return answer


def alternatives(job: ServeJob) -> list[tuple[str, ServeJob]]:
    """The changes memcalc tries, one at a time: a smaller KV cache, smaller weights, more GPUs, a higher
    utilization, a shorter context."""
    out = []
    if job.kv_dtype != "fp8":
        out.append(("--kv-cache-dtype fp8", replace(job, kv_dtype="fp8")))
    for fmt in WEIGHT_FORMATS[WEIGHT_FORMATS.index("fp8"):]:  # int4-gptq and fp8-block: about int4-awq's, fp8's
        if fmt != job.weights and fmt not in ("int4-gptq", "fp8-block") and (fmt != "fp8" or job.gpu.bf16_tflops):
            out.append((f"--weights {fmt}", replace(job, weights=fmt)))
    if job.model.shape.n_heads % (2 * job.tp) == 0:
        out.append((f"--tp {2 * job.tp}", replace(job, tp=2 * job.tp)))
    if job.utilization < 0.95 and job.kv_cache_memory is None:
        out.append(("--gpu-memory-utilization 0.95", replace(job, gpu_memory_utilization=0.95)))
    if job.kv_cache_memory is None:
        held = fitting(job)[-1]  # the longest request the blocks hold, if shorter than asked
        if 0 < held < job.context:
            out.append((f"--context {held}", replace(job, context=held)))
    return out


def changes(job: ServeJob) -> tuple[Change, ...]:
    out = []
    for label, other in alternatives(job):
        *_, requests, longest = fitting(other)
        out.append(Change(label, requests, longest))
    return tuple(out)
