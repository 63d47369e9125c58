"""What `memcalc verify` shows: measured against predicted, row by row, and the matrix summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import units as u
from .render import Cell, Section, sized

if TYPE_CHECKING:  # the result types, only for annotations
    from memcalc.verification.distributed import DistResult
    from memcalc.verification.results import CustomResult, Row, VerifyResult


def value(x: float | None, unit: str, units: str) -> Cell:
    """A row's number in its unit: bytes with their exact count under them."""
    if x is None:
        return "-"
    if unit == "bytes":
        return sized(int(x), units)
    if unit in ("flops", "count"):
        return (u.count(x), f"{int(x):,}")
    if unit == "seconds":
        return u.seconds(x)
    if unit == "fraction":
        return u.percent(x)
    if unit == "tokens/s":
        return u.rate(x)
    return f"{x:,.4g}"


def verdict(row: Row) -> str:
    return {True: "pass", False: "FAIL", None: ""}[row.passed]


def error_text(row: Row) -> str:
    e = row.error
    if e is None:
        return ""
    return "exact" if e == 0 else f"{100 * e:+.3f}%"


def verify_preamble(r: VerifyResult) -> list[str]:
    depth = u.plural(r.layers_built, "layer") + (f" of {r.layers_requested}: {r.layers_note}" if r.layers_note else "")
    gpu = f" ({r.gpu_name})" if r.gpu_name else ""
    return [
        f"Model: {r.origin} ({r.family} family), {depth}",
        f"Step: {r.tricks}, seq {r.seq_len:,} x micro-batch {u.batch(r)}; attention: {r.attention}",
        f"Device: {r.device}{gpu}: {r.device_reason}; torch {r.torch_version}; tolerance {u.percent(r.tolerance, 2)}",
    ]


def verify_sections(r: VerifyResult, units: str, detail: bool = False) -> list[Section]:
    """The rows (and the step time on CUDA); with detail, each row's note and the allocator phase by phase."""
    s = Section(f"{r.tricks}: textbook, exact prediction and measurement",
                ["quantity", "textbook", "exact prediction", "measured", "error", "pass"], align="lrrrrl")  # fmt: skip
    for row in r.rows:
        s.rows.append([row.quantity, value(row.textbook, row.unit, units), value(row.exact, row.unit, units),
                       value(row.measured, row.unit, units), error_text(row), verdict(row)])  # fmt: skip
    if detail:
        s.notes = [f"{row.quantity}: {row.note}" for row in r.rows if row.note] + list(r.notes)
    else:  # what the textbook column leaves out (sac) or mixes (ckpt:N), and how CUDA differs from a CPU run, always
        s.notes = [n for n in r.notes if n.startswith(("textbook", "the CUDA prediction"))]
    if r.error:
        s.notes.insert(0, f"did not finish: {r.error}")
    sections = [s]
    if r.phases is not None and detail:
        sections.append(phases_section(r, units))
    if r.timing is not None:
        sections.append(timing_section(r))
    return sections


def phases_section(r: VerifyResult, units: str) -> Section:
    p = r.phases
    s = Section("The allocator, phase by phase (torch.cuda memory statistics)", ["phase", "bytes"])
    for name, x in (("after building (memory_allocated)", p.after_build_bytes),
                    ("after the first optimizer step", p.after_first_step_bytes),
                    ("kept by forward", p.retained_bytes), ("forward peak (max_memory_allocated)", p.forward_peak_bytes),
                    ("backward peak", p.backward_peak_bytes), ("optimizer-step peak", p.optimizer_peak_bytes),
                    ("reserved peak (max_memory_reserved)", p.reserved_peak_bytes)):  # fmt: skip
        s.rows.append([name, sized(x, units)])
    return s


def timing_section(r: VerifyResult) -> Section:
    t = r.timing
    s = Section(f"Step time: median of {t.steps} steps after warm-up (CUDA events)", ["quantity", "value"])
    s.rows = [
        ["step time", u.seconds(t.step_seconds)],
        ["predicted by the roofline", "-" if t.predicted_seconds is None else
         f"{u.seconds(t.predicted_seconds)} (measured {100 * t.predicted_error:+.1f}%)"],
        ["tokens/s", u.rate(t.tokens_per_second)],
        ["achieved model TFLOP/s", f"{t.model_tflops:.1f}"],
        ["achieved hardware TFLOP/s (recompute counted)", f"{t.hardware_tflops:.1f}"],
        ["MFU", "-" if t.mfu is None else u.percent(t.mfu)],
        ["HFU", "-" if t.hfu is None else u.percent(t.hfu)],
    ]
    if t.peak_tflops is not None:
        s.notes.append(f"against the GPU table's dense peak of {t.peak_tflops:g} TFLOP/s")
    if t.predicted_seconds is not None:
        top = ", ".join(f"{op.name} {u.seconds(op.seconds)}" for op in t.predicted_ops[:3])
        s.notes.append(f"roofline ({t.calibration}): slowest predicted ops {top}; every op in the JSON (timing.predicted_ops)")
    return s


