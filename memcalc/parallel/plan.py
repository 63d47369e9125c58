"""`memcalc plan`: every valid layout of a job on N GPUs, those that fit, ranked by predicted tokens/s.

Searched: TP (inside a node, dividing the heads, KV heads and MLP width; Narayanan et al. 2021, sec. 3.3:
TP across nodes is never worth it), sequence parallel on or off, PP (the stack's stage split: even where
it divides the layers, else torchtitan's with the embedding and head weighed as a layer each), interleaving
v dividing the layers per stage, CP (with flash), DP = the rest; the ZeRO stages the stack's engine runs
(memcalc.parallel.engines: 0-3, 0-1 with PP; FSDP2 ZeRO-3 with PP too), hybrid shard, optimizer and
parameter offload; the micro-batch b (powers of two up to 16, dividing the batch per replica;
m = global batch / (dp · b)) and the recompute mode: the layouts themselves come from search.py.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from dataclasses import replace

from memcalc.errors import InputError
from memcalc.exact.base.collection import no_collection
from memcalc.memory.estimate import DEFAULT_MFU, Setup
from memcalc.memory.state import MAX_GPUS
from memcalc.model.gpus import GPU, HOST_MEMORY_BYTES, check_precision
from memcalc.model.headroom import Headroom, headroom
from memcalc.model.layout import Layout
from memcalc.model.shape import MAX_BATCH, Model, check_positions, check_size
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks, check_layer_uniform, layout_counts
from memcalc.records import record
from memcalc.time.calibration import Calibration, calibration_for
from memcalc.time.roofline import traceable

from .checks import check_layout
from .comm import StepTime, step_lower_bound, step_time
from .engines import engine_layout
from .links import ASSUMPTIONS, Assumptions
from .search import check_without, expert_layouts, layouts
from .stage_memory import LayoutMemory, layout_memory, layout_peak
from .verdict import Verdict, gpu_verdict, sharded_data_parallel, verdict_fit

BF16_FLASH = Tricks("bf16", flash=True)  # the recipe the planner assumes unless told


@record(slots=True)
class LayoutEstimate:
    """One layout of one job: per-GPU memory stage by stage, and the step time."""

    model: Model
    gpu: GPU
    setup: Setup  # seq_len, micro_batch b, grad_accum m (micro-batches per pipeline), optimizer, mfu
    tricks: Tricks
    layout: Layout
    memory: LayoutMemory | None  # the textbook's stages; None where it has no per-layer formula (ckpt:N, sac)
    time: StepTime
    verdict: Verdict  # one GPU's peak as the stack allocates it (memcalc.parallel.verdict): whether it fits
    headroom: Headroom  # what the verdict's usable_bytes keeps back of the GPU, by part (memcalc.model.headroom)

    @property
    def gpus(self) -> int:
        return self.layout.world

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: dp · b · m."""
        return self.layout.dp * self.setup.micro_batch * self.setup.grad_accum

    @property
    def cluster_bytes(self) -> int:
        """GPU memory of the whole job: each stage's per-GPU total on its tp · cp · dp GPUs."""
        per_stage = self.layout.tp * self.layout.cp * self.layout.dp
        return per_stage * sum(st.total_bytes for st in self.memory.stages)

    @property
    def cluster_host_bytes(self) -> int:
        per_stage = self.layout.tp * self.layout.cp * self.layout.dp
        return per_stage * sum(st.state.host_bytes for st in self.memory.stages)


