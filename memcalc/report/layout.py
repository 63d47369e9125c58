"""What `memcalc plan` and `memcalc estimate --tp --pp --cp --dp` show: Plans and LayoutEstimates as Sections."""

from __future__ import annotations

from memcalc.model.layout import Layout
from memcalc.parallel.links import fabric_for, link_name
from memcalc.parallel.plan import LayoutEstimate
from memcalc.parallel.stage_memory import StageMemory

from . import units as u
from .estimate import RECIPES, fit_text, host_note, recipe_text, state_section
from .explain import explain_term
from .headroom import fragmentation_note, headroom_line
from .render import Section, sized

CAUSES = {
    "compute": "compute (the last stage also runs the output layer)",
    "recompute": "recompute",
    "optimizer": "the optimizer step",
    "bubble": "pipeline bubble",
    "tp": "exposed TP traffic",
    "cp": "exposed CP traffic",
    "pp": "exposed PP traffic",
    "dp×cp": "exposed data-parallel traffic",
    "host": "PCIe offload traffic",
    "cpu optimizer": "Adam on the CPU",
    "ep": "exposed expert-parallel all-to-all",
    "edp": "exposed expert data-parallel traffic",
}


def layout_text(layout: Layout) -> str:
    """'tp 8 + SP x pp 4 (v 2) x cp 1 x dp 2 = 64 GPUs'."""
    tp = f"tp {layout.tp}" + (" + SP" if layout.sp else "")
    pp = f"pp {layout.pp}" + (f" (v {layout.vpp})" if layout.vpp > 1 else "")
    text = f"{tp} x {pp} x cp {layout.cp} x dp {layout.dp} = {u.plural(layout.world, 'GPU')}"
    if layout.ep > 1 or layout.etp > 1:  # the experts fold into the stage's tp x cp x dp GPUs
        etp = f" x etp {layout.etp}" if layout.etp > 1 else ""
        text += f", experts over ep {layout.ep}{etp} (edp {layout.expert_shard_ranks})"
    return text


def sharding_text(layout: Layout) -> str:
    if layout.zero == 0:
        text = "ZeRO 0 (replicated)"
    else:
        where = f"{layout.shard_group} ranks inside a node (hybrid)" if layout.hybrid else f"{layout.shard_group} ranks"
        text = f"ZeRO-{layout.zero} over dp x cp = {where}"
    if layout.offload_params:
        text += ", weights, gradients and optimizer state offloaded to CPU"
    elif layout.offload_optimizer:
        text += ", optimizer state offloaded to CPU"
    return text


def batch_text(est: LayoutEstimate) -> str:
    s = est.setup
    return (f"micro-batch {s.micro_batch} x {s.grad_accum} micro-batches x dp {est.layout.dp} = global batch "
            f"{est.global_batch:,} sequences of {s.seq_len:,} = {est.time.tokens_per_step:,} tokens "
            "per step")  # fmt: skip


# ---- memcalc estimate with a layout ---------------------------------------------------------


def layout_preamble(ests: list[LayoutEstimate], units: str = "gb") -> list[str]:
    """The job: model, layout, batch, GPU; and the trick set (each row's, when several)."""
    est = ests[0]
    g, lay, fabric = est.gpu, est.layout, fabric_for(est.gpu, est.time.assumptions)
    tricks = (f"{est.tricks.label} ({RECIPES[est.tricks.precision]})" if len(ests) == 1
              else "one row each: " + ", ".join(e.tricks.label for e in ests))  # fmt: skip
    stack = est.setup.stack
    if stack.key != "reference" or stack.engine != "none":
        tricks = tricks.replace(f"({RECIPES[est.tricks.precision]})", f"({recipe_text(est.tricks.precision, stack.recipe)})")
        tricks += f"; stack {stack.label}: {stack.name}"
    return [
        f"Model: {est.model.origin}",
        f"Layout: {layout_text(lay)}, {lay.gpus_per_node} per node; {sharding_text(lay)}",
        f"Batch: {batch_text(est)}",
        f"Tricks: {tricks}; {est.setup.optimizer}",
        f"GPU: {g.name} ({g.key}): {u.size(est.verdict.usable_bytes, units)} usable; {fabric.intra.name} in a node, "
        f"{fabric.inter.name} between nodes, {fabric.host.name} to the host",
        headroom_line(est.headroom, units, [e.verdict for e in ests]),
    ] + fragmentation_note(est.headroom, [e.verdict for e in ests])