CSV_HEADERS = ["tricks", "quantity", "unit", "textbook", "exact", "measured", "error", "tolerance", "passed"]


def csv_rows(results: list[VerifyResult]) -> list[list[object]]:
    """Every row of every run, raw numbers (bytes, FLOPs, seconds) and the relative error."""
    return [[r.tricks, row.quantity, row.unit, row.textbook, row.exact, row.measured, row.error, row.tolerance,
             row.passed] for r in results for row in r.rows]  # fmt: skip


def verify_verdict(results: list[VerifyResult]) -> str:
    """Pass or fail in one sentence: how many rows were judged, and which missed."""
    judged = sum(row.passed is not None for r in results for row in r.rows)
    tol = ", ".join(dict.fromkeys(u.percent(r.tolerance, 2) for r in results))
    unfinished = [r.tricks for r in results if r.error]
    failed = [f"{r.tricks}: {row.quantity}" for r in results for row in r.failed]
    if not unfinished and not failed:
        return f"Pass: all {judged} judged rows within {tol} of the exact prediction."
    parts = ([f"did not finish: {', '.join(unfinished)}"] if unfinished else []) + (
        [f"outside {tol}: {'; '.join(failed)}"] if failed else [])  # fmt: skip
    return "FAIL: " + "; ".join(parts) + "."


def dist_verdict(d: DistResult) -> str:
    shown = sorted({r.quantity for rc in d.ranks for r in rc.rows if not r.checked})
    if d.passed and shown:
        return (f"Pass: every judged per-rank quantity equals PyTorch's own on {d.world} ranks; shown beside them, not "
                f"judged: {', '.join(shown)}.")  # fmt: skip
    if d.passed:
        return f"Pass: every per-rank quantity equals PyTorch's own on {d.world} ranks."
    return "FAIL: memcalc's per-rank prediction differs from PyTorch's (rows marked NO)."


def peak_row(r: VerifyResult) -> Row | None:
    return next((row for row in r.rows if row.quantity == "whole-step peak"), None)


def matrix_sections(results: list[VerifyResult], units: str) -> list[Section]:
    first = results[0]
    s = Section(f"Every trick set on {first.device}: the whole-step peak, predicted and measured",
                ["tricks", "textbook", "exact prediction", "measured", "error", "reserved", "step time", "predicted",
                 "tokens/s", "MFU", "pass"], align="lrrrrrrrrrl")  # fmt: skip
    for r in results:
        row = peak_row(r)
        reserved = "-" if r.phases is None else u.size(r.phases.reserved_peak_bytes, units)
        t = r.timing
        timing = ["-", "-", "-", "-"] if t is None else [
            u.seconds(t.step_seconds), "-" if t.predicted_seconds is None else u.seconds(t.predicted_seconds),
            u.rate(t.tokens_per_second), "-" if t.mfu is None else u.percent(t.mfu)]  # fmt: skip
        if row is None:
            s.rows.append([r.tricks, "-", "-", "-", "-", reserved, *timing, "FAIL" if not r.passed else ""])
            continue
        s.rows.append([r.tricks, value(row.textbook, "bytes", units), value(row.exact, "bytes", units),
                       value(row.measured, "bytes", units), error_text(row), reserved, *timing,
                       "pass" if r.passed else "FAIL"])  # fmt: skip
    s.notes = [f"{r.tricks}: {r.error}" for r in results if r.error]
    s.notes += [f"{r.tricks}: failed rows: {', '.join(row.quantity for row in r.failed)}" for r in results if r.failed]
    s.notes.append("pass: every row of the run within tolerance (memcalc verify --tricks T for the rows)")
    if any(r.timing is not None and r.timing.predicted_seconds is not None for r in results):
        s.notes.append("predicted: the roofline's step time for the model as built (memcalc.time.roofline), not judged")
    return [s]


def dist_preamble(d: DistResult, matrix: bool = False) -> list[str]:
    tricks = "every trick set the check runs" if matrix else d.tricks.label
    return [
        f"Model: {d.model}, {d.n_params:,} parameters; seq {d.seq_len:,} x micro-batch {d.micro_batch}; {tricks}",
        f"Layout: {d.layout.label}, world {d.world}; device {d.device} (backend {d.backend}); torch {d.torch_version}; "
        f"{d.seconds:.1f} s",
    ]


