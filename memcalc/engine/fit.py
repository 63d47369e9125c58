"""`memcalc fit`: the longest sequence and the largest micro-batch that fit, by the job's own verdict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memcalc.memory.setup import Setup
from memcalc.model.gpus import GPU, check_precision
from memcalc.model.headroom import Headroom, headroom
from memcalc.model.layout import Layout
from memcalc.model.shape import MAX_BATCH, MAX_SEQ, Model, check_positions, longest_seq
from memcalc.model.tricks import Tricks
from memcalc.parallel.verdict import Verdict, gpu_verdict
from memcalc.records import record

from .job import check_finetune


@record(slots=True)
class FitLimits:
    """The longest sequence and the largest micro-batch that fit one GPU of the job under a trick set."""

    tricks: Tricks
    gpu: str
    usable_bytes: int  # the GPU's memory less the headroom
    seq_len: int  # the sequence length the micro-batch limit is computed at
    micro_batch: int  # the micro-batch the sequence limit is computed at
    max_seq_len: int  # 0: not even one token fits
    max_micro_batch: int  # 0: not even one sequence fits
    memory_at_max_seq: Verdict | None
    memory_at_max_batch: Verdict | None
    seq_limit: int  # the longest sequence the model embeds (a learned position table), else MAX_SEQ
    headroom: Headroom | None = None  # what usable_bytes keeps back, by part

    @property
    def seq_capped(self) -> bool:
        """Whether the position table, not memory, ends the sequence."""
        return self.max_seq_len == self.seq_limit < MAX_SEQ


def largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for fits monotone decreasing; 0 if none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_reserved(verdict: Callable[..., Verdict], limit: int) -> int:
    """The largest n in [1, limit] whose verdict(n) fits, 0 if none: first by the tensors' peak alone
    (verdict(n, False): cheap, and the caching allocator's reserve holds at least the tensors), then, where the
    replayed allocator says the largest of those does not fit, below it: first where the tensors leave the
    room the allocator left idle there, then galloping down and halving (each probe one replay)."""
    hi = largest(lambda n: verdict(n, False).fits, limit)
    if hi == 0 or verdict(hi).fits:
        return hi
    at = verdict(hi)
    idle = (at.reserved.reserved_bytes - at.peak_bytes) if at.reserved is not None else 0
    guess = largest(lambda n: verdict(n, False).peak_bytes + idle <= at.usable_bytes, hi - 1)
    lo = min(guess, hi - 1)
    while lo >= 1 and not verdict(lo).fits:  # hi does not fit
        lo, hi = lo - 2 * (hi - lo), lo
    lo = max(lo, 0)
    while hi - lo > 1:  # verdict(lo) fits (or lo is 0), verdict(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if verdict(mid).fits else (lo, mid)
    return lo


def fit_limits(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout = Layout()) -> FitLimits:
    """The longest sequence (no longer than the model's position table) at setup's micro-batch, and the
    largest micro-batch at setup's sequence, each by the verdict estimate gives the same job."""
    check_positions(model.shape, setup.seq_len)
    check_precision(gpu, tricks.precision, tricks.fp8_name)
    check_finetune(model, setup, layout, (tricks,))

    def memory(seq_len: int, micro_batch: int, allocator: bool = True) -> Verdict:
        at = replace(setup, seq_len=seq_len, micro_batch=micro_batch)
        return gpu_verdict(model, at, gpu, tricks, layout, allocator)

    seq_limit = longest_seq(model.shape)
    max_seq = largest_reserved(lambda s, a=True: memory(s, setup.micro_batch, a), seq_limit)
    max_batch = largest_reserved(lambda b, a=True: memory(setup.seq_len, b, a), MAX_BATCH)
    return FitLimits(
        tricks=tricks,
        gpu=gpu.key,
        usable_bytes=memory(max(max_seq, 1), setup.micro_batch).usable_bytes,
        seq_len=setup.seq_len,
        micro_batch=setup.micro_batch,
        max_seq_len=max_seq,
        max_micro_batch=max_batch,
        memory_at_max_seq=memory(max_seq, setup.micro_batch) if max_seq else None,
        memory_at_max_batch=memory(setup.seq_len, max_batch) if max_batch else None,
        seq_limit=seq_limit,
        headroom=headroom(gpu, layout.groups),
    )