def layer_section(est: LayoutEstimate, units: str) -> Section:
    layer = est.memory.peak.layer
    split = f"tp {layer.tp}" + (" + SP" if layer.sp else "") + (f", cp {layer.cp}" if layer.cp > 1 else "")
    whose = "Megatron-LM's formula" if est.setup.stack.engine == "megatron" else "Korthikanti et al. 2022, Table 2"
    title = f"Activations of one layer, one micro-batch, one GPU ({split}): {whose}"
    s = Section(title, ["term", "formula", "bytes"], align="llr")
    for t in layer.terms:
        s.rows.append([t.name, t.symbolic(), sized(t.value, units)])
    s.rows.append(["kept per layer", "", sized(layer.per_layer_bytes, units)])
    for t in est.memory.stages[0].inputs:
        s.rows.append([f"stage 0, outside the layers: {t.name}", t.symbolic(), sized(t.value, units)])
    for t in layer.rebuilt:
        s.rows.append([f"rebuilt in backward: {t.name}", t.symbolic(), sized(t.value, units)])
    moe = est.memory.peak.moe_layer
    if moe is not None:  # its MoE layers (the rows above: its dense layers')
        s.rows += [[f"MoE layer: {t.name}", t.symbolic() or "docs/moe.md", sized(t.value, units)] for t in moe.terms]
        s.rows.append(["MoE layer: kept per layer", "", sized(moe.per_layer_bytes, units)])
        s.rows += [[f"MoE layer, rebuilt in backward: {t.name}", t.symbolic() or "docs/moe.md", sized(t.value, units)]
                   for t in moe.rebuilt]  # fmt: skip
    return s


def stages_section(est: LayoutEstimate, units: str) -> Section:
    mem = est.memory
    s = Section(
        f"Peak memory per GPU, by pipeline stage ({u.size(est.verdict.usable_bytes, units)} usable)",
        ["stage", "layers", "params", "model state", "activations", "buffers", "logits", "total", "fits?"],
        align="rrrrrrrrl",
    )
    for st in mem.stages:
        s.rows.append([str(st.stage), str(st.layers), u.params(st.params), u.size(st.state.total_bytes, units),
                       (u.size(st.activation_peak_bytes, units), held_text(st, units)), u.size(st.buffer_bytes, units),
                       u.size(st.logits_bytes, units), sized(st.total_bytes, units), fit_text(st, units)])  # fmt: skip
    peak = mem.peak
    schedule = "interleaved 1F1B" if est.layout.vpp > 1 else "1F1B"
    s.notes = [
        f"activations: layer-micro-batches held x bytes per layer + one layer rebuilt; stage 0 holds "
        f"{peak_factor(est)} x L layers' worth under {schedule} (Korthikanti et al. 2022, sec. 4.2.3)",
        f"the peak is stage {peak.stage}: {u.exact_bytes(peak.total_bytes)}",
    ]
    for t in peak.buffers:
        s.notes.append(f"buffer: {t.name} = {u.size(t.value, units)} [{t.source}]")
    s.notes += host_note(max(mem.stages, key=lambda st: st.host_bytes), units)
    return s


def held_text(st: StageMemory, units: str) -> str:
    text = f"{st.held} x {u.size(st.layer.per_layer_bytes, units)}"
    if st.moe_layer is not None:  # a mixture of experts: its dense layers, then its MoE layers
        moe = f"{st.moe_held} x {u.size(st.moe_layer.per_layer_bytes, units)}"
        return f"{text} + {moe}" if st.held else moe
    return text


