"""What `memcalc estimate` shows: result objects laid out as Sections and lines (fit, mfu and --sweep
have their own modules beside it)."""

from __future__ import annotations

from memcalc.memory.estimate import Estimate
from memcalc.memory.state import ModelState, model_state, state_sharding
from memcalc.model.flops import korthikanti_selective_overhead
from memcalc.model.gpus import half_precision

from . import units as u
from .render import Section, sized

RECIPES = {"fp32": "fp32", "bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision + loss scaling"}
HOW = {"autocast": "{p} autocast over fp32 weights", "pure": "pure {p} (no fp32 master)",
       "main_grad": "{p} weights, fp32 main_grad and master (Megatron-LM)",
       "grad_partition": "{p} mixed precision with an fp32 gradient partition (DeepSpeed ZeRO)",
       "lora": "LoRA: a frozen {p} base, fp32 adapters",
       "qlora": "QLoRA: a frozen nf4 base computing in {p}, fp32 adapters",
       "lora:dtype": "LoRA: a frozen {p} base, {p} adapters", "qlora:dtype": "QLoRA: a frozen nf4 base, {p} adapters"}


def recipe_text(precision: str, recipe: str = "master") -> str:
    """'bf16 autocast over fp32 weights': the precision, as the stack's recipe trains it."""
    if precision == "fp32" or recipe == "master":
        return RECIPES[precision]
    if recipe.endswith("+copies"):  # PEFT's modules_to_save (memcalc.memory.state.finetune_state)
        return recipe_text(precision, recipe.removesuffix("+copies")) + f", {precision} copies of the modules saved"
    return HOW[recipe].format(p=precision) + (" + loss scaling" if precision == "fp16" and recipe != "pure" else "")


def mlp_text(shape) -> str:
    """'SwiGLU 12288'; a mixture: '128 experts, 8 per token, of SwiGLU 768' (+ shared ones, + the dense MLP)."""
    from memcalc.model.shape import moe_layer_count

    if not shape.is_moe:
        return f"{shape.mlp_name} {shape.ffn}"
    shared = f" + {shape.n_shared_experts} shared" if shape.n_shared_experts else ""
    experts = f"{shape.n_experts} experts ({shape.experts_per_token} per token){shared} of {shape.mlp_name} {shape.routed_ffn}"
    moe = moe_layer_count(shape)
    if moe == shape.n_layers:
        return experts
    return f"{experts} in {moe} layers, {shape.mlp_name} {shape.ffn} in {shape.n_layers - moe}"


def heads_text(shape, head_dim: bool) -> str:
    """'32 heads (8 KV, head_dim 128)'; latent attention: its ranks and head dims."""
    if shape.is_mla:
        q = f"q rank {shape.q_lora_rank}, " if shape.q_lora_rank else ""
        return (f"{u.plural(shape.n_heads, 'head')} (MLA: {q}kv rank {shape.kv_lora_rank}, qk {shape.qk_nope_head_dim}"
                f"+{shape.qk_rope_head_dim}, v {shape.v_head_dim})")  # fmt: skip
    return f"{u.plural(shape.n_heads, 'head')} ({shape.n_kv_heads} KV" + (f", head_dim {shape.head_dim})" if head_dim else ")")


def wiring_text(shape) -> str:
    """What sets a Transformers family's block apart (memcalc.model.hfconfig), '' for a Llama or GPT block:
    '; sandwich norms, attention softcap 50, logit softcap 30, sliding window 4096 in 21 of 42 layers'."""
    parts = [{"sandwich": "sandwich norms", "post": "post-norms"}.get(shape.norm_layout, "")]
    parts.append("q/k norms over the projections" if shape.qk_norm and shape.qk_norm_over == "all" else "")
    parts.append("parallel residual" if shape.parallel_residual else "")
    parts.append(f"RoPE on {shape.rope_dim} of {shape.head_dim} dims" if shape.rotary_fraction < 1 else "")
    parts.append(f"attention softcap {shape.attn_softcap:g}" if shape.attn_softcap else "")
    parts.append(f"logit softcap {shape.logit_softcap:g}" if shape.logit_softcap else "")
    if shape.sliding_window:
        local = shape.n_layers - len(shape.global_layers)
        where = "every layer" if local == shape.n_layers else f"{local} of {shape.n_layers} layers"
        parts.append(f"sliding window {shape.sliding_window:,} in {where}")
    text = ", ".join(p for p in parts if p)
    return f"; {text}" if text else ""


