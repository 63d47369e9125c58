"""`memcalc fit`: the longest sequence and the largest micro-batch that fit, by the job's own verdict."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from memcalc.memory.setup import Setup, group_rows
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
    none_fit_at: str = ""  # where nothing fits: where one token's run peaks (a model's load: memcalc.exact.replay.zero)
    # --rl grpo|rloo: the phase beside the step that ends the limit where not the step (memcalc.engine.rollout:
    # "rollout", "score", vLLM's "start" or "startup"), else ""
    seq_bound_by: str = ""
    batch_bound_by: str = ""

    @property
    def seq_capped(self) -> bool:
        """Whether the position table, not memory, ends the sequence."""
        return self.max_seq_len == self.seq_limit < MAX_SEQ


def largest(fits: Callable[[int], bool], limit: int, margins: dict[int, int] | None = None) -> int:
    """The largest n in [1, limit] with fits(n), for fits monotone decreasing; 0 if none. Where fits records each
    probe's margin in margins (bytes over the budget, negative under: near affine in a sequence's or a batch's
    length), the probes follow the line through the two last: out to just past where it crosses zero until one does
    not fit (a doubling where it does not rise, and after a step it fell short on), then inside the bracket (regula
    falsi), a halving after any step that did not halve it: at most twice halving's probes.
    The same answer as doubling and halving, in a handful of probes where those take some thirty."""
    margins = {} if margins is None else margins
    if not fits(1):
        return 0
    lo, hi, line = 1, 2, True
    while hi <= limit and fits(hi):
        last = crossing(margins, lo, hi) if line else None
        line = last is None  # after a line that fell short of one that fits, a doubling
        lo, hi = hi, last + 1 if last is not None and last >= hi else 2 * hi
    hi = min(hi, limit + 1)
    line = True
    while hi - lo > 1:  # fits(lo), not fits(hi)
        width = hi - lo
        guess = crossing(margins, lo, hi) if line else None
        mid = (lo + hi) // 2 if guess is None else min(max(guess, lo + 1), hi - 1)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        line = guess is None or 2 * (hi - lo) <= width
    return lo


def crossing(margins: dict[int, int], a: int, b: int) -> int | None:
    """The last n at or below where the line through (a, margins[a]) and (b, margins[b]) crosses zero (the last
    that fits, were the margin affine); None where either is unknown or the line does not rise."""
    if a not in margins or b not in margins or margins[b] <= margins[a]:
        return None
    return a + math.floor(-margins[a] * (b - a) / (margins[b] - margins[a]))


def largest_reserved(verdict: Callable[..., Verdict], limit: int) -> int:
    """The largest n in [1, limit] whose verdict(n) fits, 0 if none: first by the tensors' peak alone
    (verdict(n, False): cheap, and the caching allocator's reserve holds at least the tensors), then, where the
    replayed allocator says the largest of those does not fit, below it, each probe one replay (Search)."""
    peaks: dict[int, int] = {}

    margins: dict[int, int] = {}

    def cheap(n: int) -> bool:
        v = verdict(n, False)
        peaks[n] = v.peak_bytes
        usable = getattr(v, "usable_bytes", None)
        if usable is not None:
            margins[n] = v.peak_bytes - usable
        return v.fits

    hi = largest(cheap, limit, margins)
    if hi == 0:
        return 0
    search = Search(verdict, peaks, hi)
    return search.below() if not search.fits(hi) else hi


class Search:
    """Down from hi, the lowest known not to fit, to the highest that fits. Where a probe ran out, a step of
    Newton's: down by the bytes the driver lacked over what a unit adds to the tensors' peak (newton_below).
    Those bytes mislead where a large segment is refused (fragmentation), so the steps are held to a bound:
    until a probe fits, two of Newton's, then galloping down (each step twice the last); between one that fits
    and one that does not, a halving after any step that did not halve the interval. At most about three times
    halving's probes; mostly fewer (36,115 tokens of Qwen3-8B's QLoRA on an H100: 8 replays, where a guess from
    the idle reserve and halving took 15)."""

    def __init__(self, verdict: Callable[..., Verdict], peaks: dict[int, int], hi: int):
        self.verdict, self.peaks = verdict, peaks
        self.lo, self.hi, self.short = 0, hi, 0  # lo fits (0: by fiat), hi does not, and ran short by `short`

    def fits(self, n: int) -> bool:
        """Probe n: move lo or hi to it."""
        v = self.verdict(n)
        self.peaks[n] = v.peak_bytes
        if v.fits:
            self.lo = n
        else:
            self.hi, self.short = n, v.reserved.short_bytes if v.reserved is not None else 0
        return v.fits

    def newton(self) -> int | None:
        guess = newton_below(self.hi, self.short, self.peaks)
        return guess if guess is not None and self.lo < guess < self.hi else None

    def below(self) -> int:
        tries, down = 2, 1
        while self.lo == 0 and self.hi > 1:  # none fits yet
            guess = self.newton() if tries else None
            tries = max(tries - 1, 0)
            if guess is None:
                guess, down = max(self.hi - down, self.hi // 2), down * 2
            else:
                down = 2 * (self.hi - guess)
            self.fits(guess)
        newton = True
        while self.hi - self.lo > 1:
            guess, width = self.newton() if newton else None, self.hi - self.lo
            self.fits(guess if guess is not None else (self.lo + self.hi) // 2)
            newton = guess is None or 2 * (self.hi - self.lo) <= width
        return self.lo


def newton_below(hi: int, short: int, peaks: dict[int, int]) -> int | None:
    """Where the allocator would just fit below hi, which ran short by `short` bytes: hi less those bytes over the
    tensors' peak growth per unit, measured from the nearest known peak below it; None where there is no measure."""
    below = [n for n in peaks if n < hi]
    if short <= 0 or not below or hi not in peaks:
        return None
    m = max(below)
    slope = (peaks[hi] - peaks[m]) / (hi - m)
    return hi - math.ceil(short / slope) if slope > 0 else None


