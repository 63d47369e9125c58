"""What `memcalc estimate` shows of the roofline: step time per trick set, where it goes, the slowest ops."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import units as u
from .estimate import peak_line
from .render import Section

if TYPE_CHECKING:  # only for annotations
    from memcalc.memory.estimate import Estimate
    from memcalc.time.calibration import Calibration
    from memcalc.time.roofline import Roofline

BOUND = {"compute": "C", "memory": "M", "launch": "L"}
TOP_OPS = 3  # slowest operations shown per trick set


def time_section(est: Estimate, times: tuple[Roofline, ...], cal: Calibration) -> Section:
    g, f = est.gpu, est.flops
    s = Section(
        f"Step time on the {g.key}: every kernel at max(FLOPs / compute roof, bytes / HBM roof), summed",
        ["tricks", "step time", "tokens/s", "MFU", "MFU causal", "HFU", "HFU causal", "checkpointing", "memory-bound"],
    )
    for t in times:
        extra = f"+{u.seconds(t.recompute_seconds)}" if t.recompute_seconds else "-"
        s.rows.append([t.tricks.label, u.seconds(t.step_seconds), u.rate(t.tokens_per_second), u.percent(t.mfu),
                       u.percent(t.mfu_causal), u.percent(t.hfu), u.percent(t.hfu_causal), extra,
                       u.percent(t.memory_bound_seconds / t.step_seconds)])  # fmt: skip
    s.notes = [
        f"roofs: matmuls {u.percent(cal.matmul, 0)} of the dtype's dense peak, the flash kernel "
        f"{u.percent(cal.flash, 0)}, HBM {u.percent(cal.bandwidth)} of {g.bandwidth_gbps:,.0f} GB/s, at least "
        f"{cal.launch_us:g} µs a kernel ({cal_origin(cal)}; --calibration NAME=X to change, --explain for sources)",
        "MFU: model FLOPs 6·W + 12·L·a·d·s per token (non-causal, PaLM App. B) / time / peak; MFU causal halves the "
        "attention (Megatron); HFU: what the kernels run as FlopCounterMode counts it (recompute and flash's "
        "backward QKᵀ included), non-causal and causal",
        f"6N = {f.per_token:,} FLOPs per token (6 per parameter: 2 forward + 4 backward); "
        f"full recompute 8N = {f.per_token_full_recompute:,} ({u.signed_percent(f.recompute_overhead)})",
        peak_line(g),
        "the step verify builds: the shape's own parameters, eager PyTorch, AdamW per tensor; "
        "--mfu X for the old model (hardware FLOPs / (X · peak))",
    ]
    return s


def time_warnings(times: tuple[Roofline, ...]) -> list[str]:
    """An MFU or HFU above 100% is said, with why (printed on stderr in every format)."""
    from .mfu import above_100

    return [w for t in times if (w := above_100(t.tricks.label, t.mfu, t.hfu, t.mfu_causal))]


def cal_origin(cal: Calibration) -> str:
    if cal.origin == "memcalc defaults":
        return "memcalc defaults, not measured on this GPU"
    return "calibration " + cal.origin.rsplit("/", 1)[-1]


def parts_section(times: tuple[Roofline, ...]) -> Section:
    """Seconds per part of the step, one column per trick set, with its share and what bounds it."""
    parts = [t.parts for t in times]
    s = Section("Where the step time goes (share of the step; C compute-, M memory-, L launch-bound)",
                ["part"] + [t.tricks.label for t in times])  # fmt: skip
    for part in dict.fromkeys(p for ps in parts for p in ps):
        row = [part]
        for t, ps in zip(times, parts):
            secs, bound = ps.get(part, (None, ""))
            step = t.step_seconds
            row.append("-" if secs is None else f"{u.seconds(secs)} {u.percent(secs / step, 0)} {BOUND[bound]}")
        s.rows.append(row)
    s.rows.append(["step"] + [u.seconds(t.step_seconds) for t in times])
    return s


def ops_section(times: tuple[Roofline, ...]) -> Section:
    s = Section(f"The {TOP_OPS} slowest operations of each step (summed over layers)",
                ["tricks", "operation", "part", "time", "share", "bound", "FLOPs/byte"], align="lllrrlr")  # fmt: skip
    for t in times:
        for op in t.ops[:TOP_OPS]:
            share = u.percent(op.seconds / t.step_seconds)
            s.rows.append([t.tricks.label, op.name, op.part, u.seconds(op.seconds), share, op.bound,
                           f"{op.intensity:,.1f}"])  # fmt: skip
    return s


def roofline_sections(est: Estimate, times: tuple[Roofline, ...], cal: Calibration) -> list[Section]:
    sections = [time_section(est, times, cal), parts_section(times), ops_section(times)]
    return sections + ([experts_section(est, times, cal)] if est.model.shape.is_moe else [])


def experts_section(est: Estimate, times: tuple[Roofline, ...], cal: Calibration) -> Section:
    """A MoE layer's forward GEMMs against the roofline: each expert's few tokens make it memory-bound."""
    from memcalc.time.experts import compute_bound_tokens, expert_gemms, gemm_time

    shape, s = est.model.shape, est.setup
    precision = next((t.tricks.precision for t in times if t.tricks.precision != "fp32"), times[0].tricks.precision)
    tokens = s.seq_len * s.micro_batch
    sec = Section(f"A MoE layer's GEMMs on the {est.gpu.key} ({precision}, forward, {tokens:,} tokens, "
                  f"{shape.experts_per_token} of {shape.n_experts} experts each)",
                  ["GEMM", "m x k x n", "FLOPs/byte", "bound", "one", "all, one by one", "all, grouped"],
                  align="lrrlrrr")  # fmt: skip
    for g in expert_gemms(shape, tokens, precision, s.routing):
        t = gemm_time(g, precision, est.gpu, cal)
        sec.rows.append([g.name, f"{g.m:,} x {g.k:,} x {g.n:,}", f"{g.intensity:,.0f}", t.bound,
                         f"{t.seconds * 1e6:,.1f} µs", u.seconds(g.count * t.seconds), u.seconds(t.grouped_seconds)])  # fmt: skip
    ridge = gemm_time(expert_gemms(shape, tokens, precision)[0], precision, est.gpu, cal).ridge
    crossover = compute_bound_tokens(shape, precision, est.gpu, cal)
    sec.notes = [
        f"ridge: {ridge:,.0f} FLOPs/byte (matmul roof / HBM roof); an expert's GEMM reaches it at "
        f"{crossover:,} tokens per expert (here {expert_gemms(shape, tokens, precision, s.routing)[0].m:,}): below, "
        "it waits on its weights",
        f"one by one: each at least {cal.launch_us:g} µs a launch, as the replayed reference runs them; grouped: one "
        "kernel for all experts (torch._grouped_mm, Megatron's GroupedMLP), the same bytes",
    ] + (["the router's GEMM is fp32 (DeepSeek-V3's gate): against the fp32 roof"] if shape.router_fp32 else [])
    return sec


def explain_lines(times: tuple[Roofline, ...], cal: Calibration) -> list[str]:
    lines = ["", f"Step time, roofline ({cal_origin(cal)}):"]
    for name, source in cal.provenance:
        lines.append(f"  {name} = {getattr(cal, name):g}: {source}")
    for t in times:
        lines.append(f"  {t.tricks.label}: {t.kernels:,} kernels; Σ max(FLOPs/rate, bytes/bandwidth, floor) = "
                     f"{u.seconds(t.compute_bound_seconds)} compute-bound + {u.seconds(t.memory_bound_seconds)} "
                     f"memory-bound + {u.seconds(t.step_seconds - t.compute_bound_seconds - t.memory_bound_seconds)} "
                     f"at the floor = {u.seconds(t.step_seconds)}")  # fmt: skip
    return lines


CSV_HEADERS = ["mfu_causal", "hfu_causal", "recompute_seconds", "memory_bound_seconds"]


def csv_columns(t: Roofline | None) -> list[object]:
    if t is None:
        return [""] * len(CSV_HEADERS)
    return [f"{t.mfu_causal:.4f}", f"{t.hfu_causal:.4f}", f"{t.recompute_seconds:.6g}", f"{t.memory_bound_seconds:.6g}"]
