"""memcalc's predicted reserved memory beside each published figure of benchmarks/reserved/ (issue 42).

    python benchmarks/reserved/report.py            # each run: published, predicted, ratio; the summary
    python benchmarks/reserved/report.py --write    # and REPORT.md and report.json beside this file

A run is replayed through memcalc's model of PyTorch's caching allocator (memcalc.exact.allocator): one FSDP2
rank of torchtitan's step by memcalc.exact.reserved.fsdp2_reserved (each allocation on the stream FSDP2 makes it
on), one GPU's step by step_reserved. The prediction is the allocator's peak reserved over the first two steps
with no limit on the card (torch.cuda.max_memory_reserved, which leaves out the CUDA context, cuBLAS's
workspaces outside the allocator and NCCL's buffers: memcalc/model/headroom.py counts those), under the
allocator setting the run records; the other setting's prediction stands beside it. Nothing here is fitted:
each run's setup is the source's, and what the replay does not model for it is listed with the run.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.reserved.corpus import HERE, Run, load

GiB = 1 << 30
RECOMPUTE = {"none": "none", "selective-op": "op", "full": "full"}  # the corpus's words as memcalc's Tricks.recompute
COMMAND = "python benchmarks/reserved/report.py --write"


def model_and_tricks(run: Run) -> tuple:
    """memcalc's ModelShape (the run's preset) and Tricks for the run."""
    from memcalc.model.presets import PRESETS
    from memcalc.model.tricks import Tricks

    tricks = Tricks(run.precision, flash=True, recompute=RECOMPUTE[run.recompute], fp8=run.float8, compile=run.compile)
    return PRESETS[run.preset], tricks


def predict(run: Run, expandable: bool):
    """The allocator's record (memcalc.exact.allocator.replay.Reserved) for the run's step."""
    from memcalc.exact.reserved import fsdp2_reserved, step_reserved
    from memcalc.model.stacks import STACKS

    shape, tricks = model_and_tricks(run)
    if run.parallel == "fsdp2":
        return fsdp2_reserved(shape, run.seq, run.micro_batch, tricks, run.gpus, None, expandable=expandable)
    stack = replace(STACKS[run.stack], recipe="pure", impl=run.optimizer.removeprefix("adamw-"))
    return step_reserved(shape, run.seq, run.micro_batch, tricks, 1, stack, "adamw", expandable=expandable)


def one_stream(run: Run) -> int | None:
    """An FSDP2 run's reserve were every allocation made on the default stream, all in one free list: what
    modelling FSDP2's streams changes (None for a run on one GPU)."""
    if run.parallel != "fsdp2":
        return None
    from memcalc.exact.allocator.replay import replay
    from memcalc.exact.replay.fsdp2 import fsdp2_phases
    from memcalc.exact.reserved import allocator_events

    shape, tricks = model_and_tricks(run)
    _, mem = fsdp2_phases(shape, run.seq, run.micro_batch, tricks, run.gpus, None, timeline=True, warm_up=True)
    events, names = allocator_events(mem.timeline, mem.recording)
    return replay([(key, n, 0) for key, n, _ in events], None, run.expandable_segments, names).reserved_bytes


# What the replay does not model, each a behaviour of the libraries that ran (left_out names them per run)
LEGEND = {
    "compile": "torch.compile: Inductor's partitioner saves fewer activations than eager does; the replay keeps eager's",
    "compiled loss": "the loss under torch.compile too: no fp32 copy of the logits, no eager log_softmax output",
    "float8 all-gather": "torchao's enable_fsdp_float8_all_gather: FSDP2 gathers float8 weights, not bf16",
    "units then": "torchtitan's fully_shard calls at the run's commit: the root held the token table, final norm and "
                  "output, and the last block stayed gathered after forward (the replay: apply_fsdp_to_decoder's)",
    "foreach AdamW": "torch.optim.AdamW(foreach=True)'s temporaries (the FSDP2 replay runs fused AdamW)",
    "setting unstated": "the allocator's setting is not stated: PyTorch's default taken, the other beside it",
    "evaluation": "the source's peak spans evaluation's generation, which the training step's replay leaves out",
}  # fmt: skip


