"""What `memcalc estimate` shows of an Answer (memcalc.engine.answer): one summary row per trick set from
its verdict and its step time, the sentence that answers, and what --detail adds.

A data-parallel job (every GPU runs the whole model: one GPU, --gpus N, --dp N with ZeRO and offload) is
shown with the whole-model textbook beside the verdict; a job with tensor, pipeline, context or expert
parallel by its stages (memcalc.report.layout).
"""

from __future__ import annotations

from memcalc.engine.answer import Answer
from memcalc.engine.toolbox import FITS_AS_IT_IS, FITS_NOWHERE, Toolbox
from memcalc.memory.setup import Setup
from memcalc.model.gpus import roofline_gaps
from memcalc.model.savers import liger_note
from memcalc.model.stacks import FUSED_HEAD, trl_note
from memcalc.parallel.verdict import REPLAY_BAND

from . import estimate as textbook
from . import units as u
from .headroom import allocator_note, fragmentation_note, headroom_line
from .layout import comm_section, sharding_text, time_section
from .offload import offload_notes
from .render import Section, sized
from .rollout import rollout_clause, rollout_section

DETAIL_HINT = "--detail: every part; --bytes: exact bytes; --explain: the formulas; --exact: what PyTorch saves"


def time_model_text(ans: Answer) -> str:
    t = ans.layouts[0].time
    if t.utilization is not None:
        gaps = roofline_gaps(ans.job.gpu)
        why = f"the card's file gives no {', '.join(gaps)} for the roofline" if gaps else "--mfu"
        return f"hardware FLOPs at {u.percent(t.utilization)} of peak ({why})"
    return "a roofline over every kernel" + (" and the step's traffic" if ans.job.layout.world > 1 else "")


def preamble(ans: Answer, units: str, detail: bool) -> list[str]:
    """The model and the step; over several GPUs, how they share the work."""
    est = ans.textbook
    usable = ans.verdicts[0].usable_bytes
    lines = textbook.preamble(est, units, usable) if detail else textbook.short_preamble(est, units, usable)
    lay = ans.job.layout
    if lay.hybrid or lay.offload_params:
        lines.append(f"  sharding: {sharding_text(lay)}")
    room = ans.layouts[0].headroom
    return lines + [headroom_line(room, units, ans.verdicts)] + fragmentation_note(room, ans.verdicts)


def summary_section(ans: Answer, units: str) -> Section:
    """One row per trick set: the verdict (state, what else is live at the peak, the peak), whether it fits,
    the textbook's total beside it, step time and MFU."""
    job, est = ans.job, ans.textbook
    where = "" if job.layout.world == 1 else f" on each of {job.layout.world:,} GPUs"
    # where the allocator was replayed its reserve takes the place of what the peak adds to the state (the table
    # fits 100 columns with one of them)
    reserved = any(v.reserved is not None for v in ans.verdicts)
    middle = ["= peak", "reserved"] if reserved else ["+ at peak", "= peak"]
    s = Section(f"Peak memory per GPU ({job.setup.stack.label} stack, its step replayed op by op{where}) and step time",
                ["tricks", "state", *middle, "fits?", "textbook", "step time", "MFU"], align="lrrrlrrr")  # fmt: skip
    for v, m, e in zip(ans.verdicts, est.memory, ans.layouts):
        label = v.tricks.label + ("" if v.replayed else " *")
        # exact bytes under the peak only: under every column the table would not fit 100 columns
        cells = [sized(v.peak_bytes, units), reserved_cell(v, units)] if reserved else \
            [u.size(v.transient_bytes, units), sized(v.peak_bytes, units)]
        s.rows.append([label, u.size(v.state_bytes, units), *cells, textbook.fit_text(v, units, free=True),
                       textbook.textbook_size(m, units), u.seconds(e.time.step_seconds), u.percent(e.time.mfu)])  # fmt: skip
    first = next(v for v in ans.verdicts if v.replayed)
    own = first.n_params
    shape = "" if own == job.model.n_params else f" for the shape's own {u.params(own)} parameters"
    moe = " and the MoE/MLA terms of docs/moe.md" if job.model.shape.is_moe or job.model.shape.is_mla else ""
    replays = sorted({v.replay for v in ans.verdicts if v.replayed})
    s.notes = [
        f"replayed{shape} ({'; '.join(replays)}): state = what this GPU keeps between steps (weights, master, "
        f"optimizer state); {'peak = the state + ' if reserved else 'at peak = '}activations, logits, grads, "
        "buffers, temporaries (memcalc verify measures the same)",
        f"textbook: model state {est.model_state.bytes_per_param:g} bytes/param = "
        f"{u.size(est.model_state.total_bytes, units)} per GPU "
        f"({textbook.recipe_text(est.model_state.precision, est.model_state.recipe)}, {job.setup.optimizer}) + "
        f"activations (Korthikanti et al. 2022{moe}) + logits",
    ]
    stack = job.setup.stack
    s.notes += [note for note in (trl_note(stack), liger_note(stack.savers, stack.trl in FUSED_HEAD)) if note]
    s.notes += load_notes(ans, units)
    s.notes += offload_notes(ans, units)
    s.notes += reserved_notes(ans, units)
    s.notes += [f"{', '.join(labels)} *: by formula, the stack's engine's state and buffers on one GPU of the "
                f"layout (memcalc.model.layout), since {reason}" for reason, labels in by_reason(ans).items()]
    s.notes.append(f"step time: {time_model_text(ans)}; MFU: model FLOPs / step time / dense peak")
    s.notes += moe_notes(ans)
    return s