def layout_estimate(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout,
                    assume: Assumptions = ASSUMPTIONS, ends_only: bool = False,
                    timing: Calibration | float | None = None) -> LayoutEstimate:  # fmt: skip
    """Memory (every stage unless ends_only) and step time of one layout, as the stack's engine runs it.
    timing: the roofline's calibration (None: the GPU's shipped one), or --mfu's end-to-end rate."""
    check_positions(model.shape, setup.seq_len)
    layout = engine_layout(layout, setup.stack.engine)
    if layout_counts(tricks, model.shape.is_moe):
        memory = layout_memory(model, setup, gpu, tricks, layout, ends_only)
    else:  # ckpt:N: no per-layer formula; a data-parallel job is timed on its weights alone
        if max(layout.tp, layout.pp, layout.cp, layout.ep, layout.etp) > 1:
            check_layer_uniform(tricks, "the parallel layouts")
        check_layout(layout, model.shape, setup.seq_len, tricks, setup.grad_accum, setup.stack.engine)
        memory = None
    time = step_time(model, setup, gpu, tricks, layout, memory, assume, timing)
    verdict = gpu_verdict(model, setup, gpu, tricks, layout)
    return LayoutEstimate(model, gpu, setup, tricks, layout, memory, time, verdict, headroom(gpu, layout.groups))


@record(slots=True)
class Alternative:
    """An obvious family of layouts and why its best member loses to the winner."""

    name: str
    estimate: LayoutEstimate  # its fastest layout that fits; if none fits, the one needing least memory
    fits: bool
    cause: str  # "out of memory", or the StepTime.breakdown key that costs it most against the winner
    seconds: float  # that cause's seconds per step in this layout (0 when out of memory)
    best_seconds: float  # the same cause in the winner


@record(slots=True)
class Plan:
    """Every layout of a job over many GPUs that was searched, and those that fit, ranked."""

    model: Model
    gpu: GPU
    gpus: int
    gpus_per_node: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    tricks: Tricks  # precision and flash as given; recompute is searched
    optimizer: str
    timing: Calibration | float  # the roofline's calibration, or --mfu's end-to-end rate
    stack: Stack
    searched: int  # valid layouts evaluated (each with one micro-batch size and recompute mode)
    fitting: int  # of those, how many fit in memory
    fitting_kinds: int  # how many kinds (kind_of) the layouts that fit are of
    best: tuple[LayoutEstimate, ...]  # the fastest of each of the `top` fastest kinds that fit, fastest first, every
    # stage computed: min(top, fitting_kinds) of them
    alternatives: tuple[Alternative, ...]
    without: tuple[str, ...] = ()  # features left out of the search (search.WITHOUT)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


Family = Callable[[Layout, Tricks], bool]

# The alternatives people reach for first; each one not containing the winner gets a line saying why it loses.
FAMILIES: tuple[tuple[str, Family], ...] = (
    ("data parallel only (DDP, ZeRO-0)", lambda lay, t: lay.tp == lay.pp == lay.cp == 1 and lay.zero == 0),
    ("FSDP / ZeRO-3 only, no model parallel", lambda lay, t: lay.tp == lay.pp == lay.cp == 1 and lay.zero == 3),
    ("tensor + data parallel, no pipeline", lambda lay, t: lay.tp > 1 and lay.pp == 1 and lay.cp == 1),
    ("with pipeline parallel", lambda lay, t: lay.pp > 1),
    ("without pipeline parallel", lambda lay, t: lay.pp == 1),
    ("with context parallel", lambda lay, t: lay.cp > 1),
    ("tensor parallel without sequence parallel", lambda lay, t: lay.tp > 1 and not lay.sp),
    ("no activation recompute", lambda lay, t: t.recompute == "none"),
    ("full activation recompute", lambda lay, t: t.recompute == "full"),
    ("CPU offload", lambda lay, t: lay.offload_optimizer),
    ("without expert parallel", lambda lay, t: lay.ep == 1),
)


