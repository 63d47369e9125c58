"""memcalc's step time against published training runs: every run of benchmarks/published/ as published.

    python benchmarks/published/report.py     # per run predicted/published tokens/s per GPU, then the summary
    python benchmarks/published/report.py --summary  # the summary alone
    python benchmarks/published/report.py --json  # the same as JSON

Each run becomes a memcalc job: its shape, GPU, layout, micro and global batch, sequence, recompute and
precision as the source gives them; the figure it published becomes tokens per second per GPU under the
source's own FLOPs convention (published_rate). memcalc's roofline (memcalc.parallel.plan.layout_estimate)
predicts the same rate; the error is predicted / published - 1. A run memcalc cannot express yet (blockwise
FP8, a GPU not in its table, a setup the source leaves out) is listed with the reason and
counted apart, never guessed.

The corpus is split by source before anything is fitted (FIT, HELD_OUT): the calibration may learn only
from the first; both are reported, the held-out part as the estimate of the error on a run nobody tuned for.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # corpus.py beside this file; memcalc from the checkout

from corpus import Run, load  # noqa: E402
from sources import CONVENTION, FIT, FP8, GENERATION, RECOMPUTE, SOURCE_DEFAULTS, STACK  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.memory.setup import Setup  # noqa: E402
from memcalc.model.gpus import GPUS  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.presets import gpt, llama  # noqa: E402
from memcalc.model.shape import Model, ModelShape  # noqa: E402
from memcalc.model.stacks import STACKS  # noqa: E402
from memcalc.model.tricks import Tricks  # noqa: E402
from memcalc.model.layout import Layout  # noqa: E402
from memcalc.parallel.links import ASSUMPTIONS, Assumptions  # noqa: E402
from memcalc.parallel.plan import layout_estimate  # noqa: E402
from memcalc.time.calibration import Calibration  # noqa: E402

MICRO_BATCHES = (1, 2, 4, 8, 16)  # tried, fastest that fits kept, where the source does not give b


class Inexpressible(Exception):
    """A run memcalc cannot yet state as a job; the message says what is missing."""


@dataclass(frozen=True)
class Row:
    run: Run
    part: str  # "fit" or "held-out"
    published: float | None  # tokens/s per GPU, as the source's figure gives it
    how: str  # how that rate follows from the published figure
    predicted: float | None  # memcalc's tokens/s per GPU
    job: str  # the layout and batch memcalc ran
    skipped: str = ""  # why the run is not compared
    peak_bytes: int | None = None  # memcalc's peak per GPU for that job (the verdict's: the highest stage's)

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.published if self.predicted and self.published else None

    @property
    def published_memory_bytes(self) -> int | None:
        """The memory the source published, in bytes (torchtitan's is the caching allocator's peak reserved:
        torchtitan/components/metrics.py logs max_reserved_gib from reserved_bytes.all.peak)."""
        run = self.run
        if run.memory_gb is None:
            return None
        return round(run.memory_gb * (2**30 if run.memory_unit == "GiB" else 10**9))

    @property
    def memory_ratio(self) -> float | None:
        """Published memory / memcalc's peak: the allocator's reserve over what is allocated, and the model's miss."""
        published = self.published_memory_bytes
        return published / self.peak_bytes if published and self.peak_bytes else None


# --- the published figure as tokens per second per GPU -------------------------------------------------


def published_rate(run: Run) -> tuple[float, str]:
    """Tokens/s per GPU from the run's figure: read, or step time and batch, or TFLOP/s under its convention."""
    if run.tokens_per_s_per_gpu:
        return run.tokens_per_s_per_gpu, "tokens/s per GPU" + (" (derived)" if run.derived else "")
    if run.tokens_per_s:
        return run.tokens_per_s / run.gpus, "tokens/s / GPUs"
    if run.step_s and run.global_batch and run.seq:
        return run.global_batch * run.seq / (run.step_s * run.gpus), "global batch · seq / step time / GPUs"
    count = CONVENTION.get(run.source.id)
    if count is None:
        raise Inexpressible(f"{run.source.id} states no FLOPs convention to turn its TFLOP/s into tokens/s")
    if run.tflops_per_gpu:
        return run.tflops_per_gpu * 1e12 / count(run), f"TFLOP/s / {count.__name__}"
    peak = GPUS[run.gpu].bf16_tflops * 1e12
    return run.mfu * peak / count(run), f"MFU · peak / {count.__name__}"