def load_notes(ans: Answer, units: str) -> list[str]:
    """Where the model's load peaks above the step (memcalc.exact.replay.zero: a quantized model under the Trainer's
    DeepSpeed ZeRO-3), what it holds and what the step then holds."""
    return [f"{v.tricks.label}: the peak is the model's load: Transformers builds a quantized model outside "
            "deepspeed.zero.Init and places it whole on each GPU, which DeepSpeed's ZeRO-3 partitions only as the "
            f"Trainer prepares it; the step then peaks at {u.size(v.phases.step_peak_bytes, units)}"
            for v in ans.verdicts if v.replayed and v.phases.load_bytes > v.phases.step_peak_bytes]  # fmt: skip


def reserved_cell(v, units: str) -> str:
    """The caching allocator's reserve where the verdict replayed it; '-' where the peak alone decides."""
    return u.size(v.reserved.reserved_bytes, units) if v.reserved is not None else "-"


def reserved_notes(ans: Answer, units: str) -> list[str]:
    """What the reserved column is, and each replayed allocator's line (memcalc.report.headroom.allocator_note)."""
    if not any(v.reserved is not None for v in ans.verdicts):
        return []
    return [f"reserved: PyTorch's caching allocator replayed over two steps where the peak comes within "
            f"{REPLAY_BAND:.0%} of its room (docs/gpus.md); '-': the peak alone decides"] + allocator_note(ans.verdicts, units)


def by_reason(ans: Answer) -> dict[str, list[str]]:
    """The trick sets the textbook decides, by why."""
    out: dict[str, list[str]] = {}
    for v in ans.verdicts:
        if not v.replayed:
            out.setdefault(v.textbook_reason, []).append(v.tricks.label)
    return out


def moe_notes(ans: Answer) -> list[str]:
    """What a mixture-of-experts estimate assumes: the routing, the experts' state, why --mfu times it."""
    from memcalc.time.roofline import traceable

    shape, notes = ans.job.model.shape, []
    if shape.is_moe:
        replay = ", as the replayed step's reference router" if any(v.replayed for v in ans.verdicts) else ""
        notes.append(f"routing: {ans.job.setup.routing.label}{replay}; model state covers all {shape.n_experts} "
                     f"experts of every MoE layer, FLOPs the {shape.experts_per_token} a token goes to")  # fmt: skip
    if not traceable(shape):
        notes.append("the roofline needs the step's kernels, which memcalc.exact does not trace for this model yet: "
                     "the step is timed by --mfu")  # fmt: skip
    return notes