def plan(model: Model, gpu: GPU, gpus: int, seq_len: int, global_batch: int, gpus_per_node: int = 8,
         tricks: Tricks = BF16_FLASH, optimizer: str = "adamw", timing: Calibration | float | None = None,
         assume: Assumptions = ASSUMPTIONS, top: int = 5, recomputes: tuple[str, ...] = ("none", "selective", "full"),
         offload: bool = True, host_memory: int = HOST_MEMORY_BYTES, stack: Stack = DEFAULT_STACK,
         prune: bool = True, without: tuple[str, ...] = ()) -> Plan:  # fmt: skip
    """Search every valid layout the stack's engine runs, keep those that fit (the GPU, and the host's memory
    for offload), rank them by tokens/s: the roofline's (timing a Calibration, or None for the GPU's shipped
    one) or --mfu's end-to-end rate (timing a float).

    The roofline traces one block per TP shard, CP share, micro-batch and recompute mode; to trace only
    what can matter, the layouts that fit are timed in the order of a lower bound on their step
    (memcalc.parallel.comm.step_lower_bound), and one is skipped when its bound is already slower than
    the best of its kind, the top layouts' cut and the best of each family it belongs to: the ranking
    and the alternatives are those of timing every layout (prune=False; tests/test_plan.py)."""
    check_size("gpus", gpus, limit=MAX_GPUS)
    check_size("gpus per node", gpus_per_node, limit=MAX_GPUS)
    check_positions(model.shape, seq_len)
    check_size("global batch", global_batch, limit=MAX_BATCH)
    check_size("top", top, limit=1000)
    check_without(without)
    check_precision(gpu, tricks.precision, tricks.fp8_name)
    without = tuple(sorted(set(without)))
    timing = calibration_for(gpu.key) if timing is None else timing
    if not isinstance(timing, float) and not traceable(model.shape):  # no kernels to time: the default MFU does
        timing = DEFAULT_MFU
    mfu = timing if isinstance(timing, float) else DEFAULT_MFU
    base = Setup(seq_len=seq_len, optimizer=optimizer, mfu=mfu, host_memory=host_memory, stack=stack)  # validates them
    variants = recompute_variants(tricks, recomputes)
    found = layouts(model, gpus, gpus_per_node, seq_len, global_batch, tricks.flash, offload, stack.engine, without)
    if not stack.finetune.trains_all:  # LoRA, frozen weights: replayed on data parallelism alone, ZeRO and FSDP too
        found = (f for f in found if sharded_data_parallel(f[0], stack.engine))
    with no_collection():  # the search makes some 10^5 short-lived objects, none in a cycle
        candidates, family_small, searched = fitting(model, gpu, base, expert_layouts(model, found), variants, assume,
                                                     timing, prune)  # fmt: skip
        best, family_best = confirmed(model, gpu, candidates, family_small, assume, timing, top)
        others = alternatives(model, gpu, assume, best, family_best, family_small, timing)
    return Plan(model, gpu, gpus, gpus_per_node, seq_len, global_batch, tricks, optimizer, timing, stack, searched,
                len(candidates), len({kind_of(c[1], c[3]) for c in candidates}), best, others, without)  # fmt: skip


def confirmed(model: Model, gpu: GPU, candidates: list[tuple], family_small: dict[str, tuple], assume: Assumptions,
              timing: Calibration | float, top: int) -> tuple[tuple[LayoutEstimate, ...], dict]:  # fmt: skip
    """The fastest `top` kinds, each estimated as estimate would (gpu_verdict with the caching allocator
    replayed where the peak comes close); a layout whose tensors fit but whose allocator runs out is struck
    from the candidates (noted in family_small) and the ranking run again without it."""
    while True:
        ranked, family_best = timed(model, gpu, candidates, assume, timing, top)
        ranked.sort(key=lambda e: e[0])
        best = tuple(layout_estimate(model, s, gpu, t, lay, assume, timing=timing)
                     for _, lay, s, t, _, _ in distinct(ranked, top))  # fmt: skip
        out = {(e.layout, e.setup, e.tricks): e.verdict.total_bytes for e in best if not e.verdict.fits}
        if not out:
            return best, family_best
        for key, total in out.items():
            note(family_small, key[0], key[2], (total, *key))
        candidates = [c for c in candidates if (c[1], c[2], c[3]) not in out]


