"""--timeline --png/--svg: live memory over the step as a figure (matplotlib, imported when drawn: see plot).

Every event is drawn (memcalc.exact.timeline: each allocation, the frees between two as one), the live
bytes held from one to the next. The series share memcalc.report.timeline's axis (phases lined up);
the phases are shaded and named, each series' peak marked and named, and the GPU's usable memory drawn
as the sweep's figure draws it where it falls on the chart (the legend lists only what is drawn). A
measurement (verify --timeline) is drawn dashed over its prediction.
"""

from __future__ import annotations

from .plot import pyplot, save
from .timeline import Series, axis
from .units import UNITS, size

SHADES = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer": "#dff2d8"}


def save_timeline(all_series: list[Series], path: str, units: str = "gb", usable: int | None = None, gpu: str = "",
                  title: str = "", flag: str = "--png", dashed: tuple[int, ...] = (),
                  marks: list[list[int]] | None = None) -> None:  # fmt: skip
    """One axes: each series' live bytes, the phases shaded, each peak marked; usable: the GPU's usable bytes,
    as a dashed line (where it is under the chart's top); dashed: the series drawn dashed; marks: per series,
    events to flag (red ×)."""
    plt = pyplot(flag)
    scale, unit = UNITS[units]
    starts, xs = axis(all_series)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for k, sp in enumerate(all_series[0].phases):
        ax.axvspan(starts[k], starts[k + 1], color=SHADES.get(sp.phase, "#eeeeee"), linewidth=0)
        ax.text((starts[k] + starts[k + 1]) / 2, 0.02, sp.phase, transform=ax.get_xaxis_transform(), ha="center",
                fontsize=8, color="#444444")  # fmt: skip
    for k, (s, x) in enumerate(zip(all_series, xs)):
        line, = ax.plot(x, [v / scale for v in s.live_bytes], drawstyle="steps-post", linewidth=1.1, label=s.name,
                        linestyle="--" if k in dashed else "-")  # fmt: skip
        if marks and marks[k]:  # where a measurement leaves the prediction
            ax.plot([x[i] for i in marks[k]], [s.live_bytes[i] / scale for i in marks[k]], "x", color="red",
                    markersize=4, label="differs from the prediction")  # fmt: skip
        peak = s.live_bytes.index(max(s.live_bytes))
        ax.plot([x[peak]], [s.live_bytes[peak] / scale], marker="v", color=line.get_color())
        text = f"peak {size(s.live_bytes[peak], units)}" + (f"\n{s.peak_at}" if s.peak_at else "")
        ax.annotate(text, (x[peak], s.live_bytes[peak] / scale), textcoords="offset points", xytext=(5, 2),
                    fontsize=8, color=line.get_color(), va="bottom")  # fmt: skip
    top = max(max(s.live_bytes) for s in all_series) / scale * 1.15  # room for the peaks' names
    if usable is not None and usable / scale <= top:  # above the chart it is not drawn, nor listed in the legend
        ax.axhline(usable / scale, color="black", linestyle="--", linewidth=1, label=f"{gpu} usable")
    ax.set_xlim(0, starts[-1])
    ax.set_ylim(0, top)
    ax.set_xlabel("event in the step (each allocation; the frees between two as one)"
                  + ("" if len(all_series) == 1 else ", phases lined up"))
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save(fig, path)