def textbook_summary_section(ans: Answer, units: str) -> Section:
    """The summary when no trick set's step is replayed: the textbook's memory, stage that peaks, decides."""
    stages = [e.memory.peak for e in ans.layouts]
    buffers = any(st.buffer_bytes for st in stages)
    s = Section(
        "Peak memory per GPU (textbook) and step time",
        ["tricks", "model state", "activations", "logits"] + (["buffers"] if buffers else [])
        + ["total", "fits?", "step time", "MFU"],
        align="lrrr" + ("r" if buffers else "") + "rlrr",
    )  # fmt: skip
    for st, v, e in zip(stages, ans.verdicts, ans.layouts):
        row = [v.tricks.label, u.size(st.state.total_bytes, units), u.size(st.activation_peak_bytes, units),
               u.size(st.logits_bytes, units)] + ([u.size(st.buffer_bytes, units)] if buffers else [])  # fmt: skip
        s.rows.append(row + [sized(v.total_bytes, units), textbook.fit_text(v, units, free=True),
                             u.seconds(e.time.step_seconds), u.percent(e.time.mfu)])  # fmt: skip
    est, shape = ans.textbook, ans.job.model.shape
    moe = " and the MoE/MLA terms of docs/moe.md" if shape.is_moe or shape.is_mla else ""
    s.notes = [
        f"textbook, since {ans.verdicts[0].textbook_reason}: model state {est.model_state.bytes_per_param:g} "
        f"bytes/param ({textbook.recipe_text(est.model_state.precision, est.model_state.recipe)}, "
        f"{ans.job.setup.optimizer}) + activations (Korthikanti et al. 2022{moe}) + logits + the engine's buffers",
        f"step time: {time_model_text(ans)}; MFU: model FLOPs / step time / dense peak",
    ] + moe_notes(ans)
    for t in stages[0].buffers:
        s.notes.append(f"buffer: {t.name} = {u.size(t.value, units)} [{t.source}]")
    return s


def phases_section(ans: Answer, units: str) -> Section:
    """The replayed step phase by phase: where each trick set peaks, and what is live then."""
    where = "one GPU" if ans.job.layout.world == 1 else "one GPU of " + u.plural(ans.job.layout.world, "GPU")
    s = Section(f"The step replayed ({ans.job.setup.stack.label} stack), phase by phase, on {where}",
                ["tricks", "between steps", "forward peak", "backward peak", "optimizer peak", "the peak"],
                align="lrrrrl")  # fmt: skip
    for v in ans.verdicts:
        p = v.phases
        if p is not None:
            s.rows.append([v.tricks.label, u.size(p.state_bytes, units), u.size(p.forward_peak_bytes, units),
                           u.size(p.backward_peak_bytes, units), u.size(p.optimizer_peak_bytes, units), v.peak_at])  # fmt: skip
    s.notes = ["between steps: weights, buffers, master and optimizer state (each GPU's part of them); each peak is "
               "of everything live: the activations saved in forward, the gradients made in backward, the buffers "
               "of the sharding, the optimizer's temporaries"]  # fmt: skip
    return s


def setup_text(step, start: Setup | None = None) -> str:
    """', micro-batch 1 x 4 accumulation, ZeRO-2 over 8 GPUs, optimizer offloaded to CPU', and the fine-tuning where
    the toolbox changed the start's (', qlora nf4 16')."""
    lay, parts = step.layout, []
    finetune = step.setup.stack.finetune
    if start is not None and finetune != start.stack.finetune:
        parts.append(finetune.label)
    if step.setup.samples == 1 and step.setup.grad_accum > 1:  # DPO counts pairs (Setup.samples)
        parts.append(f"micro-batch 1 x {step.setup.grad_accum} accumulation")
    if lay.zero:
        parts.append(f"ZeRO-{lay.zero} over {u.plural(lay.dp, 'GPU')}")
    if lay.offload_optimizer:
        parts.append("optimizer offloaded to CPU")
    return "".join(", " + x for x in parts)


