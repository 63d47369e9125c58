"""memcalc's RL and preference fine-tuning peak beside each published measurement of benchmarks/rl/ (issue 43).

    python benchmarks/rl/report.py            # each predicted run: command, published, predicted, ratio; the summary
    python benchmarks/rl/report.py --summary  # the summary alone: the errors by memory kind, the reasons by count

A run is predicted where memcalc replays its step: `command()` writes the `memcalc estimate` that describes it (TRL's
trainer as --rl on the --stack trl:LINE of the TRL release that ran, the model's preset or its config.json beside
this file, the trick set from its precision and checkpointing with Transformers' default attention, sdpa), and the
verdict's figure of the run's memory kind is compared with the published one, by benchmarks/finetune/report.py's
rules (predicted, error, summary: a figure of unknown kind is held to the band from the allocated peak to the
device's used memory). A run memcalc cannot describe says why: the reason is what the run does not give, or
memcalc's own refusal of the command (the TRL lines and trainers it does not replay yet), so that the report
follows the engine as it learns them.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.finetune import report  # noqa: E402
from benchmarks.rl.corpus import Run, load  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"  # a Hub config.json per model without a memcalc preset
GPU_FILES = Path(__file__).resolve().parent / "gpus"  # a --gpu FILE.json per card memcalc's table does not have
# development builds between releases, as the release line whose trainer code they run: trl/trainer/dpo_trainer.py
# DPOTrainer._compute_loss at each commit diffed against the releases' wheels (identical to the line's)
DEV_BUILDS = {"8e4d5e9c": "1.5", "c3f21ede": "1.6"}


def trl_line(version: str) -> str | None:
    """memcalc's --stack trl:LINE for a TRL version ("1.6.0", or a development build "1.6.0.dev0+<commit>" that
    DEV_BUILDS places), or None where no line holds it."""
    from memcalc.model.stacks import line_of

    if "+" in version:
        return DEV_BUILDS.get(version.split("+", 1)[1][:8])
    return line_of(version)


def model_args(run: Run) -> list[str] | str:
    """--model PRESET, or --config FILE of the Hub's config.json kept beside this file; or why neither."""
    if run.hf_id in report.PRESET:  # the fine-tuning report's Hub ids as memcalc's presets
        return ["--model", report.PRESET[run.hf_id]]
    config = CONFIGS / f"{(run.hf_id or '').rsplit('/', 1)[-1]}.json"
    if run.hf_id and config.exists():
        return ["--config", str(config.relative_to(ROOT))]
    return f"no memcalc preset or config for {run.hf_id or run.model!r}"


def command(run: Run) -> list[str] | str:
    """The `memcalc estimate` arguments that describe the run, or why memcalc cannot describe it."""
    from memcalc.model.gpus import GPUS
    from memcalc.model.rl import TRAINERS

    if not run.framework.startswith("TRL "):
        return f"{run.framework}: memcalc replays TRL's trainers over Transformers, not this trainer's step"
    if run.algorithm not in TRAINERS:
        return f"{run.algorithm}: memcalc replays TRL's DPOTrainer, GRPOTrainer and RLOOTrainer"
    if run.method == "unstated" or run.rollout == "unstated":
        return "the run does not say whether it trained LoRA or the full model, or how it generated"
    version = (run.versions or {}).get("trl")
    line = trl_line(version) if version else None
    if line is None:
        return f"TRL {version or '(version not given)'}: no release line memcalc knows holds it"
    if run.micro_batch is None or run.seq is None:
        return "the run does not give its micro-batch and length"
    gpu = "a100-80gb" if run.gpu == "a100" else run.gpu  # an A100 of unstated memory: the step's bytes are the same
    if gpu not in GPUS and (GPU_FILES / f"{gpu}.json").exists():  # a card described beside this file
        gpu = str((GPU_FILES / f"{gpu}.json").relative_to(ROOT))
    elif gpu not in GPUS:
        return f"GPU {run.gpu!r} is not in memcalc's table"
    model = model_args(run)
    if isinstance(model, str):
        return model
    tricks = [run.dtype or "fp32"] + (["flash"] if run.dtype in ("bf16", "fp16") else [])
    tricks += ["ckpt"] if run.grad_checkpointing is not False else []  # DPOConfig's and GRPOConfig's default: on
    args = ["estimate", *model, "--seq", str(run.seq), "--micro-batch", str(run.micro_batch), "--grad-accum",
            str(run.grad_accum or 1), "--tricks", ",".join(tricks), "--gpu", gpu, "--stack", f"trl:{line}",
            "--rl", run.algorithm]  # fmt: skip
    if run.method in ("lora", "qlora"):
        args += ["--lora", str(run.lora_rank)] if run.lora_rank else []
        args += ["--quantize", "nf4"] if run.method == "qlora" else []
        args += ["--lora-dropout", str(run.lora_dropout)] if run.lora_dropout else []
    if run.parallel in ("ddp", "deepspeed", "fsdp"):
        args += ["--gpus", str(run.gpus)] + (["--zero", str(run.zero)] if run.zero is not None else [])
    if run.algorithm == "grpo":
        args += ["--completion-len", str(run.response_len or 512)]
        args += ["--num-generations", str(run.num_generations)] if run.num_generations else []
        if run.rollout == "vllm":
            args += ["--vllm", "colocate" if run.placement == "colocated" else "server"]
            args += ["--vllm-util", str(run.gpu_memory_utilization)] if run.gpu_memory_utilization else []
    return args


def run_peak(answer: dict) -> int:
    """The allocated peak of a run read over more than its step: where the policy generates itself (no vLLM engine:
    GRPO's and RLOO's own generate, PPO's rollout) the highest of the phases, each of them PyTorch's tensors (the
    trainer's state with generate's peak, with the scoring passes', the step's), as the measurements that reset the
    peak before the trainer read it; else the step's."""
    step = answer["verdict"][0]["peak_bytes"]
    rollout = answer.get("rollout") or {}
    phase = (rollout.get("phases") or [None])[0]
    if phase is None or rollout.get("engine") is not None:
        return step
    return max(step, phase["rollout_bytes"], phase["score_bytes"])


def predicted(args: list[str], kind: str) -> int | tuple[int, int] | str:
    """benchmarks/finetune/report.py's figure of the kind, its allocated peak the run's (run_peak)."""
    return report.predicted(args, kind, run_peak)


def main() -> None:
    report.main(load(), command, predicted)


if __name__ == "__main__":
    main()