# --- the run as a memcalc job --------------------------------------------------------------------------


def shape_of(run: Run) -> ModelShape:
    """The shape as published: a Llama layer where the MLP is gated, else Megatron's GPT (learned positions,
    biases, dropout 0.1; llm-foundry's MPT benchmark shapes the same without dropout)."""
    if run.layers is None or run.hidden is None or run.heads is None:
        raise Inexpressible("the source gives no model shape")
    if run.gated_mlp:
        vocab = run.vocab or 128256  # Llama 3's tokenizer: every gated run here is a Llama 3
        return llama(run.model, run.layers, run.hidden, run.heads, run.kv_heads or run.heads, run.ffn, vocab, False)
    if run.vocab is None:
        raise Inexpressible("the source gives no vocabulary")
    base = gpt(run.model, run.layers, run.hidden, run.heads, run.seq)
    if run.stack == "llm-foundry":  # its benchmark yamls: GPT's layer (the NumParams column counts the position
        return replace(base, vocab=run.vocab, ffn=run.ffn, dropout=0.0)  # table and the biases), no dropout
    return replace(base, vocab=run.vocab, ffn=run.ffn or 4 * run.hidden)


def tricks_of(run: Run) -> Tricks:
    if run.precision.startswith("fp8") and run.precision not in FP8:
        raise Inexpressible(f"{run.precision}: only torchao's float8 recipes and Transformer Engine's delayed scaling "
                            "are modelled (blockwise scaling is not)")  # fmt: skip
    recompute = run.recompute or defaults(run).get("recompute")
    if recompute == "selective":
        recompute = defaults(run).get("selective", "selective")
    if recompute not in RECOMPUTE:
        raise Inexpressible(f"recompute {recompute} with its interval (every how many blocks) not published")
    flash = run.flash if run.flash is not None else defaults(run).get("flash", False)
    precision = run.precision if run.precision in ("fp16", "bf16") else defaults(run).get("precision")
    precision = precision or ("fp16" if run.gpu.startswith("v100") else "bf16")  # 16-bit mixed: one peak either way
    return Tricks(precision, flash=flash, recompute=RECOMPUTE[recompute], fp8=FP8.get(run.precision, ""),
                  compile=bool(run.compile))  # fmt: skip


def defaults(run: Run) -> dict:
    return SOURCE_DEFAULTS.get(run.source.id, {})


def assumptions(run: Run) -> Assumptions:
    """memcalc's time assumptions, with the source's stack's own where it names them (a run on another stack
    than its source's, such as Narayanan's DeepSpeed ZeRO-3 rows, keeps memcalc's)."""
    own = defaults(run).get("assume", {}) if run.stack == run.source.stack else {}
    if run.async_tp:  # torchtitan's async TP runs each TP all-gather and reduce-scatter in pieces under the
        own = {**own, "overlap_tp": 1.0}  # matmul of the piece before (torch/distributed/_symmetric_memory)
    return replace(ASSUMPTIONS, **own)


def stack_of(run: Run) -> str:
    if "stack" in defaults(run):
        return defaults(run)["stack"]
    if run.stack not in STACK:
        raise Inexpressible(f"no memcalc engine stands in for {run.source.id}'s own stack")
    return "deepspeed" if run.stack == "llm-foundry" and run.zero == 2 else STACK[run.stack]


def degrees(run: Run) -> tuple[int, int]:
    """tp and pp as published; from the model-parallel size alone, TP over one node and PP the rest
    (Megatron's practice, Narayanan et al. 2021 sec. 3.3: TP inside a node)."""
    if run.tp is not None or run.pp is not None:
        return run.tp or 1, run.pp or 1
    if run.model_parallel:
        tp = max(t for t in (1, 2, 4, 8) if run.model_parallel % t == 0 and run.heads % t == 0)
        return tp, run.model_parallel // tp
    if run.dp is None:
        raise Inexpressible("the source gives no layout")
    return 1, 1


