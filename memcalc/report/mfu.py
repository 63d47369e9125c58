"""What `memcalc mfu` shows: a measured throughput as MFU and HFU under each FLOPs-per-token convention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import units as u
from .render import Section

if TYPE_CHECKING:  # only for annotations
    from memcalc.time.mfu import MfuReport


def mfu_preamble(r: MfuReport) -> list[str]:
    return [
        f"Model: {r.model.origin}; {r.model.n_params:,} parameters",
        f"Measured: {r.tokens_per_second:,.1f} tokens/s per GPU at seq {r.seq_len:,}, against the {r.gpu}'s "
        f"dense {r.precision} peak; recompute: {r.recompute}",
    ]


def above_100(label: str, mfu: float, hfu: float, mfu_causal: float) -> str | None:
    """Why an MFU or HFU above 100% is printed, or None: a convention that counts attention non-causal."""
    if max(mfu, hfu) <= 1:
        return None
    return (f"{label}: MFU {u.percent(mfu)}, HFU {u.percent(hfu)}: above 100% because these count every query "
            f"against every key, where a causal kernel does half that work (MFU causal {u.percent(mfu_causal)})")  # fmt: skip


def mfu_warnings(r: MfuReport) -> list[str]:
    over = [c for c in r.conventions if max(c.mfu, c.hfu) > 1]
    if not over:
        return []
    names = ", ".join(f"{c.convention} {u.percent(max(c.mfu, c.hfu))}" for c in over)
    return [f"above 100% of peak under {names}: those conventions count attention non-causal, twice what a causal "
            "kernel executes (the causal convention is the physical one)"]  # fmt: skip


def mfu_sections(r: MfuReport) -> list[Section]:
    s = Section("MFU and HFU under each FLOPs-per-token convention",
                ["convention", "formula", "FLOPs/token", "TFLOP/s per GPU", "MFU", "HFU"], align="llrrrr")  # fmt: skip
    for c in r.conventions:
        s.rows.append([c.name, c.formula, f"{c.model_flops_per_token:,.0f}", f"{c.achieved_tflops:.1f}",
                       u.percent(c.mfu), u.percent(c.hfu)])  # fmt: skip
    s.notes = [
        "non-causal conventions count every query against every key; a causal kernel does half that work, "
        "so flash with a causal mask can show an MFU above what the GPU ran",
        "HFU adds what recompute runs again; torchtitan leaves recompute out of its MFU altogether",
    ]
    return [s]


MFU_CSV_HEADERS = ["convention", "formula", "model_flops_per_token", "hardware_flops_per_token", "tflops", "mfu", "hfu"]


def mfu_csv_rows(r: MfuReport) -> list[list[object]]:
    return [[c.convention, c.formula, f"{c.model_flops_per_token:.0f}", f"{c.hardware_flops_per_token:.0f}",
             f"{c.achieved_tflops:.4g}", f"{c.mfu:.4f}", f"{c.hfu:.4f}"] for c in r.conventions]  # fmt: skip