def fitting(model: Model, gpu: GPU, base: Setup, found: Iterator[tuple[Layout, int, int]], variants: tuple[Tricks, ...],
            assume: Assumptions, timing: Calibration | float, prune: bool) -> tuple[list[tuple], dict[str, tuple], int]:  # fmt: skip
    """The layouts found (each with micro-batch b and m micro-batches) under each trick set that fit, with a
    lower bound on their step (layout_peak's memory, verdict_fit's replay where one applies); per family the
    layout that needs the least memory of those that do not; how many were searched."""
    candidates, searched = [], 0
    family_small: dict[str, tuple] = {}
    too_big: set[tuple] = set()  # (layout, tricks) that did not fit at a smaller micro-batch
    setups: dict[tuple[int, int], Setup] = {}  # one per (b, m): the halves of stage memory are remembered by it
    for layout, b, m in found:
        for t in variants:
            searched += 1
            if prune and (layout, t) in too_big:  # a larger micro-batch never holds less: skipped unbuilt
                continue
            setup = setups.get((b, m))
            if setup is None:
                setup = setups[b, m] = replace(base, micro_batch=b, grad_accum=m)
            peak = layout_peak(model, setup, gpu, t, layout)
            total, fits = verdict_fit(model, setup, gpu, t, layout, peak)
            if fits:
                bound = step_lower_bound(model, setup, gpu, t, layout, peak, assume, timing, False) if prune else 0.0
                candidates.append((bound, layout, setup, t, peak, total))
            else:
                too_big.add((layout, t))
                note(family_small, layout, t, (total, layout, setup, t))  # the least memory first
    return candidates, family_small, searched


def timed(model: Model, gpu: GPU, candidates: list[tuple], assume: Assumptions, timing: Calibration | float,
          top: int) -> tuple[list[tuple], dict[str, tuple]]:  # fmt: skip
    """Step times of the layouts that fit, in the order of their lower bounds, skipping those whose bound
    says they cannot be the best of their kind, nor among the `top` kinds, nor the best of a family."""
    candidates.sort(key=lambda c: c[0])
    fitting, family_best = [], {}
    kind_best: dict[tuple, float] = {}
    bests: list[float] = []  # kind_best's values, sorted: the top kinds' cut is bests[top - 1]
    family_seconds: dict[str, float] = {}  # the step time of each family's best in family_best
    member_of: dict[tuple, tuple[str, ...]] = {}  # the families of a kind with or without CP (all they read)
    for bound, layout, setup, t, peak, total in candidates:
        kind = kind_of(layout, t)
        limit = min(kind_best.get(kind, math.inf), bests[top - 1] if len(bests) >= top else math.inf)
        families = member_of.get((kind, layout.cp > 1))
        if families is None:
            families = member_of[kind, layout.cp > 1] = tuple(name for name, member in FAMILIES if member(layout, t))
        limit = max([limit] + [family_seconds.get(f, math.inf) for f in families])
        if bound > limit * (1 + 1e-5):  # slower than everything it could displace, whatever its exact time
            continue
        if bound and step_lower_bound(model, setup, gpu, t, layout, peak, assume, timing) > limit * (1 + 1e-5):
            continue  # the tighter bound, from one traced sequence per micro-batch
        memory = layout_memory(model, setup, gpu, t, layout, ends_only=True)
        time = step_time(model, setup, gpu, t, layout, memory, assume, timing)
        entry = (rank_key(time.tokens_per_second, layout, total), layout, setup, t, memory, time)
        fitting.append(entry)
        note(family_best, layout, t, entry)
        family_seconds.update((f, family_best[f][5].step_seconds) for f in families)
        improve(kind_best, bests, kind, time.step_seconds)
    return fitting, family_best


def improve(kind_best: dict[tuple, float], bests: list[float], kind: tuple, seconds: float) -> None:
    """A kind's best step time lowered to seconds if faster, bests (every kind's, sorted) kept in step: the
    step time a kind must beat to enter the `top` fastest kinds is bests[top - 1]."""
    old = kind_best.get(kind)
    if old is not None and old <= seconds:
        return
    if old is not None:
        del bests[bisect_left(bests, old)]
    insort(bests, seconds)
    kind_best[kind] = seconds