def params_text(model) -> str:
    """'8,000,000,000 parameters'; a mixture: its active ones too, and an MTP module's apart."""
    from memcalc.model.shape import param_counts

    shape = model.shape
    if not (shape.is_moe or shape.mtp_layers):
        return f"{model.n_params:,} parameters"
    c = param_counts(shape)
    mtp = f" ({c.main:,} + {c.mtp:,} in {u.plural(shape.mtp_layers, 'MTP module')})" if c.mtp else ""
    return f"{model.n_params:,} parameters{mtp}, {c.active:,} active per token"


def preamble(est: Estimate, units: str = "gb", usable: int | None = None) -> list[str]:
    """The model, the step and the GPU; usable: the verdict's usable bytes (default: the textbook's)."""
    m, s, shape, g = est.model, est.setup, est.model.shape, est.gpu
    usable = est.memory[0].usable_bytes if usable is None else usable
    mlp = mlp_text(shape)
    p = state_sharding(est.layout)
    return [
        f"Model: {m.origin}",
        f"  {u.plural(shape.n_layers, 'layer')}, hidden {shape.hidden}, {heads_text(shape, True)}, {mlp}, {shape.norm}, "
        f"vocab {shape.vocab:,}{', tied embeddings' if shape.tied_embeddings else ''}{wiring_text(shape)}; "
        f"{params_text(m)}",
        f"Setup: seq {s.seq_len:,} x micro-batch {s.micro_batch} x grad-accum {s.grad_accum} = "
        f"{s.tokens_per_step:,} tokens per GPU step; {s.optimizer}; {u.plural(p.gpus, 'GPU')}, ZeRO {p.zero}"
        f"{', optimizer offloaded to CPU' if p.offload else ''}",
        f"GPU: {g.name} ({g.key}): {u.size(g.memory_bytes, units)} total, {u.size(usable, units)} usable after the "
        f"headroom",
    ]


def short_preamble(est: Estimate, units: str = "gb", usable: int | None = None) -> list[str]:
    """The model line (which shape, its own count), and one line for the step and the GPU (usable: as preamble's)."""
    s, p, g = est.setup, state_sharding(est.layout), est.gpu
    usable = est.memory[0].usable_bytes if usable is None else usable
    accum = f" x grad-accum {s.grad_accum}" if s.grad_accum > 1 else ""
    gpus = "one" if p.gpus == 1 else f"{p.gpus:,} x"
    sharding = (f", ZeRO-{p.zero}" if p.zero else "") + (", optimizer offloaded to CPU" if p.offload else "")
    shape = est.model.shape
    return [
        f"Model: {est.model.origin}",
        f"  {u.plural(shape.n_layers, 'layer')}, hidden {shape.hidden}, {heads_text(shape, False)}, {mlp_text(shape)}, "
        f"vocab {shape.vocab:,}{wiring_text(shape)}; {params_text(est.model)}",
        f"Step: seq {s.seq_len:,} x micro-batch {u.batch(s)}{accum} = {s.tokens_per_step:,} tokens per GPU; "
        f"{s.optimizer}; {gpus} {g.key}{sharding} ({u.size(usable, units)} usable)"
    ]


NO_FORMULA = "no formula"  # the textbook's cell for sac: Korthikanti et al. have no row for it


def textbook_size(m, units: str) -> str:
    """A textbook Memory's total in a cell, or that the textbook has none (sac)."""
    return u.size(m.total_bytes, units) if m.formula else NO_FORMULA


