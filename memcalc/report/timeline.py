"""--timeline in the terminal: live memory over the step as a chart of block characters (within 100
columns), the phases under it, the peak marked and named, and what is live at the peak; its CSV rows.

Several trick sets (or a prediction and a measurement) share one axis: their phases are lined up (each
phase as wide as the most events any makes in it), so that one set's forward sits over another's. For one
series the axis is the event's index (memcalc.exact.timeline: an allocation, or the frees between two).
A column shows the highest live bytes of the events in
it, so the tallest column is the peak; the chart starts at the model state (the live bytes as the step
starts; the lowest of the series'), the floor under the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.exact.timeline import phase_at

from . import units as u
from .render import Section, sized, width

ROWS = 12  # the chart's height in lines
LEVELS = " ▁▂▃▄▅▆▇█"  # eighths of a line
TOP_GROUPS = 8  # what is live at the peak: the largest groups shown


@dataclass(frozen=True)
class Series:
    """One curve on the chart: a name, its phases (memcalc.exact.timeline.Span) and live bytes after each event."""

    name: str
    phases: tuple
    live_bytes: tuple[int, ...]
    state_bytes: int  # live as the step starts
    peak_at: str = ""  # the op at the peak ("backward: mm")


def series_of(t, name: str = "") -> Series:
    """A Timeline (memcalc.exact.timeline) as a curve."""
    return Series(name or t.tricks.label, t.phases, t.live_bytes, t.start_bytes, t.peak_at)


def measured_series(m, name: str = "") -> Series:
    """A measured step (memcalc.verification.timeline.Measured) as a curve."""
    peak = m.live_bytes.index(max(m.live_bytes))
    return Series(name or f"measured on {m.device}", m.phases, m.live_bytes, m.start_bytes,
                  f"{phase_at(m.phases, peak)}: {m.ops[peak]}")


def axis(all_series: list[Series]) -> tuple[list[float], list[list[float]]]:
    """The shared axis: each phase's start (by position in the step; a phase as wide as the most events any
    series makes in it), and each series' events placed on it."""
    n = max(len(s.phases) for s in all_series)
    widths = [max((sp.end - sp.start for s in all_series for sp in s.phases[k:k + 1]), default=1) for k in range(n)]
    starts = [sum(widths[:k]) for k in range(n + 1)]
    xs = []
    for s in all_series:
        x = []
        for k, sp in enumerate(s.phases):
            step = widths[k] / (sp.end - sp.start)
            x += [starts[k] + (i - sp.start) * step for i in range(sp.start, sp.end)]
        xs.append(x)
    return starts, xs


def columns(live: tuple[int, ...], x: list[float], total: float, cols: int) -> list[int]:
    """The highest live bytes of the events in each of cols columns (an empty column keeps the last)."""
    out = [-1] * cols
    for value, at in zip(live, x):
        c = min(cols - 1, int(at / total * cols))
        out[c] = max(out[c], value)
    last = 0
    for c in range(cols):
        last = out[c] = out[c] if out[c] >= 0 else last
    return out


def bar_rows(values: list[int], top: int, base: int) -> list[str]:
    """ROWS lines of block characters for the values from base to top, the top line first."""
    span = top - base
    eighths = [round((v - base) / span * ROWS * 8) if span > 0 else 0 for v in values]
    return ["".join(LEVELS[min(8, max(0, e - r * 8))] for e in eighths).rstrip() for r in range(ROWS - 1, -1, -1)]