def layout_of(run: Run, micro_batch: int, vpp: int) -> tuple[Layout, int]:
    """The layout and the micro-batches per step, m = global batch / (dp · b)."""
    (tp, pp), cp = degrees(run), run.cp or 1
    if run.ep and run.ep > 1:
        raise Inexpressible("the corpus records no expert shapes (experts, their width, top-k) to build the MoE")
    dp = run.dp or run.gpus // (tp * pp * cp)
    if tp * pp * cp * dp != run.gpus:
        raise Inexpressible(f"tp·pp·cp = {tp * pp * cp} does not divide {run.gpus} GPUs")
    global_batch = run.global_batch or micro_batch * dp
    if global_batch % (micro_batch * dp):
        raise InputError(f"b {micro_batch} · dp {dp} does not divide the global batch {global_batch}")
    sp = run.sequence_parallel if run.sequence_parallel is not None else defaults(run).get("sequence_parallel", False)
    zero = run.zero if run.zero is not None else defaults(run).get("zero", 3 if stack_of(run) == "fsdp2" else 0)
    layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp, zero=zero if dp * cp > 1 else 0, sp=sp and tp > 1, vpp=vpp,
                    gpus_per_node=run.gpus_per_node or 8)  # fmt: skip
    return layout, global_batch // (micro_batch * dp)


def choices(run: Run) -> list[tuple[int, int]]:
    """(b, v) to try: as published, else every micro-batch and, for an interleaved run, every v up to 8."""
    batches = (run.micro_batch,) if run.micro_batch else MICRO_BATCHES
    interleaved = defaults(run).get("interleaved") and not run.vpp and (run.pp or 1) > 1
    vpps = list(range(1, 9)) if interleaved else [run.vpp or 1]  # a v the engine cannot split is refused
    return [(b, v) for b in batches for v in vpps]


def predict(run: Run, timing: Calibration | None = None) -> tuple[float, str, int]:
    """memcalc's tokens/s per GPU for the run, its job, and its peak bytes per GPU; the micro-batch the source
    does not give is the fastest that fits."""
    if run.gpu not in GPUS:
        raise Inexpressible(f"GPU {run.gpu} is not in memcalc's table")
    seq = run.seq or defaults(run).get("seq")
    if seq is None:
        raise Inexpressible("the source gives no sequence length")
    assume = assumptions(run)
    stack = STACKS[stack_of(run)]
    shape, tricks = shape_of(run), tricks_of(run)
    model = Model(shape, n_params(shape), f"published {run.key}")
    best = None
    for b, v in choices(run):
        try:
            layout, m = layout_of(run, b, v)
            setup = Setup(seq_len=seq, micro_batch=b, grad_accum=m, stack=stack)
            est = layout_estimate(model, setup, GPUS[run.gpu], tricks, layout, assume, timing=timing)
        except InputError as e:
            if len(choices(run)) == 1:
                raise Inexpressible(f"memcalc refuses the job: {e}") from None
            continue
        key = (est.verdict.fits, est.time.tokens_per_second)
        if best is None or key > best[0]:
            best = key, est
    if best is None:
        raise Inexpressible("no micro-batch gives a valid job")
    est = best[1]
    job = job_text(est, stack.key, guessed=not run.micro_batch)
    return est.time.tokens_per_second / est.layout.world, job, est.verdict.peak_bytes


def job_text(est, stack: str = "", guessed: bool = False) -> str:
    """'tp8 pp2 v8 cp1 dp32 z0 megatron sp b8* m6 bf16+ckpt': a layout estimate's layout, micro-batch (starred
    where the source did not publish it), micro-batches and tricks."""
    lay = est.layout
    return (f"tp{lay.tp} pp{lay.pp}{f' v{lay.vpp}' if lay.vpp > 1 else ''} cp{lay.cp} dp{lay.dp} z{lay.zero}"
            f"{' ' + stack if stack else ''}{' sp' if lay.sp else ''} b{est.setup.micro_batch}{'*' if guessed else ''} "
            f"m{est.setup.grad_accum} {est.tricks.label}")  # fmt: skip


def rows(calibrations: dict[str, Calibration] | None = None, runs: list[Run] | None = None) -> list[Row]:
    """Every run (or those given) against memcalc, each GPU at its calibration (default: the shipped one)."""
    out = []
    for run in load() if runs is None else runs:
        part = "fit" if run.source.id in FIT else "held-out"
        try:
            published, how = published_rate(run)
            predicted, job, peak = predict(run, (calibrations or {}).get(run.gpu))
            out.append(Row(run, part, published, how, predicted, job, peak_bytes=peak))
        except Inexpressible as e:
            out.append(Row(run, part, None, "", None, "", str(e)))
    return out