def fit_text(b, units: str, free: bool = False) -> str:
    """A result's verdict in a cell (memcalc.memory.setup.Fits): 'yes' (with what is free), 'no, 12.3 GB over',
    or 'no, host 1.2 TB over' when the GPU holds it but the node's CPU memory does not hold what offload moves
    there."""
    if b.free_bytes < 0:  # a few bytes over reads as over, not as 0.000 GB
        return f"no, {u.size_pair(-b.free_bytes, 0, units)[0]} over"
    if not b.host_fits:
        return f"no, host {u.size_pair(b.host_bytes - b.host_usable_bytes, 0, units)[0]} over"
    return f"yes, {u.size(b.free_bytes, units)} free" if free else "yes"


def host_note(b, units: str, paged: bool = False) -> list[str]:
    """What offload (or a paged optimizer's unified memory) puts in CPU memory against this GPU's share of it, when
    it puts anything there."""
    if not b.host_bytes:
        return []
    held, share = u.size_pair(b.host_bytes, b.host_usable_bytes, units)
    how = "offloaded or paged" if paged else "offloaded"
    return [f"host: {held} per GPU {how}, against {share} (its share of the node's CPU memory, --host-memory)"]


def state_section(state: ModelState, units: str) -> Section:
    recipe = recipe_text(state.precision, state.recipe)
    s = Section(
        f"Model state: {recipe}, {state.optimizer}: {state.bytes_per_param:g} bytes/param",
        ["part", "dtype", "bytes/param", "per GPU", "where"],
        align="llrrl",
    )
    for p in state.parts:
        where = "unified" if p.unified else "host" if p.on_host else "GPU"
        shard = f", 1/{p.sharded_over}" if p.sharded_over > 1 else ""
        s.rows.append([p.name, p.dtype, f"{p.bytes_per_param:g}", sized(p.bytes, units), where + shard])
    s.rows.append(["total on GPU", "", f"{state.bytes_per_param:g}", sized(state.total_bytes, units), ""])
    if state.host_bytes:
        s.rows.append(["total on host", "", "", sized(state.host_bytes, units),
                       "its unified parts paged by the driver" if any(p.unified for p in state.parts) else ""])
    return s


def other_recipes(est: Estimate, units: str = "gb") -> list[str]:
    """One line per other precision among the trick sets: its bytes per parameter and total."""
    seen, notes = {est.model_state.precision}, []
    for tricks in est.trick_sets:
        if tricks.precision in seen:
            continue
        seen.add(tricks.precision)
        st = model_state(est.model.n_params, tricks.precision, est.setup.optimizer, state_sharding(est.layout),
                         est.setup.stack.recipe)  # fmt: skip
        parts = " + ".join(f"{p.name} {p.bytes_per_param:g}" for p in st.parts if p.bytes_per_param)
        notes.append(f"{recipe_text(tricks.precision, st.recipe)}: {parts} = {st.bytes_per_param:g} bytes/param "
                     f"-> {u.size(st.total_bytes, units)} per GPU")  # fmt: skip
    return notes