def dist_sections(d: DistResult) -> list[Section]:
    from memcalc.verification.distributed import TABLE_HEADERS

    s = Section("Per rank: memcalc's prediction (+ named differences) against PyTorch's own", TABLE_HEADERS,
                align="rlrrrrll")  # fmt: skip
    s.rows = [[f"{c:,}" if isinstance(c, int) else str(c) for c in row] for row in d.table()]
    s.notes = list(d.notes)
    return [s]


def dist_matrix_sections(results: list[DistResult]) -> list[Section]:
    """--matrix with --fsdp/--tp: one line per trick set and rank; the step's peak where it was measured."""
    s = Section("Every trick set, per rank: rows judged, every byte named, and the step's peak",
                ["tricks", "rank", "rows", "exact", "peak, memcalc", "peak, PyTorch", "pass"], align="lrrrrrl")  # fmt: skip
    for d in results:
        for rc in d.ranks:
            judged = [r for r in rc.rows if r.checked]
            by = {r.quantity: r for r in rc.rows}
            peak = by.get("backward peak"), by.get("forward peak")
            peak = max((r for r in peak if r is not None), key=lambda r: r.measured_bytes, default=None)
            s.rows.append([d.tricks.label, f"{rc.rank:,}", f"{len(judged)}", f"{sum(r.exact for r in judged)}",
                           "-" if peak is None else f"{peak.predicted_bytes:,}",
                           "-" if peak is None else f"{peak.measured_bytes:,}", "yes" if rc.passed else "NO"])  # fmt: skip
    s.notes = ["exact: rows whose prediction and named differences equal PyTorch's bytes; every row of one run "
               "with --format json or without --matrix", *results[0].notes[:1]]  # fmt: skip
    return [s]


def dist_matrix_verdict(results: list[DistResult]) -> str:
    failed = [d.tricks.label for d in results if not d.passed]
    if not failed:
        return f"Pass: {len(results)} trick sets, every per-rank quantity equal to PyTorch's own on {results[0].world} ranks."
    return f"FAIL: {', '.join(failed)}: memcalc's per-rank prediction differs from PyTorch's (rows marked NO)."


def custom_preamble(r: CustomResult) -> list[str]:
    predicted = f"stack {r.stack}, {r.tricks}, {r.model}" if not r.prediction_note else r.prediction_note
    return [
        f"Step: {r.step}, seq {r.seq_len:,} x micro-batch {r.micro_batch}; device {r.device}; torch {r.torch_version}",
        f"Prediction: {predicted}",
    ]


def custom_sections(r: CustomResult, units: str, detail: bool = False) -> list[Section]:
    """Your step measured, memcalc's stack beside it; with detail, where the peaks were and what forward saved."""
    s = Section("Your step, measured, against memcalc's prediction for the stack",
                ["quantity", "memcalc", "your step", "difference"], align="lrrr")  # fmt: skip
    for row in r.rows:
        s.rows.append([row.quantity, value(row.exact, row.unit, units), value(row.measured, row.unit, units),
                       error_text(row)])  # fmt: skip
    s.notes = ["difference: (your step - memcalc) / memcalc; not judged, your code is not the stack's"]
    if not detail:
        return [s]
    s.notes += [f"{phase} peak at {at}" for phase, at in zip(("forward", "backward", "optimizer-step"), r.peaks_at)]
    saved = Section("What your forward saved for backward, by the op that made it (the most first)",
                    ["op, dtype, shape", "bytes"], align="lr")  # fmt: skip
    saved.rows = [[op, sized(n, units)] for op, n in r.saved_by_op[:20]]
    if len(r.saved_by_op) > 20:
        saved.notes.append(f"{len(r.saved_by_op) - 20} more in the JSON (saved_by_op)")
    return [s, saved]


def custom_verdict(r: CustomResult, units: str) -> str:
    """The whole-step peak in one sentence: yours, and memcalc's for the stack."""
    peak = next(row for row in r.rows if row.quantity == "whole-step peak")
    mine = u.size(peak.measured, units)
    if peak.exact is None:
        return f"Your step peaks at {mine} on {r.device}; no prediction beside it ({r.prediction_note})."
    diff = "the same to the byte" if peak.error == 0 else f"yours {error_text(peak)}"
    return f"Your step peaks at {mine}; memcalc predicts {u.size(peak.exact, units)} for {r.stack}: {diff}."
