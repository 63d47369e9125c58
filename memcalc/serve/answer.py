"""A ServeJob in, its ServeAnswer out: the weights, the KV cache, vLLM's budget and blocks, the requests
and context that fit, the time on the roofline, and what to change when the job does not fit."""

from __future__ import annotations

from dataclasses import replace

from memcalc.records import record

from .budget import ActivationPeak, Budget, activation_peak, budget, longest_context
from .job import WEIGHT_FORMATS, ServeJob
from .kv import KVCache, kv_layers
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
    weights: Weights
    kv: KVCache
    activations: ActivationPeak
    budget: Budget
    max_concurrency: float  # vLLM's "Maximum concurrency for N tokens per request": blocks / a request's
    requests: int  # requests at the context the cache holds at once, at most max_num_seqs
    longest_context: int  # the longest single request the cache holds
    time: ServeTime
    changes: tuple[Change, ...] = ()  # what would fit, when this does not (or not the batch asked)

    @property
    def fits(self) -> bool:
        return self.requests >= (self.job.batch or 1)


def fitting(job: ServeJob) -> tuple[Weights, KVCache, ActivationPeak, Budget, float, int, int]:
    weights, layers = serving_weights(job), kv_layers(job)
    kv = KVCache(layers, job.context, job.kv_bytes)
    peak = activation_peak(job)
    b = budget(job, weights, layers, peak)
    per_request = b.request_blocks(job.context, job.batched_tokens)
    concurrency = b.num_blocks / per_request
    return weights, kv, peak, b, concurrency, min(int(concurrency), job.seqs), longest_context(b, job.batched_tokens)


def serve(job: ServeJob, advise: bool = True) -> ServeAnswer:
    """The answer for the job; with advise, the changes that would fit it where it does not."""
    weights, kv, peak, b, concurrency, requests, longest = fitting(job)
    batch = job.batch or max(1, requests)
    time = serve_time(job, weights, kv, batch)
    answer = ServeAnswer(job, weights, kv, peak, b, concurrency, requests, longest, time)
    if advise and not answer.fits:
        answer = replace(answer, changes=changes(job))
    return answer


def alternatives(job: ServeJob) -> list[tuple[str, ServeJob]]:
    """The changes memcalc tries, one at a time: a smaller KV cache, smaller weights, more GPUs, a higher
    utilization, a shorter context."""
    out = []
    if job.kv_dtype != "fp8":
        out.append(("--kv-cache-dtype fp8", replace(job, kv_dtype="fp8")))
    for fmt in WEIGHT_FORMATS[WEIGHT_FORMATS.index("fp8"):]:
        if fmt != job.weights and fmt != "int4-gptq":
            out.append((f"--weights {fmt}", replace(job, weights=fmt)))
    if job.model.shape.n_heads % (2 * job.tp) == 0:
        out.append((f"--tp {2 * job.tp}", replace(job, tp=2 * job.tp)))
    if job.gpu_memory_utilization < 0.95:
        out.append(("--gpu-memory-utilization 0.95", replace(job, gpu_memory_utilization=0.95)))
    if job.context > 1:
        out.append((f"--context {job.context // 2}", replace(job, context=job.context // 2)))
    return out


def changes(job: ServeJob) -> tuple[Change, ...]:
    out = []
    for label, other in alternatives(job):
        *_, requests, longest = fitting(other)
        out.append(Change(label, requests, longest))
    return tuple(out)