def activations_section(est: Estimate, units: str) -> Section:
    L = est.model.shape.n_layers
    plain = next((a for a in est.activations if a.tricks.label == "bf16"), est.activations[0])
    grouped = bool(plain.groups)
    title = ("Activations, textbook (Korthikanti et al. 2022 and docs/moe.md): the heaviest layer, all layers"
             if grouped else "Activations, textbook (Korthikanti et al. 2022): s·b·h·(34 + 5·a·s/h) bytes per layer")
    s = Section(
        title,
        ["tricks", "kept per layer", f"all {u.plural(L, 'layer')}", "backward peak", f"peak vs {plain.tricks.label}"],
    )
    for a in est.activations:
        if not a.formula:
            s.rows.append([a.tricks.label, NO_FORMULA, NO_FORMULA, NO_FORMULA, ""])
            continue
        change = "" if a is plain else u.signed_percent(a.peak_bytes / plain.peak_bytes - 1)
        s.rows.append([a.tricks.label, sized(a.per_layer_bytes, units), sized(a.total_bytes, units),
                       sized(a.peak_bytes, units), change])  # fmt: skip
        if a.n_checkpointed:  # ckpt:N: the layers checkpointed keep only their input
            s.rows.append([f"  {a.n_checkpointed} checkpointed", sized(a.checkpointed_bytes, units), "", "", ""])
    d = est.attention
    groups = [f"{g.count} {g.name} ({u.size(g.kept_bytes, units)} kept each)" for g in plain.groups]
    s.notes = ([f"{plain.tricks.label}: {', '.join(groups)}"] if groups else []) + [
        f"one head's s×s scores (2·s²·b): {u.exact_bytes(d.score_one_head_bytes)} ({u.size(d.score_one_head_bytes, units)})",
        f"s×s part of one layer (5·a·s²·b): {u.exact_bytes(d.scores_per_layer_bytes)} = "
        f"{u.percent(d.scores_share)} of the layer; all attention (11·s·b·h + 5·a·s²·b): {u.percent(d.attention_share)}",
        "peak: kept bytes of all layers + one layer rebuilt while its backward runs (recompute)",
    ]
    for a in est.activations:
        if a.n_checkpointed:
            s.notes.append(f"{a.tricks.label}: {a.n_checkpointed} of {a.n_layers} layers checkpointed keep their input "
                           "(ckpt's row), the others everything (no recompute's row)")  # fmt: skip
        if not a.formula:
            s.notes.append(f"{a.tricks.label}: no textbook formula: Korthikanti et al. have no row for per-op "
                           "selective checkpointing (the replayed step and --exact count it op by op)")  # fmt: skip
    return s


def logits_section(est: Estimate, units: str) -> Section:
    s = Section("Logits and loss (kept out of the per-layer numbers)", ["recipe", "tensor", "bytes"], align="llr")
    seen = set()
    for tricks, logits in zip(est.trick_sets, est.logits):
        if tricks.precision in seen:
            continue
        seen.add(tricks.precision)
        for t in logits.terms:
            s.rows.append([tricks.precision, f"{t.name} ({t.symbolic()})", sized(t.value, units)])
    return s


def peak_line(g) -> str:
    """The card's dense peaks (0: none, or not given by a --gpu file), and its 16-bit recipe's speed-up over
    fp32 where it has both."""
    rates = ", ".join(f"{name} {getattr(g, name + '_tflops'):g}" for name in ("bf16", "fp16", "tf32", "fp32"))
    half = half_precision(g)
    known = g.peak_flops(half) and g.fp32_tflops
    ratio = f": {half}/fp32 = {g.peak_flops(half) / g.peak_flops('fp32'):.1f}x" if known else ""
    return f"peak {g.key}: {rates} TFLOP/s dense{ratio}"


def compute_section(est: Estimate) -> Section:
    f, g = est.flops, est.gpu
    s = Section(
        f"Compute at {u.percent(est.setup.mfu)} of peak (--mfu) on the {g.key}",
        ["tricks", "model FLOPs/token", "hardware FLOPs/token", "recompute", "step time", "tokens/s", "MFU", "HFU"],
    )
    for c in est.compute:
        s.rows.append([c.tricks.label, u.count(c.flops.model_per_token), u.count(c.flops.hardware_per_token),
                       u.signed_percent(c.flops.recompute_overhead), u.seconds(c.step_seconds),
                       u.rate(c.tokens_per_second), u.percent(c.mfu), u.percent(c.hfu)])  # fmt: skip
    s.notes = [
        f"6N = {f.per_token:,} FLOPs per token (6 per parameter: 2 forward + 4 backward); "
        f"full recompute 8N = {f.per_token_full_recompute:,} ({u.signed_percent(f.recompute_overhead)})",
        f"attention matmuls: {f.attention_per_token:,} FLOPs per token non-causal (12·L·H·Q·s), "
        f"{f.attention_per_token_causal:,} causal",
        "model/hardware FLOPs as Korthikanti et al. 2022 sec. 6.3, non-causal attention; "
        "MFU = model FLOPs / time / peak, HFU counts recompute too",
        peak_line(g),
    ]
    selective = next((c for c in est.compute if c.tricks.recompute == "selective" and not c.tricks.flash), None)
    if selective:
        paper = korthikanti_selective_overhead(est.model.shape, est.setup.seq_len)
        s.notes.append(f"selective recompute: {u.signed_percent(selective.flops.recompute_overhead)} here (QKᵀ again: "
                       "checkpointing stops once backward's tensors are rebuilt); Korthikanti et al. charge "
                       f"{u.signed_percent(paper)} (s/3h in place of s/6h)")  # fmt: skip
    return s