def left_out(run: Run) -> list[str]:
    """The LEGEND's keys that apply to the run."""
    return [key for key, applies in (
        ("compile", run.compile), ("compiled loss", run.compiled_loss), ("float8 all-gather", run.float8_all_gather),
        ("units then", run.fsdp_units == "blocks+root"),
        ("foreach AdamW", run.parallel == "fsdp2" and run.optimizer != "adamw-fused"),
        ("setting unstated", not run.expandable_stated), ("evaluation", run.peak_over == "run-with-evaluation"),
    ) if applies]  # fmt: skip


def row(run: Run) -> dict:
    mine = predict(run, run.expandable_segments)
    other = predict(run, not run.expandable_segments)
    return {"run": run.key, "where": run.where, "published_bytes": run.memory_bytes,
            "published": f"{run.memory:.0f} B" if run.memory_unit == "B" else f"{run.memory:g} {run.memory_unit}",
            "predicted_bytes": mine.reserved_bytes, "one_stream_bytes": one_stream(run),
            "ratio": mine.reserved_bytes / run.memory_bytes, "allocated_bytes": mine.allocated_bytes,
            "expandable_segments": run.expandable_segments, "other_setting_bytes": other.reserved_bytes,
            "compile": run.compile, "left_out": left_out(run)}  # fmt: skip


def rows(runs: list[Run]) -> list[dict]:
    return [row(r) for r in runs]


def summary(table: list[dict]) -> dict:
    """The median and worst |predicted / published - 1|, over every run and over the eager runs."""
    out = {}
    for name, part in (("all", table), ("eager", [r for r in table if not r["compile"]])):
        errors = sorted((abs(r["ratio"] - 1), r["run"]) for r in part)
        if errors:
            out[name] = {"n": len(errors), "median": statistics.median(e for e, _ in errors),
                         "worst": errors[-1][0], "worst_run": errors[-1][1]}  # fmt: skip
    return out


def markdown(table: list[dict], stats: dict) -> str:
    lines = ["# Reserved memory: memcalc against published runs", "",
             f"Written by `{COMMAND}` (benchmarks/reserved/report.py); the runs are benchmarks/reserved/*.toml.",
             "Predicted: memcalc's caching-allocator replay, peak reserved over two steps, GiB = 2^30 bytes.", "",
             "Other setting: the prediction under the allocator setting the run did not record. One stream: FSDP2's",
             "allocations all on the default stream, as if the allocator kept one free list.", "",
             "| run | published | predicted GiB | ratio | other setting GiB | one stream GiB | allocated GiB | not modelled |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in table:
        setting = "expandable" if not r["expandable_segments"] else "default"
        single = "" if r["one_stream_bytes"] is None else f"{r['one_stream_bytes'] / GiB:.2f}"
        lines.append(f"| {r['run']} | {r['published']} | {r['predicted_bytes'] / GiB:.2f} | {r['ratio']:.3f} | "
                     f"{r['other_setting_bytes'] / GiB:.2f} ({setting}) | {single} | {r['allocated_bytes'] / GiB:.2f} | "
                     f"{', '.join(r['left_out'])} |")  # fmt: skip
    lines += ["", "Not modelled:", ""] + [f"- {key}: {text}" for key, text in LEGEND.items()]
    lines.append("")
    for name, s in stats.items():
        lines.append(f"- {name} runs: n = {s['n']}, median |predicted / published - 1| = {s['median']:.1%}, "
                     f"worst {s['worst']:.1%} ({s['worst_run']})")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    table = rows(load())
    stats = summary(table)
    text = markdown(table, stats)
    print(text)
    if "--write" in sys.argv:
        (HERE / "REPORT.md").write_text(text)
        (HERE / "report.json").write_text(json.dumps({"command": COMMAND, "rows": table, "summary": stats}, indent=1))


if __name__ == "__main__":
    main()