def peak_factor(est: LayoutEstimate) -> str:
    """Stage 0's held layer-micro-batches over L: 1 under 1F1B with m >= p, 1 + (p − 1)/(p·v) interleaved."""
    first = est.memory.stages[0]
    return f"{(first.held + first.moe_held) / est.model.shape.n_layers:.3g}"


def comm_section(est: LayoutEstimate, units: str) -> Section:
    t = est.time
    s = Section("Communication per step, as one GPU sees it (ring algorithms)",
                ["traffic", "group", "link", "calls", "bytes sent", "formula", "time", "exposed"],
                align="lllrrlrr")  # fmt: skip
    fabric = fabric_for(est.gpu, t.assumptions)
    for c in t.comms:
        s.rows.append([c.name, f"{c.group} ({c.ranks})", link_name(fabric, c.link), f"{c.calls:,}",
                       sized(c.bytes, units), c.formula, u.seconds(c.seconds), u.seconds(c.exposed_seconds)])
    if not t.comms:
        s.notes.append("no traffic: one GPU")
    s.notes.append("ring bytes: all-reduce 2(n−1)/n, reduce-scatter and all-gather (n−1)/n of the buffer "
                   "(nccl-tests PERFORMANCE.md); exposed: what the overlap assumptions leave on the critical "
                   "path")  # fmt: skip
    return s


def time_section(est: LayoutEstimate) -> Section:
    t = est.time
    title = f"Step time by part: {time_model_text(t)}"
    s = Section(title, ["part", "seconds", "share"])
    for key, seconds in t.breakdown.items():
        if seconds or key == "compute":
            s.rows.append([CAUSES.get(key, key), u.seconds(seconds), u.percent(seconds / t.step_seconds)])
    s.rows.append(["step", u.seconds(t.step_seconds), "100.0%"])
    lay = est.layout
    bubble = "no pipeline, no bubble"
    if lay.pp > 1:
        bubble = (f"bubble (p − 1)/(v·m) = {lay.pp - 1}/({lay.vpp}·{est.setup.grad_accum}) of the pipeline's time "
                  "(Narayanan et al. 2021)")  # fmt: skip
    s.notes = [
        f"{u.rate(t.tokens_per_second)} tokens/s; MFU {u.percent(t.mfu)}, HFU {u.percent(t.hfu)} "
        f"(model FLOPs {u.count(t.model_flops_per_step)} per step, Korthikanti et al. 2022 sec. 6.3)",
        bubble,
    ]
    s.notes += assumption_notes(est)
    return s


def time_model_text(t) -> str:
    """How the step was timed: the roofline of every stage's kernels, or --mfu's end-to-end rate."""
    if t.utilization is not None:
        return f"--mfu {t.utilization:g}: hardware FLOPs at {u.percent(t.utilization)} of peak, end to end"
    return f"roofline of each stage's kernels, {t.calibration.origin.rsplit('/', 1)[-1]}"


def assumption_notes(est: LayoutEstimate) -> list[str]:
    a = est.time.assumptions
    if est.time.utilization is not None:
        return ["--mfu is an end-to-end rate: the bubble, the traffic and the optimizer are inside it, not added"]
    measured = a.inter_node_efficiency
    between = "" if measured is None else f" ({u.percent(measured, 0)} between nodes, as measured)"
    return [
        f"assumed: links reach {u.percent(a.efficiency, 0)} of their rate{between}; overlap shares dp {a.overlap_dp:g}, "
        f"tp {a.overlap_tp:g}, pp {a.overlap_pp:g}, cp {a.overlap_cp:g}, offload {a.overlap_offload:g}; "
        f"CPU Adam {a.cpu_adam_params_per_s:.0e} params/s per host"
    ] + ([f"expert parallel's all-to-all: overlap share {a.overlap_ep:g} (on the critical path); every token copy "
          "bound for another node crosses InfiniBand (no node-limited routing or NVLink forwarding, which "
          "DeepSeek-V3 uses)"] if est.layout.ep > 1 else [])  # fmt: skip