def verdict(ans: Answer, units: str) -> str:
    """The answer in one sentence: it fits as it is, the cheapest combination that fits, or nothing does.
    The toolbox starts from the first trick set (fp32 in the progression) and applies the cheapest tools first."""
    tb, g = ans.toolbox, ans.job.gpu
    gpus = "one" if ans.job.layout.world == 1 else "each"
    needs, usable = u.size_pair(tb.start.total_bytes, tb.start.usable_bytes, units)
    start = f"{tb.start.tricks.label} {needs_phrase(tb.start, needs, units)}, of the {usable} usable on {gpus} {g.key}"
    if not tb.start.host_fits:
        host, share = u.size_pair(tb.start.host_bytes, tb.start.host_usable_bytes, units)
        start += f", and {host} of host memory per GPU, of its {share} share"
    engine = "" if ans.rollout is None else rollout_clause(ans.rollout, ans.verdicts, tb.start.tricks, units)
    if tb.outcome == FITS_AS_IT_IS:
        return f"The step fits: {start}; but {engine}." if engine else f"Fits: {start}{higher(ans, units)}."
    if tb.outcome == FITS_NOWHERE:
        also = f" Besides, {engine}." if engine else ""
        return f"Does not fit: {start}, and nothing in the toolbox makes it fit: {toolbox_reach(ans, units)}.{also}"
    chosen = tb.steps[tb.fits_at]
    also = f" Besides, {engine}." if engine else ""
    return (f"Does not fit as it is: {start}. Cheapest combination that fits: {chosen.tricks.label}"
            f"{setup_text(chosen, ans.job.setup)} -> {u.size(chosen.verdict.total_bytes, units)} per GPU."
            f"{also}")  # fmt: skip


def higher(ans: Answer, units: str) -> str:
    """'; each update's rollout peaks higher, at 42.96 GB (scoring)' where PPO's rollout (memcalc.engine.rollout)
    holds more than the step the sentence names, and fits; '' otherwise."""
    tricks = ans.toolbox.start.tricks
    r = ans.rollout
    p = None if r is None or not r.ppos else next(
        (x for x, v in zip(r.phases, ans.verdicts, strict=True) if v.tricks == tricks), None)  # fmt: skip
    if p is None or max(p.rollout_bytes, p.score_bytes) <= p.train_bytes:
        return ""
    at, where = max((p.rollout_bytes, "generating"), (p.score_bytes, "scoring"))
    return f"; each update's rollout peaks higher, at {u.size(at, units)} ({where})"


def needs_phrase(v, needs: str, units: str) -> str:
    """'needs 76.59 GB at its peak'; where the caching allocator was replayed, what it reserves and the tensors."""
    if v.reserved is None:
        return f"needs {needs} at its peak"
    verb = "would reserve" if v.reserved.out_of_memory else "reserves"
    return f"{verb} {needs} at its peak ({u.size(v.peak_bytes, units)} of tensors)"


def toolbox_reach(ans: Answer, units: str) -> str:
    """How far the toolbox got, for the sentence that says nothing it has makes the job fit."""
    zero = [s for s in ans.toolbox.steps if "ZeRO-" in s.name and s.kept]
    plan = "`memcalc plan` searches tensor, pipeline and expert parallel layouts"
    if not zero:
        return f"the {ans.job.setup.stack.label} stack shards nothing further here; {plan}"
    best = min(zero, key=lambda s: s.verdict.total_bytes)
    return (f"ZeRO-{best.layout.zero} over {u.plural(best.layout.dp, 'GPU')} still peaks at "
            f"{u.size(best.verdict.total_bytes, units)}, {best.verdict.peak_at}; {plan}")  # fmt: skip


