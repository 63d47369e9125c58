"""What `memcalc estimate --sweep` shows: memory and step time against one swept quantity, as bars."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import render
from . import units as u
from .headroom import fragmentation_note, headroom_line
from .render import Section

if TYPE_CHECKING:  # only for annotations
    from memcalc.engine.sweep import Sweep

BAR_WIDTH = 40

def sweep_sections(sw: Sweep, units: str) -> list[Section]:
    biggest = max(max(p.memory_bytes for p in sw.points), sw.usable_bytes)
    memory = Section(f"Peak memory per GPU against {sw.name} ({sw.gpu}: │ marks {u.size(sw.usable_bytes, units)} usable)",
                     [sw.name, "tricks", "memory", "", "fits?"], align="rllrl")  # fmt: skip
    memory.notes = [headroom_line(sw.headroom, units, sw.points)] if sw.headroom else []
    if sw.headroom:
        memory.notes += fragmentation_note(sw.headroom, sw.points)
    if any(p.reserved is not None for p in sw.points):
        memory.notes.append("  memory: what the caching allocator reserves where it is replayed (a step near the "
                            "limit; its idle blocks move with the sizes, so it need not grow with them), else "
                            "the tensors' peak")  # fmt: skip
    slowest = max(p.step_seconds for p in sw.points)
    model = "every kernel against the roofs" if sw.time_model == "roofline" else "hardware FLOPs at --mfu"
    time = Section(f"Step time against {sw.name} ({model})", [sw.name, "tricks", "step time", "", "tokens/s"],
                   align="rllrr")  # fmt: skip
    for p in sw.points:
        memory.rows.append([f"{p.value:,}", p.tricks.label, render.bar(p.memory_bytes, biggest, BAR_WIDTH, sw.usable_bytes),
                            u.size(p.memory_bytes, units), "yes" if p.fits else "no"])  # fmt: skip
        time.rows.append([f"{p.value:,}", p.tricks.label, render.bar(p.step_seconds, slowest, BAR_WIDTH),
                          u.seconds(p.step_seconds), u.rate(p.tokens_per_second)])  # fmt: skip
    return [memory, time]


SWEEP_CSV_HEADERS = ["value", "tricks", "memory_bytes", "fits", "step_seconds", "tokens_per_second"]


def sweep_csv_rows(sw: Sweep) -> list[list[object]]:
    return [[p.value, p.tricks.label, p.memory_bytes, p.fits, f"{p.step_seconds:.6g}", f"{p.tokens_per_second:.6g}"]
            for p in sw.points]  # fmt: skip