def cluster_section(est: LayoutEstimate, units: str) -> Section:
    s = Section(f"Cluster totals over {u.plural(est.gpus, 'GPU')}", ["quantity", "value"])
    s.rows.append(["GPU memory, all GPUs at their peak", sized(est.cluster_bytes, units)])
    if est.cluster_host_bytes:
        s.rows.append(["host memory (offload)", sized(est.cluster_host_bytes, units)])
    s.rows.append(["tokens per step", f"{est.time.tokens_per_step:,}"])
    s.rows.append(["tokens per second", u.rate(est.time.tokens_per_second)])
    s.rows.append(["model FLOPs per step", u.count(est.time.model_flops_per_step)])
    return s


def layout_sections(est: LayoutEstimate, units: str, detail: bool = False) -> list[Section]:
    """What `memcalc estimate --tp --pp --cp --dp --zero` prints for one layout: memory by stage and the
    step time; with detail, the model state, one layer's terms, traffic, the step by part, cluster totals."""
    stages = stages_section(est, units)
    t = est.time
    stages.notes.insert(0, f"step {u.seconds(t.step_seconds)}: {u.rate(t.tokens_per_second)} tokens/s, MFU "
                           f"{u.percent(t.mfu)} ({time_model_text(t)})")  # fmt: skip
    if not detail:
        return [stages]
    peak = est.memory.peak
    state = state_section(peak.state, units)
    state.title += f" (one GPU of stage {peak.stage}: {peak.params:,} parameters before sharding)"
    return [stages, state, layer_section(est, units), comm_section(est, units), time_section(est),
            cluster_section(est, units)]  # fmt: skip


def layout_verdict(estimates: list[LayoutEstimate], units: str) -> str:
    """Whether each trick set's peak stage fits the GPU, in one sentence."""
    usable = u.size(estimates[0].verdict.usable_bytes, units)
    fit = [e.tricks.label for e in estimates if e.verdict.fits]
    if len(estimates) == 1:
        v = estimates[0].verdict
        where = v.peak_at if estimates[0].layout.pp > 1 else "each GPU"
        need, of = u.size_pair(v.total_bytes, v.usable_bytes, units)  # distinct when they differ
        needs = f"{where} needs {need} of the {of} usable per GPU"
        if v.fits:
            return f"Fits: {needs}."
        if not v.host_fits:
            held, share = u.size_pair(v.host_bytes, v.host_usable_bytes, units)
            needs += f", and {held} of host memory per GPU, of its {share} share"
        return f"Does not fit: {needs}; `memcalc plan` searches the layouts that fit."
    if not fit:
        return f"Does not fit with any of these trick sets ({usable} usable per GPU); `memcalc plan` searches the layouts that fit."
    return f"Fits ({usable} usable per GPU) with: {', '.join(fit)}."


def tricks_section(estimates: list[LayoutEstimate], units: str) -> Section:
    """One layout under several trick sets (estimate's progression): per-GPU peak memory and speed of each."""
    est = estimates[0]
    s = Section(
        f"Peak memory per GPU under {est.layout.label} ({u.size(est.verdict.usable_bytes, units)} usable)",
        ["tricks", "model state", "activations", "buffers", "logits", "total", "fits?", "tokens/s", "MFU"],
        align="lrrrrrlrr",
    )
    for e in estimates:
        st, t = e.memory.peak, e.time
        s.rows.append([e.tricks.label, u.size(st.state.total_bytes, units), u.size(st.activation_peak_bytes, units),
                       u.size(st.buffer_bytes, units), u.size(st.logits_bytes, units), sized(st.total_bytes, units),
                       fit_text(st, units), u.rate(t.tokens_per_second), u.percent(t.mfu)])  # fmt: skip
    s.notes.append("each row at the pipeline stage that peaks; cluster totals, traffic and time: --tricks with one set")
    return s


