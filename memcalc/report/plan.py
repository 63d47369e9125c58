"""What `memcalc plan` shows: the fastest layouts that fit, their memory and time by part, and why the
obvious alternatives lose (a layout of one job is memcalc.report.layout's)."""

from __future__ import annotations

from dataclasses import replace

from memcalc.parallel.plan import Alternative, Plan
from memcalc.parallel.search import WITHOUT

from . import units as u
from .headroom import fragmentation_note, headroom_line
from .layout import CAUSES, assumption_notes, held_text, layout_text, sharding_text
from .render import Section, sized


def plan_preamble(plan: Plan, units: str = "gb") -> list[str]:
    g, t = plan.gpu, plan.tricks
    return [
        f"Model: {plan.model.origin}",
        f"Job: {plan.gpus} x {g.key} ({plan.gpus_per_node} per node), seq {plan.seq_len:,}, global batch "
        f"{plan.global_batch:,} sequences = {plan.tokens_per_step:,} tokens per step; "
        f"{' + '.join(replace(t, recompute='none', ckpt_every=1).names)}, {plan.optimizer}, stack {plan.stack.label}; timed by "
        + (f"--mfu {plan.timing:g} end to end" if isinstance(plan.timing, float)
           else f"the roofline of each stage's kernels ({plan.timing.origin.rsplit('/', 1)[-1]})"),
        f"Searched {plan.searched:,} layouts ({searched(plan)}): {plan.fitting:,} fit in the GPU less its headroom"
        + (f" ({u.size(plan.best[0].verdict.usable_bytes, units)} for the fastest)" if plan.best else ""),
    ] + (top_headroom(plan.best[0], units) if plan.best else [])


def top_headroom(top, units: str) -> list[str]:
    """The fastest layout's headroom, and the fragmentation note where its verdict is close."""
    return [headroom_line(top.headroom, units, [top.verdict])] + fragmentation_note(top.headroom, [top.verdict])


# What the search varies, each with the search.WITHOUT key that leaves it out (None: always searched)
SEARCHED = (("TP", None), ("SP", "sp"), ("PP", None), ("interleaving", "interleave"), ("CP", "cp"), ("DP", None),
            ("ZeRO 0-3", "zero"), ("hybrid shard", "hybrid"), ("offload", "offload"), ("micro-batch", None),
            ("recompute", None))  # fmt: skip


def searched(plan: Plan) -> str:
    """What the search varied, and what --without left out."""
    gone = set(plan.without) | ({"hybrid"} if "zero" in plan.without else set())  # hybrid shard is a ZeRO stage's
    parts = [name for name, key in SEARCHED if key not in gone] + (["EP"] if plan.model.shape.is_moe else [])
    left = [WITHOUT[k] for k in WITHOUT if k in plan.without]
    return ", ".join(parts) + (f"; without {', '.join(left)}" if left else "")


def short_ranking_section(plan: Plan, units: str) -> Section:
    """The fastest layouts that fit, one line each."""
    s = Section(ranking_title(plan),
                ["#", "layout", "b x m", "recompute", "memory/GPU", "tokens/s", "step", "MFU"], align="llrlrrrr")  # fmt: skip
    for i, est in enumerate(plan.best, 1):
        t = est.time
        s.rows.append([str(i), est.layout.label, f"{est.setup.micro_batch} x {est.setup.grad_accum}",
                       recompute_name(est.tricks.recompute), sized(est.verdict.total_bytes, units), u.rate(t.tokens_per_second),
                       u.seconds(t.step_seconds), u.percent(t.mfu)])  # fmt: skip
    ep = ", ep: the experts' expert-parallel GPUs" if any(e.layout.ep > 1 for e in plan.best) else ""
    s.notes.append(f"layout: tp (sp: sequence parallel), pp (v: interleaved stages), cp, dp, ZeRO stage{ep}; "
                   "b x m: micro-batch x micro-batches per step; --detail: sharding, memory by part, step time "
                   "by part, and why the obvious alternatives lose")  # fmt: skip
    s.notes.append(KIND_NOTE)
    return s


KIND_NOTE = "a kind: the layouts that differ only in how dp, cp and the micro-batch split the batch"


def ranking_title(plan: Plan) -> str:
    """What the rows are of what fits: the fastest layout of each kind (memcalc.parallel.plan.kind_of), of
    as many kinds as --top keeps."""
    kinds, shown, n = plan.fitting_kinds, len(plan.best), plan.fitting
    layouts = f"{n:,} layout{'s' if n != 1 else ''}"
    if shown < kinds:
        return f"Fastest layouts that fit, one per kind: the best {shown} of {kinds:,} kinds ({layouts}; --top N for more)"
    return f"Fastest layouts that fit, one per kind: {'the 1 kind' if kinds == 1 else f'all {kinds:,} kinds'} ({layouts})"


def plan_verdict(plan: Plan, units: str) -> str:
    if not plan.best:
        return "Nothing fits: more GPUs, a smaller global batch or a shorter sequence."
    est, t = plan.best[0], plan.best[0].time
    return (f"Fastest: {layout_text(est.layout)}, {sharding_text(est.layout)}, micro-batch {est.setup.micro_batch} x "
            f"{est.setup.grad_accum}, {recompute_text(est.tricks.recompute)}: {u.rate(t.tokens_per_second)} tokens/s, "
            f"{u.seconds(t.step_seconds)} per step, MFU {u.percent(t.mfu)}, "
            f"{u.size(est.verdict.total_bytes, units)} per GPU.")  # fmt: skip


