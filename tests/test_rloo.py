"""TRL 1.16's RLOOTrainer (--rl rloo, issue 43): memcalc.exact.hf.rloo's training step equals trl 1.16 itself
(RLOOTrainer._compute_loss over its fused LM head, Transformers and PEFT: verify/trl_grpo.py) allocation by
allocation on meta and on CPU tensors under the Trainer's autocast; its generation and engine are GRPO's.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.model.finetune import Finetune
from memcalc.model.rl import RLOO_DEFAULTS, OnlineRL, second_model, with_rl
from memcalc.model.stacks import STACKS


def rloo(finetune: Finetune = Finetune(4), recipe: str = "pure", **settings):
    settings = {"num_generations": 2, "beta": 0.05, **settings}
    return with_rl(replace(STACKS["trl:1.16"], finetune=finetune, recipe=recipe), "rloo", online=OnlineRL(**settings))


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("name,tricks,finetune,settings", [
    ("llama", "bf16", Finetune(4), {}),  # RLOOConfig's defaults: beta 0.05 (its KL in the rewards, not the step)
    ("llama", "bf16,flash,ckpt", Finetune(), {}),  # a full fine-tune: the reference a second model, held
    ("qwen3", "bf16,flash,ckpt", Finetune(4, quantize="nf4"), {"beta": 0.0}),
    ("llama", "bf16,flash,ckpt", Finetune(4, lora_dropout=0.1), {"vllm": "colocate"}),
])  # fmt: skip
def test_allocation_by_allocation(name, tricks, finetune, settings):
    pytest.importorskip("trl")
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    assert_watched_meta(TINY[name], tricks, rloo(finetune, completion_len=23, **settings), batch=2)


def test_cpu_under_autocast_with_the_prompt_masked():
    pytest.importorskip("trl")
    from tests.replay import assert_watched_cpu
    from tests.test_stack_hf import TINY

    assert_watched_cpu(TINY["llama"], rloo(recipe="autocast", completion_len=12), "bf16,flash,ckpt")


def test_rloo_configs_defaults():
    """--rl rloo takes RLOOConfig's defaults (2 completions per prompt, beta 0.05: a full fine-tune keeps a second
    model), and the same engine options as GRPO."""
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "1024", "--rl", "rloo", "--micro-batch", "2", "--tricks",
            "bf16,flash,ckpt", "--vllm", "colocate", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["setup"]["stack"]["rl"] == "rloo" and data["setup"]["stack"]["online"]["num_generations"] == 2
    assert data["rollout"]["phases"][0]["fits"]
    assert second_model(with_rl(STACKS["trl:1.16"], "rloo")) and RLOO_DEFAULTS.beta == 0.05
    lora = run("estimate", "--model", "llama3.2-1b", "--seq", "1024", "--rl", "rloo", "--lora", "8", "--micro-batch",
               "2", "--tricks", "bf16,flash,ckpt", "--format", "json")  # fmt: skip
    full = json.loads(r.stdout)["verdict"][0]["phases"]["weights_bytes"]
    assert lora.exit_code == 0 and json.loads(lora.stdout)["verdict"][0]["phases"]["weights_bytes"] < full / 2


def test_the_loss_is_per_sequence():
    """RLOO's loss holds (B,) tensors where GRPO's holds (B, C) ones: its step keeps less beside the same model."""
    from memcalc.exact.step import exact_step
    from memcalc.model.presets import PRESETS
    from memcalc.model.tricks import parse_tricks

    shape, tricks = replace(PRESETS["llama3.2-1b"], n_layers=2), parse_tricks("bf16,flash,ckpt")
    grpo_stack = with_rl(replace(STACKS["trl:1.16"], finetune=Finetune(8)), "grpo", online=OnlineRL(completion_len=1024))
    kept = [exact_step(shape, 2048, 4, tricks, stack=s).phases.retained_bytes
            for s in (rloo(Finetune(8), completion_len=1024, beta=0.0), grpo_stack)]  # fmt: skip
    assert kept[0] < kept[1]
