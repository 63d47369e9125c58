"""memcalc's fine-tuning peak beside each published measurement of benchmarks/finetune/ (issue 40).

    python benchmarks/finetune/report.py            # each run: its command, published, predicted, ratio; the summary
    python benchmarks/finetune/report.py --summary  # the summary alone

A run is predicted where memcalc replays its recipe: `command()` writes the `memcalc estimate` that describes it
(the preset of its Hub id, the trick set from its precision, attention and checkpointing, the stack from its
trainer and optimizer, LoRA or QLoRA as set) and the verdict's peak is compared with the published figure. A run
it cannot describe says why (`command()` returns the reason): those are what memcalc does not replay yet. The
prediction is of the figure's kind: torch.cuda.max_memory_reserved() of one GPU's step (peak_reserved) beside the
caching allocator's reserve replayed over the step (memcalc.exact.reserved), any other beside the peak of allocated
bytes; a figure that holds more (nvidia-smi's) is kept apart by the summary, which groups the kinds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.finetune.corpus import Run, load  # noqa: E402

# the corpus's Hub ids as memcalc's presets (memcalc/model/presets.py; the counts are tests/test_models.py's)
PRESET = {
    "meta-llama/Llama-2-7b-hf": "llama2-7b", "meta-llama/Llama-2-13b-hf": "llama2-13b",
    "meta-llama/Llama-2-70b-hf": "llama2-70b", "meta-llama/Llama-3.2-3B": "llama3.2-3b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama3.2-3b", "meta-llama/Meta-Llama-3.1-8B-Instruct": "llama3.1-8b",
    "meta-llama/Meta-Llama-3.1-70B-Instruct": "llama3.1-70b", "meta-llama/Meta-Llama-3.1-405B-Instruct": "llama3.1-405b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b", "Qwen/Qwen3-1.7B": "qwen3-1.7b", "Qwen/Qwen3-4B": "qwen3-4b",
    "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3-14B": "qwen3-14b",
}  # fmt: skip
# the optimizers as memcalc names them: (--optimizer, --optimizer-impl); torch.optim.AdamW is foreach on CUDA
OPTIMIZERS = {
    "torch.optim.AdamW": ("adamw", "foreach"), "adamw_torch": ("adamw", "foreach"), "adamw_hf": ("adamw", "foreach"),
    "torch.optim.AdamW (fused)": ("adamw", "fused"), "bnb Adam8bit": ("adam8bit", "loop"),
}  # fmt: skip


def command(run: Run) -> list[str] | str:
    """The `memcalc estimate` arguments that describe the run, or why memcalc cannot describe it yet."""
    from memcalc.model.gpus import GPUS

    if run.trainer and run.trainer.startswith("torchtune"):
        return torchtune_command(run)
    if run.method == "other-peft":
        return f"{run.peft_type}: memcalc replays LoRA and QLoRA, not other PEFT methods"
    if run.parallel in ("fsdp", "deepspeed") and run.method == "full":
        return f"FSDP1 and DeepSpeed's full fine-tuning sharded over GPUs ({run.parallel}) are not replayed yet"
    if run.parallel == "fsdp":  # memcalc replays LoRA under FSDP2 (fully_shard) and ZeRO; these ran FSDP1
        return "FSDP1 (FullyShardedDataParallel's FlatParameter units) is not replayed; LoRA under FSDP2 and ZeRO is"
    if run.cpu_offload:
        return "LoRA with the parameters or optimizer offloaded to the CPU is not replayed"
    if run.hf_id not in PRESET:
        return f"no memcalc preset for {run.hf_id}" + (" (an encoder: memcalc models decoders)" if "bert" in
                                                        (run.hf_id or "") else "")  # fmt: skip
    if run.gpu not in GPUS:
        return f"GPU {run.gpu!r} is not in memcalc's table"
    if run.optimizer not in OPTIMIZERS:
        return f"optimizer {run.optimizer!r} is not replayed"
    optimizer, impl = OPTIMIZERS[run.optimizer]
    precision = run.amp or run.dtype
    tricks = [precision] + (["flash"] if run.attention in ("sdpa", "flash2") and precision != "fp32" else [])
    tricks += ["ckpt"] if run.grad_checkpointing else []
    args = ["estimate", "--model", PRESET[run.hf_id], "--seq", str(run.seq), "--micro-batch", str(run.micro_batch or 1),
            "--grad-accum", str(run.grad_accum or 1), "--tricks", ",".join(tricks), "--gpu", run.gpu,
            "--stack", "hf", "--optimizer", optimizer, "--optimizer-impl", impl]  # fmt: skip
    args += ["--recipe", "autocast" if run.amp else "pure"]  # weights in their dtype unless autocast mixes them
    args += ["--reentrant"] if run.reentrant else []  # gradient_checkpointing_kwargs use_reentrant True
    if run.method in ("lora", "qlora"):
        args += ["--lora", str(run.lora_rank), "--lora-dropout", str(run.lora_dropout or 0)]
        if run.lora_targets:
            args += ["--lora-targets", ",".join(run.lora_targets)]
        args += ["--dora"] if run.dora else []
    if run.method == "qlora":
        args += ["--quantize", run.quant or "nf4"]
    if run.parallel == "deepspeed":  # ZeRO over the data-parallel GPUs (memcalc.exact.replay.zero, the base frozen)
        args += ["--gpus", str(run.gpus), "--zero", str(run.zero)]
    return args


TORCHTUNE_OPTIMIZERS = {"torch.optim.AdamW": ("adamw", "foreach"), "torch.optim.AdamW (fused)": ("adamw", "fused"),
                        "bnb PagedAdamW8bit": ("paged-adam8bit", "loop"), "bnb PagedAdamW": ("paged-adamw", "loop")}


def torchtune_command(run: Run) -> list[str] | str:
    """A torchtune single-device recipe as `--stack torchtune` replays it (its model, chunked loss, optimizer in
    backward, NF4 base, bf16 adapters), or why not."""
    if run.gpus != 1:
        return "torchtune's distributed recipes (FSDP over its model) are not replayed; its single-device ones are"
    if run.compile:
        return "torch.compile's memory (its compiled loss and layers save less than eager) is not replayed"
    if not run.packing:
        return "an unpacked dataset: each batch is as long as its longest sample, which the run does not give"
    if run.optimizer not in TORCHTUNE_OPTIMIZERS or run.hf_id not in PRESET or run.gpu not in _gpus():
        return f"torchtune run not expressible: optimizer {run.optimizer!r}, model {run.hf_id}, GPU {run.gpu!r}"
    optimizer, impl = TORCHTUNE_OPTIMIZERS[run.optimizer]
    tricks = "bf16,flash" + (",ckpt" if run.grad_checkpointing else "")
    args = ["estimate", "--model", PRESET[run.hf_id], "--seq", str(run.seq), "--micro-batch", str(run.micro_batch or 1),
            "--grad-accum", str(run.grad_accum or 1), "--tricks", tricks, "--gpu", run.gpu, "--stack", "torchtune",
            "--optimizer", optimizer, "--optimizer-impl", impl]  # fmt: skip
    args += ["--loss", "chunked" if run.chunked_ce else "full"]
    args += ["--optimizer-in-backward"] if run.optimizer_in_bwd else []
    if run.method in ("lora", "qlora"):
        args += ["--lora", str(run.lora_rank), "--lora-dropout", str(run.lora_dropout or 0)]
        args += ["--lora-targets", ",".join(run.lora_targets)] if run.lora_targets else []
    return args + (["--quantize", "nf4"] if run.method == "qlora" else [])


def _gpus():
    from memcalc.model.gpus import GPUS

    return GPUS


def predicted(args: list[str], kind: str = "peak_allocated", allocated=None) -> int | tuple[int, int] | str:
    """The verdict's figure of the run's kind, or memcalc's refusal. peak_allocated and peak_active: the peak of
    allocated bytes (allocated(answer): the step's, the verdict's peak, unless the corpus reads it over more than the
    step: benchmarks/rl/report.py). peak_reserved: torch.cuda.max_memory_reserved() of one GPU's step, the caching
    allocator's reserve over it (reserved). nvidia_smi: the device's used memory, that reserve plus what lives outside
    the allocator (the CUDA context, cuBLAS's workspaces, NCCL's buffers: the verdict's headroom). unknown: the
    figure is one of those, which the source does not say: (the allocated peak, the device's used memory)."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, [*args, "--format", "json"])
    if r.exit_code != 0:
        return (r.stderr if hasattr(r, "stderr") and r.stderr else r.output).strip().removeprefix("error: ")
    answer = json.loads(r.stdout)
    verdict = answer["verdict"][0]
    peak = verdict["peak_bytes"] if allocated is None else allocated(answer)
    if kind in ("peak_allocated", "peak_active"):
        return peak
    reserve = (verdict["total_bytes"] if verdict["reserved"] or "--gpus" in args else
               max(reserved(args), verdict["peak_bytes"]))  # the step's reserve, or the model's load where it peaks
    if kind == "peak_reserved":
        return reserve
    headroom = answer["headroom"]
    used = reserve + headroom["context_bytes"] + headroom["cublas_bytes"] + headroom["nccl_bytes"]
    return used if kind == "nvidia_smi" else (peak, max(peak, used))


def error(row: dict) -> float:
    """|predicted / published - 1|; for a figure of unknown kind, 0 between the allocated peak and the device's
    used memory, else the distance to the nearer end."""
    low, high = row["band"] if "band" in row else (row["predicted"], row["predicted"])
    nearest = min(max(row["published"], low), high)
    return abs(nearest / row["published"] - 1)


def reserved(args: list[str]) -> int:
    """memcalc.exact.reserved.step_reserved for the command's step: PyTorch's caching allocator replayed over its
    first two steps on a card with no limit (the verdict replays it only near the card's room), as
    benchmarks/reserved/report.py predicts torch.cuda.max_memory_reserved(). Its options read as the command's
    are (memcalc.cli.groups)."""
    from memcalc.cli.groups import GpuOptions, ModelOptions, StackOptions, StepOptions
    from memcalc.exact.reserved import step_reserved
    from memcalc.model.tricks import parse_tricks

    options: dict = {}
    for flag, value in zip(args[1:], args[2:] + [""]):
        if flag.startswith("--"):
            options[flag.removeprefix("--").replace("-", "_")] = True if value.startswith("--") or not value else value
    gpu = GpuOptions.of(options).resolve()
    model = ModelOptions.of(options).resolve()
    setup = StepOptions.of(options).resolve(model, StackOptions.of(options).resolve(gpu))
    tricks = parse_tricks(options["tricks"])
    return step_reserved(model.shape, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack,
                         setup.optimizer, expandable=gpu.expandable_segments).reserved_bytes  # fmt: skip


def rows(runs: list, describe=None, predict=None) -> list[dict]:
    """Each run: its figure beside memcalc's of the same kind (a band for an unknown kind), or why not. describe:
    the corpus's command() and predict its predicted() (this corpus's by default; benchmarks/rl/report.py passes its
    own)."""
    out = []
    for run in runs:
        args = (describe or command)(run)
        row = {"run": f"{run.source.id}/{run.id}", "split": run.split, "kind": run.memory_kind,
               "published": run.memory_bytes}  # fmt: skip
        if isinstance(args, str):
            row["reason"] = args
        else:
            got = (predict or predicted)(args, run.memory_kind)
            row["command"] = "memcalc " + " ".join(args)
            if isinstance(got, str):
                row["reason"] = f"memcalc refuses: {got}"
            else:  # a figure of unknown kind: the band, its middle as the prediction
                row |= {"band": got, "predicted": sum(got) // 2} if isinstance(got, tuple) else {"predicted": got}
        out.append(row)
    return out


def summary(table: list[dict]) -> list[str]:
    """Per memory kind and split: the runs predicted, the median and the worst |predicted / published - 1|;
    then the runs not predicted, by reason."""
    lines, done = [], [r for r in table if "predicted" in r]
    for kind in sorted({r["kind"] for r in done}):
        for split in ("fit", "held-out"):
            errors = [error(r) for r in done if r["kind"] == kind and r["split"] == split]
            if errors:
                lines.append(f"  {kind:15} {split:9} {len(errors):3} runs: median {statistics.median(errors):.1%}, "
                             f"worst {max(errors):.1%}")  # fmt: skip
    reasons: dict[str, int] = {}
    for r in table:
        if "reason" in r:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    lines.append(f"not predicted: {len(table) - len(done)} of {len(table)} runs")
    lines += [f"  {n:3}  {reason}" for reason, n in sorted(reasons.items(), key=lambda x: -x[1])]
    return [f"predicted: {len(done)} of {len(table)} runs (|predicted / published - 1| by memory kind)"] + lines


def main(runs: list | None = None, describe=None, predict=None) -> None:
    table = rows(load() if runs is None else runs, describe, predict)
    if "--summary" not in sys.argv:
        for r in table:
            if "predicted" in r:
                got = "-".join(f"{b / 2**30:.2f}" for b in r.get("band", (r["predicted"],)))
                ratio = "-".join(f"{b / r['published']:.2f}" for b in r.get("band", (r["predicted"],)))
                print(f"{r['run']} ({r['kind']}, {r['split']}): published {r['published'] / 2**30:.2f} GiB, predicted "
                      f"{got} GiB ({ratio}x)\n  {r['command']}")
        print()
    print("\n".join(summary(table)))


if __name__ == "__main__":
    main()