def ranking_section(plan: Plan, units: str) -> Section:
    headers = ["#", "layout", "sharding", "b x m", "recompute", "memory/GPU", "tokens/s", "step", "MFU", "bubble"]
    s = Section(ranking_title(plan), headers + ["exposed comm"], align="rllrlrrrrrr")
    for i, est in enumerate(plan.best, 1):
        t = est.time
        s.rows.append([str(i), layout_text(est.layout), sharding_text(est.layout),
                       f"{est.setup.micro_batch} x {est.setup.grad_accum}", recompute_name(est.tricks.recompute),
                       u.size(est.verdict.total_bytes, units), u.rate(t.tokens_per_second), u.seconds(t.step_seconds),
                       u.percent(t.mfu), u.percent(t.bubble_seconds / t.step_seconds),
                       u.seconds(t.exposed_comm_seconds)])  # fmt: skip
    s.notes.append(KIND_NOTE if plan.best else "nothing fits: more GPUs, a smaller global batch or a shorter sequence")
    return s


def best_memory_section(plan: Plan, units: str) -> Section:
    s = Section("Memory per GPU of those layouts, at the stage that peaks",
                ["#", "stage", "model state", "activations", "buffers", "logits", "total", "free"])  # fmt: skip
    for i, est in enumerate(plan.best, 1):
        st = est.memory.peak
        s.rows.append([str(i), f"{st.stage} of {est.layout.pp}", u.size(st.state.total_bytes, units),
                       (u.size(st.activation_peak_bytes, units), held_text(st, units)), u.size(st.buffer_bytes, units),
                       u.size(st.logits_bytes, units), sized(st.total_bytes, units),
                       u.size(st.free_bytes, units)])  # fmt: skip
    return s


def best_time_section(plan: Plan) -> Section:
    keys = ["compute", "recompute", "optimizer", "bubble", "tp", "cp", "pp", "dp×cp", "host", "cpu optimizer"]
    moe = [k for k in ("ep", "edp") if any(k in est.time.breakdown for est in plan.best)]  # expert parallel's
    keys = keys[:8] + moe + keys[8:]
    s = Section("Step time of those layouts, by part (seconds)", ["#"] + keys + ["step"])
    for i, est in enumerate(plan.best, 1):
        parts = est.time.breakdown
        s.rows.append([str(i)] + [f"{parts.get(k, 0.0):.2f}" for k in keys] + [f"{est.time.step_seconds:.2f}"])
    if plan.best:
        s.notes += assumption_notes(plan.best[0])
    return s


def alternatives_section(plan: Plan, units: str) -> Section:
    s = Section("Why the obvious alternatives lose", ["alternative", "its best layout", "tokens/s", "vs best", "why"],
                align="llrrl")  # fmt: skip
    best = plan.best[0].time.tokens_per_second if plan.best else None
    for alt in plan.alternatives:
        s.rows.append(alternative_row(alt, best, units))
    return s


def recompute_name(mode: str) -> str:
    """A recompute mode as the trick is named: torchtitan's per-op selective AC is sac."""
    return "sac" if mode == "op" else mode


def recompute_text(mode: str) -> str:
    return "no recompute" if mode == "none" else f"{recompute_name(mode)} recompute"


def alternative_row(alt: Alternative, best: float | None, units: str) -> list[str]:
    est = alt.estimate
    where = f"{est.layout.label}, b {est.setup.micro_batch}, {recompute_text(est.tricks.recompute)}"
    if not alt.fits:
        v = est.verdict
        need, usable = u.size_pair(v.total_bytes, v.usable_bytes, units)
        if v.total_bytes <= v.usable_bytes and not v.host_fits:
            held, share = u.size_pair(v.host_bytes, v.host_usable_bytes, units)
            why = f"out of host memory: needs {held} per GPU of its {share} share"
            return [alt.name, where, "-", "-", why]
        return [alt.name, where, "-", "-", f"out of memory: needs {need} of {usable} at its smallest"]
    tps = est.time.tokens_per_second
    if alt.cause == "tie":
        why = "as fast as the best (within 0.5%)"
    else:
        why = f"{CAUSES[alt.cause]}: {u.seconds(alt.seconds)} per step against {u.seconds(alt.best_seconds)}"
    return [alt.name, where, u.rate(tps), u.signed_percent(tps / best - 1), why]


def plan_sections(plan: Plan, units: str, detail: bool = False) -> list[Section]:
    """The fastest layouts that fit; with detail, their sharding, memory and time by part, and the alternatives."""
    if not detail:  # the ranking; when nothing fits, why each obvious layout does not
        return [short_ranking_section(plan, units)] if plan.best else [alternatives_section(plan, units)]
    sections = [ranking_section(plan, units)]
    if plan.best:
        sections += [best_memory_section(plan, units), best_time_section(plan)]
    if plan.alternatives:
        sections.append(alternatives_section(plan, units))
    return sections


PLAN_CSV_HEADERS = [
    "rank", "tp", "sp", "pp", "vpp", "cp", "dp", "zero", "hybrid", "offload_optimizer", "offload_params",
    "micro_batch", "micro_batches", "recompute", "memory_bytes", "tokens_per_second", "step_seconds", "mfu",
]  # fmt: skip


def plan_csv_rows(plan: Plan) -> list[list[object]]:
    rows = []
    for i, est in enumerate(plan.best, 1):
        lay, t = est.layout, est.time
        rows.append([i, lay.tp, lay.sp, lay.pp, lay.vpp, lay.cp, lay.dp, lay.zero, lay.hybrid, lay.offload_optimizer,
                     lay.offload_params, est.setup.micro_batch, est.setup.grad_accum, est.tricks.recompute,
                     est.verdict.total_bytes, f"{t.tokens_per_second:.6g}", f"{t.step_seconds:.6g}",
                     f"{t.mfu:.4f}"])  # fmt: skip
    return rows
