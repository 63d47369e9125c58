"""RL fine-tuning's jobs side by side: GRPO with vLLM colocated and on its own GPUs, PPO and DPO, for Qwen2.5-7B and
Llama-3-8B on 8 H100s and on one 24 GB card, each phase's peak on one GPU and the host memory.

    python examples/rl_jobs.py

Each row is the `memcalc estimate` printed under it, run in this process (memcalc.cli.inprocess) with
`--format json`: the numbers are the command line's own. A job memcalc refuses shows its one-line reason.
"""

import json
import shlex

from memcalc.cli.inprocess import run

H100S = "--gpu h100-sxm --gpus 8"
CARD = "--gpu rtx4090"
GPUS = {H100S: "8 x h100-sxm", CARD: "1 x rtx4090"}
GRPO = "--rl grpo --seq 1536 --completion-len 1024 --micro-batch 8 --tricks bf16,flash,ckpt"
GRPO_CARD = "--rl grpo --seq 1024 --completion-len 512 --micro-batch 4 --num-generations 4 --tricks bf16,flash,ckpt"
PPO = "--rl ppo --seq 1024 --micro-batch 4 --grad-accum 4 --tricks bf16,flash"
PPO_CARD = "--rl ppo --seq 512 --micro-batch 1 --grad-accum 4 --rollout-batch 4 --tricks bf16,flash"
DPO = "--rl dpo --seq 1024 --micro-batch 2 --tricks bf16,flash,ckpt"
DPO_CARD = "--rl dpo --seq 1024 --micro-batch 1 --tricks bf16,flash,ckpt"

# (trainer, the job's options less the model); the critic: a smaller reward and value model of the same tokenizer
JOBS = (
    ("GRPO colocate", f"{GRPO} --vllm colocate --zero 2 {H100S}"),
    ("GRPO colocate", f"{GRPO} --vllm colocate --lora 16 {H100S}"),
    ("GRPO colocate", f"{GRPO_CARD} --vllm colocate --vllm-sleep --lora 16 {CARD}"),
    ("GRPO server", f"{GRPO} --vllm server --zero 2 {H100S}"),
    ("GRPO server", f"{GRPO} --vllm server --lora 16 {H100S}"),
    ("GRPO server", f"{GRPO_CARD} --vllm server --lora 16 {CARD}"),
    ("PPO", f"{PPO} {H100S}"),
    ("PPO", f"{PPO} --lora 16 {H100S}"),
    ("PPO", f"{PPO_CARD} --lora 16 {CARD}"),
    ("PPO", f"{PPO_CARD} --lora 16 --critic {{critic}} {CARD}"),
    ("DPO", f"{DPO} --precompute-ref --zero 2 {H100S}"),
    ("DPO", f"{DPO} --lora 16 {H100S}"),
    ("DPO", f"{DPO_CARD} --lora 16 {CARD}"),
)
MODELS = (("qwen2.5-7b", "qwen3-0.6b"), ("llama3-8b", "llama3.2-1b"))  # a critic shares the policy's tokenizer
PHASES = ("startup", "rollout", "score", "train")


def gb(n: int | None) -> str:
    return "" if n is None else f"{n / 1e9:.1f}"


def cells(printed: dict) -> list[str]:
    """The phases' peaks on one GPU (train: the step beside the engine; without a rollout, the verdict's), the first
    phase that does not fit (memcalc.engine.rollout.RolloutPhases.failed), the host's bytes."""
    verdict = printed["verdict"][0]
    phases = (printed.get("rollout") or {}).get("phases") or [None]
    phase = phases[0] or {}
    peaks = [phase.get(f"{p}_bytes") or None for p in PHASES[:-1]] + [phase.get("train_bytes", verdict["total_bytes"])]
    failed = phase.get("failed", "" if verdict["fits"] else "train") or ("" if verdict["host_fits"] else "host")
    fits = "no: vLLM start" if failed == "start" else f"no: {failed}" if failed else "yes"
    return [gb(p) for p in peaks] + [fits, gb(verdict["host_bytes"])]


def main() -> None:
    print("GB on one GPU in each phase (train: the verdict), and the host's")
    head = ["model", "trainer", "GPUs", "options", *PHASES, "fits", "host"]
    rows, refused = [head], []
    for model, critic in MODELS:
        for trainer, options in JOBS:
            options = options.format(critic=critic)
            gpus = next(g for g in GPUS if options.endswith(g))
            shown = options.removesuffix(gpus).split(" --tricks ")[1].split(" ", 1)[1].strip()
            printed = run(("estimate", "--model", model, *shlex.split(options), "--format", "json"))
            if printed.code:
                refused.append(f"{model} {trainer} {shown}: {printed.err.strip().removeprefix('error: ')}")
                continue
            rows.append([model, trainer, GPUS[gpus], shown, *cells(json.loads(printed.out))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for n, r in enumerate(rows):
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    for line in refused:
        print(f"refused: {line}")
    print("\neach trainer's other options, on 8 H100s | on one card:")
    for name, many, one in (("GRPO", GRPO, GRPO_CARD), ("PPO", PPO, PPO_CARD), ("DPO", DPO, DPO_CARD)):
        print(f"  {name}: {many} | {one}")


if __name__ == "__main__":
    main()
