"""What `memcalc fit` shows: the longest sequence and largest micro-batch, and what memory holds at each."""

from __future__ import annotations

from memcalc.engine.fit import FitLimits

from . import units as u
from .headroom import allocator_note, fragmentation_note, headroom_line
from .render import Section, sized


def fit_preamble(limits: FitLimits, origin: str, units: str) -> list[str]:
    """The model, the headroom, and what the caching allocator does at each limit."""
    limits_at = [(v, f"at seq {limits.max_seq_len:,} x micro-batch {limits.micro_batch}") if v is limits.memory_at_max_seq
                 else (v, f"at seq {limits.seq_len:,} x micro-batch {limits.max_micro_batch}")
                 for v in (limits.memory_at_max_seq, limits.memory_at_max_batch) if v]  # fmt: skip
    at = [v for v, _ in limits_at]
    lines = [f"Model: {origin}", headroom_line(limits.headroom, units, at), *fragmentation_note(limits.headroom, at)]
    return lines + allocator_note(at, units, [label for _, label in limits_at])


def fit_sections(limits: FitLimits, units: str, detail: bool = False) -> list[Section]:
    """The two limits; with detail, what memory holds at each."""
    s = Section(
        f"What fits one {limits.gpu} ({u.size(limits.usable_bytes, units)} usable) with {limits.tricks.label}",
        ["limit", "value", "memory at the limit"],
    )
    seq_mem = limits.memory_at_max_seq
    batch_mem = limits.memory_at_max_batch
    s.rows.append([f"longest sequence at micro-batch {limits.micro_batch}", f"{limits.max_seq_len:,}",
                   sized(seq_mem.total_bytes, units) if seq_mem else "-"])  # fmt: skip
    s.rows.append([f"largest micro-batch at seq {limits.seq_len:,}", f"{limits.max_micro_batch:,}",
                   sized(batch_mem.total_bytes, units) if batch_mem else "-"])  # fmt: skip
    for name, by in (("the longest sequence", limits.seq_bound_by), ("the largest micro-batch",
                                                                      limits.batch_bound_by)):  # fmt: skip
        if by:
            s.notes.append(f"{name}: the {by} phase beside the step (memcalc estimate's phases section), not the "
                           "step, ends it; the memory shown is the step's")  # fmt: skip
    if not detail:
        return [s]
    parts = Section("Memory per GPU at each limit: the step replayed op by op",
                    ["limit", "state", "+ at peak", "= peak", "peak in"], align="lrrrl")  # fmt: skip
    for name, m in (("longest sequence", seq_mem), ("largest micro-batch", batch_mem)):
        if m is not None:
            parts.rows.append([name, sized(m.state_bytes, units), sized(m.transient_bytes, units),
                               sized(m.peak_bytes, units), m.peak_at])  # fmt: skip
    parts.notes = ["state: weights, master and optimizer state between steps; at peak: activations, logits, "
                   "gradients, temporaries (as `memcalc estimate` and `memcalc verify` count them)"]  # fmt: skip
    return [s, parts]


def fit_verdict(limits: FitLimits) -> str:
    if not limits.max_seq_len and limits.none_fit_at.startswith("load:"):
        what = limits.none_fit_at.removeprefix("load: ")
        return f"Nothing fits: the model's load alone is larger than the GPU ({what}); `memcalc estimate` shows it."
    if not limits.max_seq_len:
        return ("Nothing fits: model state alone is larger than the GPU; `memcalc estimate` shows the toolbox "
                "(ZeRO, offload).")  # fmt: skip
    batch = (f"the largest micro-batch at seq {limits.seq_len:,} is {limits.max_micro_batch:,}" if limits.max_micro_batch
             else f"not one sequence of {limits.seq_len:,} tokens fits")  # fmt: skip
    table = ", the length of the model's position table" if limits.seq_capped else ""
    return (f"Longest sequence that fits: {limits.max_seq_len:,} tokens at micro-batch {limits.micro_batch}{table}; "
            f"{batch}.")