def layout_warnings(est: LayoutEstimate) -> list[str]:
    """What the layout does that its user likely did not mean (the trick set's: memcalc.cli.inputs.warn)."""
    out = []
    lay = est.layout
    if lay.tp > lay.gpus_per_node:
        out.append(f"tp {lay.tp} spans nodes: every layer's collectives cross InfiniBand")
    if lay.zero == 3 and lay.shard_group == 1 and not lay.offload_params:
        out.append("ZeRO-3 over one rank shards nothing")
    return out


LAYOUT_CSV_HEADERS = [
    "stage", "layers", "params", "model_state_bytes", "activation_peak_bytes", "buffer_bytes", "logits_bytes",
    "total_bytes", "fits", "step_seconds", "tokens_per_second", "mfu",
]  # fmt: skip


def layout_csv_rows(est: LayoutEstimate) -> list[list[object]]:
    t = est.time
    return [[st.stage, st.layers, st.params, st.state.total_bytes, st.activation_peak_bytes, st.buffer_bytes,
             st.logits_bytes, st.total_bytes, st.fits, f"{t.step_seconds:.6g}", f"{t.tokens_per_second:.6g}",
             f"{t.mfu:.4f}"] for st in est.memory.stages]  # fmt: skip


def layout_symbols(est: LayoutEstimate) -> dict[str, int]:
    shape, s, lay = est.model.shape, est.setup, est.layout
    return {
        "s": s.seq_len, "b": s.micro_batch, "h": shape.hidden, "a": shape.n_heads, "k": shape.n_kv_heads,
        "d": shape.head_dim, "f": shape.ffn, "L": shape.n_layers, "v": shape.vocab, "t": lay.tp, "c": lay.cp,
        "p": lay.pp, "m": s.grad_accum,
    }  # fmt: skip


def layout_explain_lines(est: LayoutEstimate) -> list[str]:
    """The per-layer and logits formulas with this layout's numbers substituted."""
    syms = layout_symbols(est)
    peak = est.memory.peak
    legend = ", ".join(f"{k} = {v:,}" for k, v in syms.items())
    lines = [f"Symbols: {legend}", "", "One layer, one micro-batch, one GPU:"]
    lines += [explain_term(t, syms, "B") for t in peak.layer.terms + peak.layer.rebuilt]
    lines.append(f"  stage {peak.stage}: {peak.held} layer-micro-batches x {peak.layer.per_layer_bytes:,} + "
                 f"{peak.layer.rebuilt_bytes:,} rebuilt = {peak.activation_peak_bytes:,} B")  # fmt: skip
    last = est.memory.stages[-1]
    if last.logits:
        lines += ["", f"Logits on stage {last.stage}:"] + [explain_term(t, syms, "B") for t in last.logits]
    buffers = [t for st in est.memory.stages for t in st.buffers]
    if buffers:
        unique = {t.name: t for t in buffers}.values()
        lines += ["", "Buffers:"] + [explain_term(t, syms, "B") for t in unique]
    return lines


def exact_layer_section(ests: list[LayoutEstimate], layers: list, units: str) -> Section:
    """--exact: one layer on one TP rank, Korthikanti's Table 2 against memcalc.exact on the shard."""
    lay = ests[0].layout
    split = f"tp {lay.tp}" + (" + SP" if lay.sp else "")
    s = Section(f"One layer, one micro-batch, one GPU ({split}): textbook against exact for this architecture",
                ["tricks", "textbook (Table 2)", "exact (op by op)", "exact / textbook"])  # fmt: skip
    for e, terms in zip(ests, layers):
        textbook = e.memory.peak.layer.per_layer_bytes
        exact = sum(t.value for t in terms)
        s.rows.append([e.tricks.label, sized(textbook, units), sized(exact, units), f"{exact / textbook:.2f}x"])
    s.notes = ["exact: memcalc.exact on the TP rank's shard (a/t heads, k/t KV heads, f/t MLP); with SP the norms "
               "and dropouts hold s/t tokens and the all-gathered inputs are saved whole, as DTensor does "
               "(memcalc verify --tp checks it on PyTorch's own engine)",
               "the stage totals above use the textbook terms"]  # fmt: skip
    return s
