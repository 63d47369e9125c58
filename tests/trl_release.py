"""An earlier TRL release's step beside memcalc's replay of it, run in a process whose path puts that release first
(assert_release installs it apart with `pip install --target`, for tests/test_dpo_logits.py and tests/test_ppo.py;
the test extra's trl is 1.16):

    PYTHONPATH=<trl 1.6.0's folder>:. python -m tests.trl_release dpo:1.6:llama:bf16:full [more cases]

each case --rl, the stack's line, a tests/test_stack_hf.py TINY model, a trick set, full, lora or qlora, and
optionally precompute (DPOConfig.precompute_ref_log_probs), or under ppo the accumulation steps and optionally the
value and reward models' TINY model and chunkN (local_rollout_forward_batch_size): it says
which case differs (tests/replay.py assert_watched_cpu: allocation by allocation on CPU tensors under the Trainer's
autocast; under ppo assert_same_ppo: PPOTrainer.train() itself) and exits 1, else 0."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from memcalc.model.finetune import Finetune
from memcalc.model.stacks import STACKS, line_of

FINETUNES = {"full": Finetune(), "lora": Finetune(4), "qlora": Finetune(4, quantize="nf4")}

ROOT = Path(__file__).resolve().parent.parent
TRIMMED = ("Warn", "warn", "kernels-community", "torchao", "_pytree", "Failed to load")


def release(version: str) -> Path:
    """trl `version` installed apart (no dependencies: the test extra's Transformers, PEFT and torch serve it), once
    per machine; an install that fails (no package index) skips."""
    folder = Path(tempfile.gettempdir()) / f"memcalc-trl-{version}"
    if not (folder / "trl").is_dir():
        partial = folder.with_name(f"{folder.name}.{os.getpid()}")
        run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
                              f"trl=={version}"], capture_output=True, text=True)  # fmt: skip
        if run.returncode != 0:
            pytest.skip(f"trl {version} could not be installed apart: {run.stderr.strip()[-200:]}")
        try:
            partial.rename(folder)
        except OSError:  # another worker installed it first
            pass
    return folder


def assert_release(version: str, *cases: str) -> None:
    """The cases (main's) run in a process of their own with trl `version` first on the path."""
    pytest.importorskip("peft")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(release(version)), str(ROOT)]))
    run = subprocess.run([sys.executable, "-m", "tests.trl_release", *cases], capture_output=True, text=True, env=env,
                         cwd=ROOT)  # fmt: skip
    said = [x for x in (run.stdout + run.stderr).splitlines() if not any(t in x for t in TRIMMED)]
    assert run.returncode == 0, "\n".join(said[-20:])


def main(*cases: str) -> int:
    import trl

    from tests.replay import assert_same_ppo, assert_watched_cpu
    from tests.test_stack_hf import TINY

    failed = 0
    for case in cases:
        rl, line, model, tricks, finetune, *precompute = case.split(":")
        if line_of(trl.__version__) != line:
            print(f"trl {trl.__version__} is not a release of the {line} line")
            return 1
        stack = replace(STACKS[f"trl:{line}"], finetune=FINETUNES[finetune], rl=rl, loss="full",
                        precompute_ref=precompute == ["precompute"])  # fmt: skip
        try:
            if rl == "ppo":  # its accumulation steps, then the critic's TINY model and chunkN, the rollout's rows
                accumulation, *more = precompute or ["2"]
                critics = dict(TINY, narrow=replace(TINY["llama"], n_layers=1, hidden=32, n_heads=2, n_kv_heads=1,
                                                    ffn=48))  # a critic smaller than the policy  # fmt: skip
                critic = next((critics[x] for x in more if not x.startswith("chunk")), None)
                chunk = next((int(x.removeprefix("chunk")) for x in more if x.startswith("chunk")), 64)
                assert_same_ppo(TINY[model], tricks, int(accumulation), FINETUNES[finetune], critic, chunk, line)
            elif rl == "grpo":  # the completion's positions, completionN (of the step's 24)
                from memcalc.model.rl import OnlineRL, with_rl

                C = next((int(x.removeprefix("completion")) for x in precompute if x.startswith("completion")), 12)
                grpo = with_rl(replace(STACKS[f"trl:{line}"], finetune=FINETUNES[finetune]), "grpo",
                               online=OnlineRL(completion_len=C))  # fmt: skip
                assert_watched_cpu(TINY[model], grpo, tricks)
            else:
                assert_watched_cpu(TINY[model], stack, tricks)
        except AssertionError as e:
            print(f"trl {trl.__version__}, {case}: the replay differs: {e!r}")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