def kind_of(lay: Layout, tricks: Tricks) -> tuple:
    """What makes two layouts different kinds: all but how dp, cp and the micro-batch split the batch."""
    return (lay.tp, lay.sp, lay.pp, lay.vpp, lay.zero, lay.hybrid, lay.offload_optimizer, lay.offload_params,
            tricks.recompute, lay.ep)  # fmt: skip


def distinct(ranked: list[tuple], top: int) -> list[tuple]:
    """The first `top` entries that differ in more than how dp, cp and the micro-batch split the batch."""
    seen, out = set(), []
    for entry in ranked:
        kind = kind_of(entry[1], entry[3])
        if kind not in seen:
            seen.add(kind)
            out.append(entry)
            if len(out) == top:
                break
    return out


def rank_key(tokens_per_second: float, layout: Layout, total_bytes: int) -> tuple:
    """Fastest first; on equal speed (4 digits: what differs past them is the order sums were taken in) the
    simpler layout (no CP, then fewer stages), then less memory."""
    return (-float(f"{tokens_per_second:.4g}"), layout.cp, layout.pp, layout.vpp, layout.zero, total_bytes)


def note(table: dict[str, tuple], layout: Layout, tricks: Tricks, entry: tuple) -> None:
    """Keep, per family, the entry whose key (entry[0]) is smallest."""
    for name, member in FAMILIES:
        if member(layout, tricks) and (name not in table or entry[0] < table[name][0]):
            table[name] = entry


def recompute_variants(tricks: Tricks, recomputes: tuple[str, ...]) -> tuple[Tricks, ...]:
    """The trick sets to try. Searched beside other modes, selective recompute with flash is left out: it keeps
    what none keeps and recomputes the attention core for it (memcalc.model.tricks.trick_warnings); named
    alone (--tricks bf16,flash,selective), it is what the job runs and is ranked, with that warning."""
    if not recomputes:
        raise InputError("name a recompute mode to search: none, selective or full")
    names = [r for r in recomputes if not (tricks.flash and r == "selective" and len(recomputes) > 1)]
    return tuple(replace(tricks, recompute=r, ckpt_every=1) for r in names)  # fp8 and compile as given


def alternatives(model: Model, gpu: GPU, assume: Assumptions, best: tuple[LayoutEstimate, ...],
                 family_best: dict[str, tuple], family_small: dict[str, tuple],
                 timing: Calibration | float | None = None) -> tuple[Alternative, ...]:  # fmt: skip
    """For each family the winner is not in: its fastest fitting layout and what costs it most, or OOM."""
    winner = best[0] if best else None
    out = []
    for name, member in FAMILIES:
        if winner and member(winner.layout, winner.tricks):
            continue
        if winner and name in family_best:
            _, layout, setup, tricks, _, _ = family_best[name]
            est = layout_estimate(model, setup, gpu, tricks, layout, assume, timing=timing)
            if not est.verdict.fits:  # its tensors fit; the caching allocator, replayed, runs out
                out.append(Alternative(name, est, False, "out of memory", 0.0, 0.0))
                continue
            cause, mine, theirs = worst_cause(est.time, winner.time)
            out.append(Alternative(name, est, True, cause, mine, theirs))
        elif name in family_small:
            _, layout, setup, tricks = family_small[name]
            est = layout_estimate(model, setup, gpu, tricks, layout, assume, timing=timing)
            out.append(Alternative(name, est, False, "out of memory", 0.0, 0.0))
    return tuple(out)


def worst_cause(time: StepTime, best: StepTime) -> tuple[str, float, float]:
    """The part of the step that grew most against the winner's, with both values ("tie" within 0.5%)."""
    mine, theirs = time.breakdown, best.breakdown
    if time.step_seconds <= best.step_seconds * 1.005:
        return "tie", time.step_seconds, best.step_seconds
    key = max(mine, key=lambda k: mine[k] - theirs.get(k, 0.0))
    return key, mine[key], theirs.get(key, 0.0)