# --- the summary ---------------------------------------------------------------------------------------


def summary(group: list[Row]) -> dict:
    errors = [abs(r.ratio - 1) for r in group if r.ratio is not None]
    return {"runs": len(group), "compared": len(errors),
            "median_abs_error": statistics.median(errors) if errors else None,
            "worst_abs_error": max(errors) if errors else None}  # fmt: skip


def summaries(all_rows: list[Row]) -> dict[str, dict]:
    groups: dict[str, list[Row]] = {}
    for r in all_rows:
        for key in (f"part {r.part}", f"source {r.run.source.id}", f"gpu {GENERATION.get(r.run.gpu, r.run.gpu)}"):
            groups.setdefault(key, []).append(r)
    return {k: summary(v) for k, v in sorted(groups.items())}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def not_compared(all_rows: list[Row]) -> dict[str, int]:
    """Why runs are left out, by reason (its text before the first colon), most common first."""
    reasons: dict[str, int] = {}
    for r in all_rows:
        if r.ratio is None:
            reason = r.skipped.split(":")[0]
            reasons[reason] = reasons.get(reason, 0) + 1
    return dict(sorted(reasons.items(), key=lambda kv: -kv[1]))


def memory_rows(all_rows: list[Row]) -> list[Row]:
    """The compared runs whose source published their memory."""
    return [r for r in all_rows if r.memory_ratio is not None]


def print_memory(all_rows: list[Row]) -> None:
    """Published memory against memcalc's peak, run by run, and the median ratio."""
    shown = memory_rows(all_rows)
    if not shown:
        return
    print(f"\n{'memory: run':58} {'published':>10} {'memcalc':>10} {'ratio':>6}")
    for r in shown:
        print(f"{r.run.key:58} {r.published_memory_bytes / 2**30:7.2f} GiB {r.peak_bytes / 2**30:6.2f} GiB "
              f"{r.memory_ratio:6.2f}")  # fmt: skip
    ratios = [r.memory_ratio for r in shown]
    print(f"published / memcalc's peak over {len(ratios)} runs: median {statistics.median(ratios):.2f}, "
          f"{min(ratios):.2f} to {max(ratios):.2f}")  # fmt: skip


def print_summary(table: dict[str, dict], reasons: dict[str, int]) -> None:
    print(f"{'group':38} {'runs':>4} {'compared':>8} {'median |err|':>12} {'worst |err|':>11}")
    for key, s in table.items():
        print(f"{key:38} {s['runs']:4} {s['compared']:8} {pct(s['median_abs_error']):>12} {pct(s['worst_abs_error']):>11}")
    print("not compared:")
    for reason, n in reasons.items():
        print(f"  {n:3}  {reason}")


def main(argv: list[str]) -> None:
    all_rows = rows()
    table = summaries(all_rows)
    if "--json" in argv:
        runs = [{"run": r.run.key, "part": r.part, "published_tokens_per_s_per_gpu": r.published, "how": r.how,
                 "predicted_tokens_per_s_per_gpu": r.predicted, "ratio": r.ratio, "job": r.job, "skipped": r.skipped,
                 "published_memory_bytes": r.published_memory_bytes, "peak_bytes": r.peak_bytes,
                 "memory_ratio": r.memory_ratio}
                for r in all_rows]  # fmt: skip
        print(json.dumps({"runs": runs, "summary": table, "not_compared": not_compared(all_rows)}, indent=1))
        return
    if "--summary" not in argv:
        print(f"{'run':58} {'part':8} {'published':>10} {'memcalc':>10} {'ratio':>6}  job / why not compared")
        for r in all_rows:
            if r.ratio is None:
                print(f"{r.run.key:58} {r.part:8} {'':>10} {'':>10} {'':>6}  not compared: {r.skipped}")
            else:
                print(f"{r.run.key:58} {r.part:8} {r.published:10,.0f} {r.predicted:10,.0f} {r.ratio:6.2f}  {r.job}")
        print("\n(b* : micro-batch not published, the fastest that fits; rates are tokens/s per GPU)")
        print_memory(all_rows)
        print()
    print_summary(table, not_compared(all_rows))


if __name__ == "__main__":
    main(sys.argv[1:])
