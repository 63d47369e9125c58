"""`memcalc estimate --explain`: each formula with the job's numbers substituted, as a course would show it
(the textbook's, then with --exact the replay's terms); memcalc.report.layout and roofline add their own."""

from __future__ import annotations

from memcalc.memory.estimate import Estimate
from memcalc.memory.state import state_sharding
from memcalc.model.flops import flop_terms, layer_weights, stack_weights
from memcalc.terms import Term

from . import units as u
from .estimate import recipe_text


def symbols(est: Estimate) -> dict[str, int]:
    shape, s = est.model.shape, est.setup
    return {
        "s": s.seq_len, "b": s.micro_batch, "h": shape.hidden, "a": shape.n_heads, "d": shape.head_dim,
        "L": shape.n_layers, "v": shape.vocab, "N": est.model.n_params, "G": state_sharding(est.layout).gpus,
        "W": layer_weights(shape),
    } | moe_explain_symbols(est)  # fmt: skip


def moe_explain_symbols(est: Estimate) -> dict[str, int]:
    """The symbols of the MoE, MLA and MTP formulas (none for a dense model)."""
    from memcalc.memory.moe import moe_symbols

    shape, s = est.model.shape, est.setup
    if not (shape.is_moe or shape.is_mla or shape.mtp_layers):
        return {}
    return {"N_act": est.flops.n_params, "W_all": stack_weights(shape), "L_a": shape.n_layers + shape.mtp_layers,
            "mtp": shape.mtp_layers, "d_qk": shape.head_dim, "d_v": shape.v_dim} | moe_symbols(
        shape, s.seq_len, s.micro_batch, s.routing)  # fmt: skip


def explain_term(t: Term, syms: dict[str, int], unit: str) -> str:
    return f"  {t.name}: {t.symbolic()} = {t.substituted(syms)} = {t.value:,} {unit}   [{t.source}]"


def explain_lines(est: Estimate, mfu_time: bool = True) -> list[str]:
    """Each formula with this config's numbers substituted, as a course would show it (with the
    --mfu step time when mfu_time: the roofline explains its own)."""
    syms = symbols(est)
    legend = ", ".join(f"{k} = {v:,}" for k, v in syms.items())
    lines = [f"Symbols: {legend}", "", f"Model state ({recipe_text(est.model_state.precision, est.model_state.recipe)}, per GPU):"]
    for p in est.model_state.parts:
        t = Term(p.name, p.bytes, p.formula, "Rajbhandari et al. 2019, sec. 3.1")
        lines.append(explain_term(t, syms, "B"))
    for a in est.activations:
        lines += ["", f"Activations, {a.tricks.label}:"]
        if not a.formula:
            lines.append("  no textbook formula: Korthikanti et al. have no row for per-op selective checkpointing "
                         "(--exact shows what it keeps, op by op)")  # fmt: skip
            continue
        lines += [explain_term(t, syms, "B") for t in a.terms + a.checkpointed]
        lines.append(f"  kept per layer = {' + '.join(f'{t.value:,}' for t in a.terms)} = {a.per_layer_bytes:,} B")
        if a.groups:  # layers of several kinds: each kind's kept bytes times its count
            parts = " + ".join(f"{g.kept_bytes:,} · {g.count} ({g.name})" for g in a.groups)
            lines.append(f"  all layers = {parts} = {a.total_bytes:,} B")
        elif a.n_checkpointed:
            plain = a.n_layers - a.n_checkpointed
            lines.append(f"  kept per checkpointed layer = {a.checkpointed_bytes:,} B")
            lines.append(f"  all layers = {a.per_layer_bytes:,} · {plain} + {a.checkpointed_bytes:,} · "
                         f"{a.n_checkpointed} = {a.total_bytes:,} B")  # fmt: skip
        else:
            lines.append(f"  all layers = {a.per_layer_bytes:,} · {a.n_layers} = {a.total_bytes:,} B")
        if a.rebuilt:
            rebuilt = " + ".join(t.symbolic() for t in a.rebuilt)
            lines.append(f"  peak = {a.total_bytes:,} + one layer rebuilt ({rebuilt} = {a.rebuilt_bytes:,}) = {a.peak_bytes:,} B")
    lines += ["", "Logits and loss:"]
    seen = set()
    for tricks, logits in zip(est.trick_sets, est.logits):
        if tricks.precision not in seen:
            seen.add(tricks.precision)
            lines += [explain_term(t, syms, "B") for t in logits.terms]
    lines += ["", "FLOPs per token:"]
    lines += [explain_term(t, syms, "FLOPs") for t in flop_terms(est.model.shape, est.model.n_params, est.setup.seq_len)]
    for c in est.compute if mfu_time else ():
        lines.append(f"  {c.tricks.label}: step = {c.tokens_per_step:,} tokens · {c.flops.hardware_per_token:,} FLOPs "
                     f"/ ({est.setup.mfu:g} · {c.peak_flops:.4g} FLOP/s) = {u.seconds(c.step_seconds)}")  # fmt: skip
    return lines


def exact_explain_lines(est: Estimate, exacts: list) -> list[str]:
    """The exact terms with their numbers: they use the shape's own sizes (k KV heads, f MLP width) too."""
    from memcalc.exact.step import symbols as exact_symbols

    extra = exact_symbols(est.model.shape, est.setup.seq_len, est.setup.micro_batch)
    syms = symbols(est) | extra
    legend = ", ".join(f"{k} = {v:,}" for k, v in extra.items() if k not in symbols(est))
    lines = ["", f"Exact symbols, besides those above: {legend}"]
    for x in exacts:
        a = x.activations
        lines += ["", f"Exact, {a.tricks.label}: saved per layer, op by op:"]
        lines += [explain_term(t, syms, "B") for t in a.terms]
        lines.append(f"  per layer = {a.per_layer_bytes:,} B; outside the layers = {a.outside_bytes:,} B")
        if a.n_checkpointed:
            lines += [f"  each of the {a.n_checkpointed} checkpointed layers:"]
            lines += [explain_term(t, syms, "B") for t in a.checkpointed]
            lines.append(f"  per checkpointed layer = {a.checkpointed_bytes:,} B")
    return lines