def chart_lines(all_series: list[Series], units: str = "gb", cols: int | None = None,
                marks: list[list[int]] | None = None) -> list[str]:  # fmt: skip
    """Each series' chart on the shared axis and one scale, stacked: its name and peak, the bars from the
    lowest model state to the highest peak, the axis with the phases under it, ▲ under the peak; marks: per
    series, events to flag with × (where a measurement differs from the prediction)."""
    cols = min(cols or width(), 100)
    top, base = max(max(s.live_bytes) for s in all_series), min(s.state_bytes for s in all_series)
    labels = [u.size(top, units), u.size(base, units)]
    gutter = max(len(x) for x in labels) + 1
    plot = cols - gutter - 2
    starts, xs = axis(all_series)
    total = starts[-1]
    edges = [min(plot - 1, int(x / total * plot)) for x in starts[:-1]]
    out = []
    for k, (s, x) in enumerate(zip(all_series, xs)):
        values = columns(s.live_bytes, x, total, plot)
        peak = s.live_bytes.index(max(s.live_bytes))
        out.append(f"{s.name}: peak {u.size(max(s.live_bytes), units)} at event {peak + 1:,} of "
                   f"{len(s.live_bytes):,}" + (f" ({s.peak_at})" if s.peak_at else ""))  # fmt: skip
        for r, line in enumerate(bar_rows(values, top, base)):
            label = labels[0] if r == 0 else labels[1] if r == ROWS - 1 else ""
            out.append(f"{label.rjust(gutter - 1)} │{line}".rstrip())
        out.append(" " * gutter + "└" + "".join("┴" if c in edges[1:] else "─" for c in range(plot)))
        out.append(" " * (gutter + 1) + phase_names(all_series[0].phases, edges, plot))
        flagged = {min(plot - 1, int(x[i] / total * plot)) for i in (marks[k] if marks else [])}
        under = {min(plot - 1, int(x[peak] / total * plot)): "▲"} | {c: "×" for c in flagged}
        out.append((" " * (gutter + 1) + "".join(under.get(c, " ") for c in range(plot))).rstrip())
    return out


def phase_names(phases: tuple, edges: list[int], plot: int) -> str:
    """Each phase's name from its first column, cut short where the next phase starts."""
    row = [" "] * plot
    for k, sp in enumerate(phases):
        end = edges[k + 1] if k + 1 < len(edges) else plot
        name = sp.phase[: max(0, end - edges[k] - 1)]
        row[edges[k]:edges[k] + len(name)] = name
    return "".join(row).rstrip()


def peak_text(t, units: str) -> str:
    """Where a Timeline peaks, in one sentence."""
    return (f"{t.tricks.label} peaks at {u.size(t.peak_bytes, units)} ({u.exact_bytes(t.peak_bytes)}) at "
            f"event {t.peak_index + 1:,} of {len(t.ops):,} ({t.peak_at}); what it allocates: "
            f"{t.peak_what}")  # fmt: skip


def at_peak_section(t, units: str, top: int = TOP_GROUPS) -> Section:
    """What is live at a Timeline's peak, the largest groups first, the rest summed."""
    s = Section(f"Live at the peak of {t.tricks.label} ({t.peak_at})", ["what", "layers", "tensors", "bytes"],
                align="llrr")  # fmt: skip
    for g in t.at_peak[:top]:
        s.rows.append([g.what, g.layers, f"{g.tensors:,}", sized(g.bytes, units)])
    rest = t.at_peak[top:]
    if rest:
        s.rows.append([f"{len(rest)} more kinds", "", f"{sum(g.tensors for g in rest):,}",
                       sized(sum(g.bytes for g in rest), units)])  # fmt: skip
    s.rows.append(["= the peak", "", f"{sum(g.tensors for g in t.at_peak):,}", sized(t.peak_bytes, units)])
    s.notes = [peak_text(t, units)]
    return s


CSV_HEADERS = ["tricks", "event", "phase", "op", "what", "layer", "bytes", "live_bytes"]


def csv_rows(timelines) -> list[list]:
    """Every event of every trick set's step."""
    rows = []
    for t in timelines:
        for sp in t.phases:
            for i in range(sp.start, sp.end):
                layer = "" if t.layers[i] is None else t.layers[i]
                rows.append([t.tricks.label, i, sp.phase, t.ops[i], t.labels[t.what[i]], layer, t.nbytes[i],
                             t.live_bytes[i]])  # fmt: skip
    return rows
