"""TRL 1.16's DPOTrainer (--stack trl:1.16 --rl dpo, issue 43): memcalc.exact.hf.dpo equals trl 1.16 itself
(DPOTrainer._compute_loss over its fused LM head, Transformers and PEFT: verify/trl_dpo.py) allocation by
allocation on meta, and on CPU tensors under the Trainer's autocast; --micro-batch counts pairs.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.stacks import STACKS, stack_for, with_rl

LORA, QLORA = Finetune(4), Finetune(4, quantize="nf4")


def dpo(finetune: Finetune = LORA, recipe: str = "pure"):
    return replace(STACKS["trl:1.16"], finetune=finetune, recipe=recipe, rl="dpo")


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("name,tricks,finetune,rows", [
    ("llama", "bf16", LORA, 2),  # one pair: its chosen and rejected sequences
    ("llama", "bf16,flash,ckpt", QLORA, 4),  # the reference forward with checkpointing turned off
    ("qwen3", "bf16,flash,ckpt", LORA, 2),
    ("llama", "bf16", Finetune(4, dora=True), 2),  # disabled adapters: DoRA's magnitude unused too
])  # fmt: skip
def test_allocation_by_allocation(name, tricks, finetune, rows):
    pytest.importorskip("trl")
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    assert_watched_meta(TINY[name], tricks, dpo(finetune), batch=rows)


def test_cpu_under_autocast():
    """TRL's default (bf16=True: Accelerate's autocast over the bf16 base): the reference's call goes through the
    prepared forward too."""
    pytest.importorskip("trl")
    from tests.replay import assert_watched_cpu
    from tests.test_stack_hf import TINY

    assert_watched_cpu(TINY["llama"], dpo(recipe="autocast"), "bf16")


def test_micro_batch_counts_pairs():
    args = ["estimate", "--model", "llama3.2-1b", "--seq", "512", "--stack", "trl:1.16", "--lora", "8",
            "--tricks", "bf16,flash,ckpt", "--format", "json"]  # fmt: skip
    pairs = run(*args, "--rl", "dpo", "--micro-batch", "2")
    rows = run(*args, "--micro-batch", "4")
    assert pairs.exit_code == 0 and rows.exit_code == 0, pairs.output + rows.output
    p, r = json.loads(pairs.stdout), json.loads(rows.stdout)
    assert p["setup"]["micro_batch"] == r["setup"]["micro_batch"] == 4  # sequences: 2 pairs
    v, w = p["verdict"][0], r["verdict"][0]
    assert p["setup"]["stack"]["rl"] == "dpo" and r["setup"]["stack"]["rl"] == ""
    # the reference forward runs on top of the policy's saved activations: the forward holds more than SFT's
    assert v["phases"]["forward_peak_bytes"] > w["phases"]["forward_peak_bytes"]
    assert p["time"][0]["step_seconds"] > r["time"][0]["step_seconds"]  # its kernels: one more forward
    table = run(*args[:-2], "--rl", "dpo", "--micro-batch", "2")
    assert "micro-batch 2 pairs (4 sequences)" in table.output and "DPOTrainer (sigmoid loss)" in table.output


@pytest.mark.parametrize("args,said", [
    (["--stack", "hf", "--lora", "8"], "--rl dpo is TRL's DPOTrainer"),
    (["--stack", "trl:1.14", "--lora", "8"], "--rl dpo is TRL's DPOTrainer"),
    (["--stack", "trl:1.16"], "full fine-tuning"),
    (["--stack", "trl:1.16", "--lora", "8", "--liger"], "--liger"),
    (["--stack", "trl:1.16", "--lora", "8", "--modules-to-save", "lm_head"], "--modules-to-save"),
])  # fmt: skip
def test_refused(args, said):
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "512", *args, "--rl", "dpo")
    assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, r.output


def test_unknown_rl():
    with pytest.raises(InputError, match="unknown --rl"):
        with_rl(replace(stack_for("trl:1.16"), finetune=LORA), "ppo")


def test_dropout_is_disabled():
    """DPOConfig.disable_dropout: LoRA's dropout too (disable_dropout_in_model sets every nn.Dropout's p to 0)."""
    stack = with_rl(replace(stack_for("trl:1.16"), finetune=Finetune(8, lora_dropout=0.1)), "dpo")
    assert stack.rl == "dpo" and stack.finetune.lora_dropout == 0.0


def test_fit_counts_pairs():
    """fit's largest micro-batch is in pairs: the verdict at it fits, one pair more does not."""
    args = ["--model", "llama3.2-1b", "--stack", "trl:1.16", "--lora", "8", "--rl", "dpo", "--tricks",
            "bf16,flash,ckpt", "--gpu", "rtx4090", "--seq", "2048"]  # fmt: skip
    r = run("fit", *args, "--format", "json")
    assert r.exit_code == 0, r.output
    best = json.loads(r.stdout)["max_micro_batch"]
    assert best >= 1
    at = json.loads(run("estimate", *args, "--micro-batch", str(best), "--format", "json").stdout)
    above = json.loads(run("estimate", *args, "--micro-batch", str(best + 1), "--format", "json").stdout)
    assert at["verdict"][0]["fits"] and not above["verdict"][0]["fits"]


def test_axolotl_rl_points_at_the_option(tmp_path):
    """axolotl's `rl: dpo` runs axolotl's own DPOTrainer subclass: refused in one line that names --rl dpo."""
    path = tmp_path / "dpo.yml"
    path.write_text("base_model: meta-llama/Llama-3.2-1B\nrl: dpo\nadapter: lora\nlora_r: 8\nsequence_len: 512\n")
    r = run("estimate", "--from", str(path))
    assert r.exit_code == 2 and "--rl dpo" in r.output and "Traceback" not in r.output, r.output