def toolbox_section(tb: Toolbox, units: str) -> Section:
    start = tb.start
    s = Section(
        f"Out of memory with {start.tricks.label} ({u.size(start.total_bytes, units)}): the toolbox, cheapest first",
        ["step (on top of the ones kept above)", "saves on its own", "total after", "fits?", "costs"],
        align="lrrll",
    )
    for step in tb.steps:
        saved = step.saves_alone_bytes
        alone = u.size(saved, units) if saved > 0 else "nothing" if saved == 0 else f"costs {u.size(-saved, units)}"
        after = u.size(step.verdict.total_bytes, units) if step.kept else "not applied"
        s.rows.append([step.name, alone, after, ("yes" if step.verdict.fits else "no") if step.kept else "-", step.cost])
    return s


def sections(ans: Answer, units: str, detail: bool = False) -> list[Section]:
    """The summary table; with detail, every section behind it."""
    est = ans.textbook
    replayed = any(v.replayed for v in ans.verdicts)
    summary = summary_section(ans, units) if replayed else textbook_summary_section(ans, units)
    summary.notes += textbook.host_note(ans.verdicts[0], units, ans.job.setup.optimizer.startswith("paged-"))
    rollout = [] if ans.rollout is None else [rollout_section(ans.rollout, ans.verdicts, units, ans.job.setup.stack.rl)]
    if not detail:
        summary.notes.append(DETAIL_HINT)
        return [summary] + rollout
    state = textbook.state_section(est.model_state, units)
    state.notes = textbook.other_recipes(est, units)
    out = [summary] + rollout + ([phases_section(ans, units)] if replayed else [])
    out += [state, textbook.activations_section(est, units), textbook.logits_section(est, units)]
    if ans.roofline is not None:
        from .roofline import roofline_sections

        out += roofline_sections(est, ans.roofline, ans.layouts[0].time.calibration)
    elif ans.job.layout.world > 1:
        out += [comm_section(ans.layouts[0], units), time_section(ans.layouts[0])]
    else:
        out.append(textbook.compute_section(est))
    if ans.toolbox.outcome != FITS_AS_IT_IS:
        out.append(toolbox_section(ans.toolbox, units))
    return out


CSV_HEADERS = [
    "tricks", "activations_per_layer_bytes", "activations_total_bytes", "activations_peak_bytes",
    "model_state_bytes", "logits_bytes", "memory_total_bytes", "replayed", "state_bytes", "peak_bytes", "fits",
    "model_flops_per_token", "hardware_flops_per_token", "time_model", "step_seconds", "tokens_per_second", "mfu",
    "hfu", "mfu_causal", "hfu_causal", "recompute_seconds", "memory_bound_seconds", "phases_fit",
]  # fmt: skip


def csv_rows(ans: Answer) -> list[list[object]]:
    """One row per trick set: the textbook's terms, then the verdict (what `fits` is), then the step time (the
    roofline's one-GPU columns where the job is one GPU's step timed by it), then under --rl grpo or rloo whether
    every phase fits, beside vLLM or the policy's own generate (phases_fit; empty otherwise, or where generate is not
    sized)."""
    from .roofline import csv_columns

    rows, est = [], ans.textbook
    for i, (a, m, c, v, e) in enumerate(zip(est.activations, est.memory, est.compute, ans.verdicts, ans.layouts)):
        t, known = e.time, a.formula  # sac: the textbook's columns stay empty
        r = ans.roofline[i] if ans.roofline else None
        p = ans.rollout.phases[i] if ans.rollout is not None else None
        phases = p.fits if p is not None else ""
        rows.append(["+".join(a.tricks.names), a.per_layer_bytes if known else "", a.total_bytes if known else "",
                     a.peak_bytes if known else "", m.model_state_bytes, m.logits_bytes, m.total_bytes if known else "",
                     v.replayed, v.state_bytes, v.peak_bytes, v.fits, c.flops.model_per_token,
                     c.flops.hardware_per_token, t.time_model, f"{t.step_seconds:.6g}", f"{t.tokens_per_second:.6g}",
                     f"{t.mfu:.4f}", f"{t.hfu:.4f}", *csv_columns(r), phases])  # fmt: skip
    return rows
