"""The rows of a verify result that need no torch: the textbook's numbers for the model as built (what memcalc
estimate prints), and each judged quantity as a Row beside the exact prediction and the measurement (the
step's phase peaks, the FLOPs, one layer's saved bytes, the timeline's events). verify/run.py fills them.
"""

from __future__ import annotations

from memcalc.exact.step import ExactStep
from memcalc.memory.activations import logits_memory, textbook_activations
from memcalc.memory.estimate import Setup, state_for
from memcalc.model.flops import textbook_step_flops
from memcalc.model.params import n_params
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.verification.results import Row
from memcalc.verification.timeline import Overlay


def textbook(shape: ModelShape, setup: Setup, tricks: Tricks) -> dict[str, int | None]:
    """memcalc estimate's numbers for the model as built; None where the textbook has no formula (sac)."""
    state = state_for(shape, n_params(shape), setup, tricks.precision)[0]  # one GPU's (verify's setup)
    weights, grads = (sum(p.bytes for p in state.parts if p.name.endswith(what)) for what in ("weights", "grads"))
    acts = textbook_activations(shape, setup.seq_len, setup.micro_batch, tricks)
    logits = logits_memory(shape, setup.seq_len, setup.micro_batch, tricks.precision).total_bytes
    flops = textbook_step_flops(shape, setup.seq_len, tricks)
    known = acts.formula
    return {
        "weights": weights,
        "state": state.total_bytes - grads,
        "grads": grads,
        "layer": acts.per_layer_bytes if known else None,
        "checkpointed": acts.checkpointed_bytes,
        "outside": logits,
        "saved": acts.total_bytes + logits if known else None,
        "peak": state.total_bytes + acts.peak_bytes + logits if known else None,
        "flops": flops.hardware_per_token * setup.tokens_per_micro_batch if flops else None,
    }


def step_rows(e: ExactStep, measured, tb: dict[str, int], tol: float, where: dict[str, str]) -> list[Row]:
    """Forward, backward, optimizer-step and whole-step peaks: exact against measured."""
    ph = e.phases
    return [
        Row("forward peak", "bytes", None, ph.forward_peak_bytes, measured.forward_peak_bytes, tol, where["forward"]),
        Row("backward peak", "bytes", None, ph.backward_peak_bytes, measured.backward_peak_bytes, tol,
            where["backward"]),
        Row("optimizer-step peak", "bytes", None, ph.optimizer_peak_bytes, measured.optimizer_peak_bytes, tol,
            where["optimizer"]),
        Row("whole-step peak", "bytes", tb["peak"], ph.step_peak_bytes, measured.step_peak_bytes, tol,
            "textbook: model state + activations + logits"),
    ]  # fmt: skip


def flop_rows(e: ExactStep, measured: int | None, tb: dict[str, int], tol: float) -> list[Row]:
    f = e.flops
    return [
        Row("FLOPs, forward + backward (FlopCounterMode: non-causal, recompute counted)", "flops", tb["flops"],
            f.counted, measured, tol if measured is not None else None),
        Row("FLOPs, the same with causal attention halved", "flops", None, f.counted_causal, None),
        Row("model FLOPs (6·W·tokens + 12·L·a·d·s·tokens), non-causal", "flops", None, f.model, None),
        Row("model FLOPs, causal", "flops", None, f.model_causal, None),
    ]  # fmt: skip


def overlay_row(overlay: Overlay) -> Row:
    """The timeline judged: every event coincides (the same op and bytes, the same live bytes after it)."""
    n = max(len(overlay.predicted.ops), len(overlay.measured.ops))
    return Row("events of the step (allocations, frees) as predicted (--timeline)", "count", None, n,
               overlay.coinciding, 0.0, overlay.first_difference or "each: the same op, bytes and live bytes")


def textbook_gaps(tricks: Tricks) -> tuple[str, ...]:
    """What the textbook column leaves out, and why."""
    if tricks.recompute == "op":
        return (("textbook: no formula for sac (Korthikanti et al. have no row for per-op selective "
                 "checkpointing); what it keeps is replayed op by op"),)  # fmt: skip
    if tricks.mixed:
        return ((f"textbook for {tricks.label}: each layer checkpointed keeps its input (ckpt's row), every "
                 "other layer all it saves (the row without recompute)"),)  # fmt: skip
    return ()


def layer_rows(m, a, tb: dict, tol: float, later: str = " MoE") -> list[Row]:
    """Saved for backward by one layer: from depths 1 and 2; with ckpt:N one layer of each kind, from
    depths N − 1, N and N + 1; with dense blocks before MoE ones, a MoE layer (of each kind) past the
    blocks exact counts outside (later: " MoE", or " later" past fine-tuning's first blocks), where the textbook
    has no row of its own. sac saves the outputs its
    policy keeps (counted as saved: they are kept for backward), and the textbook has no formula for it."""
    none = "; textbook: no formula for sac" if tb["layer"] is None else ""
    first = m.first_blocks
    kind, tb_layer, tb_ckpt = (later, None, None) if first else ("", tb["layer"], tb["checkpointed"])
    p, c = m.plain_depth, m.checkpointed_depth
    if m.saved_checkpointed_layer_bytes is None:
        return [Row(f"saved for backward, one{kind} layer", "bytes", tb_layer, a.per_layer_bytes,
                    m.saved_one_layer_bytes, tol, f"measured: depth {p + 1} less depth {p}" + none)]  # fmt: skip
    return [
        Row(f"saved for backward, one{kind} layer not checkpointed", "bytes", tb_layer, a.per_layer_bytes,
            m.saved_one_layer_bytes, tol, f"measured: depth {p + 1} less depth {p}"),
        Row(f"saved for backward, one{kind} checkpointed layer", "bytes", tb_ckpt, a.checkpointed_bytes,
            m.saved_checkpointed_layer_bytes, tol, f"measured: depth {c + 1} less depth {c}"),
    ]  # fmt: skip