def runs_section(runs) -> Section:
    first = runs[0]
    s = Section(f"Training run: {first.tokens:,} tokens on {first.gpus:,} GPU{'s' if first.gpus > 1 else ''}",
                ["tricks", "tokens/s (job)", "time", "GPU-hours", "cost"])  # fmt: skip
    for r in runs:
        cost = "-" if r.cost is None else f"${r.cost:,.0f}"
        s.rows.append([r.tricks.label, u.rate(r.tokens_per_second), f"{r.days:,.1f} days", f"{r.gpu_hours:,.0f}", cost])
    s.notes = [f"throughput: {first.scaling}"]
    if first.price_per_gpu_hour is not None:
        s.notes.append(f"at ${first.price_per_gpu_hour:g} per GPU-hour")
    return s


# ---- --exact --------------------------------------------------------------------------------


def exact_section(est: Estimate, exacts: list, units: str, peaks: list[int] | None = None) -> Section:
    """Textbook beside exact: what PyTorch saves for this architecture, op by op (memcalc.exact). peaks: the
    job's step peak per GPU where it is not one GPU's step (a data-parallel rank's, sharded: the verdict)."""
    shape = est.model.shape
    s = Section(
        f"Textbook against exact for this {shape.family}-family model (simulated op by op; memcalc verify measures it)",
        ["tricks", "per layer: textbook", "exact", "outside layers: textbook", "exact", "step peak: textbook", "exact"],
    )
    for a, lg, m, x, peak in zip(est.activations, est.logits, est.memory, exacts, peaks or [x.peak_bytes for x in exacts]):
        xa = x.activations
        # exact bytes under the step peak only: under every exact column the table would not fit 100 columns
        tb_layer = u.size(a.per_layer_bytes, units) if a.formula else NO_FORMULA
        s.rows.append([a.tricks.label, tb_layer, u.size(xa.per_layer_bytes, units), u.size(lg.total_bytes, units),
                       u.size(xa.outside_bytes, units), textbook_size(m, units), sized(peak, units)])  # fmt: skip
        if xa.n_checkpointed:  # ckpt:N: the checkpointed layers' row
            tb_ckpt = u.size(a.checkpointed_bytes, units)
            s.rows.append([f"  {xa.n_checkpointed} checkpointed", tb_ckpt, u.size(xa.checkpointed_bytes, units),
                           "", "", "", ""])  # fmt: skip
    first = exacts[0]
    s.notes = [
        "outside the layers: textbook counts the logits and their fp32 copy; exact counts every tensor saved "
        "outside the blocks (embeddings, RoPE tables, final norm, logits, loss)",
        "step peak: textbook adds model state + activations at their peak + logits; exact replays the whole step "
        "(backward's gradients, the optimizer's temporaries) as PyTorch's allocator sees it",
    ]
    by_note: dict[str, list[str]] = {}  # a stack's recipe can differ by trick set (fp32 never autocasts)
    for x in exacts:
        by_note.setdefault(x.note, []).append(x.tricks.label)
    if len(by_note) == 1:
        s.notes.append(f"exact: {first.note}; model state for the shape's own {first.n_params:,} parameters")
    else:
        s.notes += [f"exact ({', '.join(labels)}): {note}" for note, labels in by_note.items()]
        s.notes.append(f"exact: model state for the shape's own {first.n_params:,} parameters")
    blocks = first.activations.first_blocks
    if blocks:  # dense blocks before MoE ones (or fine-tuning's first blocks): the step at that depth is "outside"
        later = "MoE" if est.model.shape.n_experts else "later"
        s.notes.append(f"exact's per layer is a {later} layer's; its outside holds the first {blocks} blocks too (the "
                       f"step at depth {blocks}, from which the {later} layers grow): the textbook's are the heaviest "
                       "layer's and the logits")  # fmt: skip
    return s