def fit_limits(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout = Layout()) -> FitLimits:
    """The longest sequence (no longer than the model's position table) at setup's micro-batch, and the
    largest micro-batch at setup's sequence, each by the verdict estimate gives the same job."""
    check_positions(model.shape, setup.seq_len)
    check_precision(gpu, tricks.precision, tricks.fp8_name)
    check_finetune(model, setup, layout, (tricks,))

    def memory(seq_len: int, micro_batch: int, allocator: bool = True) -> Verdict:
        at = replace(setup, seq_len=seq_len, micro_batch=micro_batch)
        return gpu_verdict(model, at, gpu, tricks, layout, allocator)

    def beside(seq_len: int, micro_batch: int, margins: dict[int, int], n: int) -> str:
        """The first phase beside the step that does not fit at this size ("" where they fit): GRPO's and RLOO's
        rollout (vLLM awake, or the policy's own generate) and scoring passes."""
        from .rollout import beside_fails

        at = replace(setup, seq_len=seq_len, micro_batch=micro_batch)
        failed, margins[n] = beside_fails(model, gpu, at, memory(seq_len, micro_batch))
        return failed

    def within(found: int, size: Callable[[int], tuple[int, int]]) -> tuple[int, str]:
        """found, or where a phase beside the step ends the search below it, and that phase's name."""
        if not found or setup.stack.online is None and setup.stack.ppo is None:
            return found, ""
        failed = beside(*size(found), {}, found)
        if not failed:
            return found, ""
        margins: dict[int, int] = {}
        return largest(lambda n: not beside(*size(n), margins, n), found - 1, margins), failed

    seq_limit, per = longest_seq(model.shape), setup.per_sample  # DPO: the micro-batch in pairs, two sequences each
    below = setup.shortest_seq - 1  # GRPO: the completion's length held, the prompt searched
    found = largest_reserved(lambda s, a=True: memory(s + below, setup.micro_batch, a), seq_limit - below)
    found, seq_bound = within(found, lambda s: (s + below, setup.micro_batch))
    max_seq = found + below if found else 0
    unit = group_rows(setup, layout.world)  # GRPO: whole prompt groups per generation batch
    found = largest_reserved(lambda b, a=True: memory(setup.seq_len, b * per * unit, a), MAX_BATCH // (per * unit))
    found, batch_bound = within(found, lambda b: (setup.seq_len, b * per * unit))
    max_batch = found * unit
    return FitLimits(
        tricks=tricks,
        gpu=gpu.key,
        usable_bytes=memory(max(max_seq, below + 1), setup.micro_batch).usable_bytes,
        seq_len=setup.seq_len,
        micro_batch=setup.samples,
        max_seq_len=max_seq,
        max_micro_batch=max_batch,
        memory_at_max_seq=memory(max_seq, setup.micro_batch) if max_seq else None,
        memory_at_max_batch=memory(setup.seq_len, max_batch * per) if max_batch else None,
        seq_limit=seq_limit,
        headroom=headroom(gpu, layout.groups),
        none_fit_at=memory(below + 1, setup.micro_batch, False).peak_at if not max_seq else "",
        seq_bound_by=seq_bound,
        batch_bound_by=batch_bound,
    )
