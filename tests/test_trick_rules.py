"""What each command makes of a trick set, the same everywhere: a combination that runs but saves nothing
is accepted with one warning (selective recompute beside flash), and a precision the GPU lacks is switched
with a note (bf16 on a V100 or T4)."""

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
COMMANDS = {
    "estimate": ["estimate", "--model", "llama3-8b", "--seq", "4096"],
    "estimate a layout": ["estimate", "--model", "llama3-8b", "--seq", "4096", "--tp", "2", "--gpus", "2"],
    "fit": ["fit", "--model", "llama3-8b"],
    "mfu": ["mfu", "--model", "llama3-8b", "--seq", "4096", "--tokens-per-sec", "1000"],
    "plan": ["plan", "--model", "llama3-8b", "--gpus", "2", "--global-batch", "2", "--seq", "2048"],
}


def run(*args):
    return CliRunner().invoke(app, list(args), env=ENV)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_selective_beside_flash_is_accepted_with_one_warning(command, fmt):
    """estimate warned, fit and mfu said nothing, plan refused: the combination runs (the attention core is
    recomputed for nothing), so every command computes it and says so once on stderr."""
    out = run(*COMMANDS[command], "--tricks", "bf16,flash,selective", "--format", fmt)
    assert out.exit_code == 0, out.output
    assert out.stderr.splitlines() == [
        "warning: bf16+flash+selective: selective recompute saves nothing beside flash (FlashAttention keeps no s×s "
        "scores) and still recomputes the attention core: drop selective, or name ckpt"]  # fmt: skip


def test_plan_ranks_the_selective_layouts_it_was_told_to():
    out = run(*COMMANDS["plan"], "--tricks", "bf16,flash,selective", "--format", "json")
    import json

    best = json.loads(out.stdout)["best"]
    assert best and all(b["tricks"] == ["bf16", "flash", "selective"] for b in best)


@pytest.mark.parametrize("command", ["estimate", "fit", "mfu", "plan"])
@pytest.mark.parametrize("card, name", [("v100-32gb", "NVIDIA V100 SXM2 32GB"), ("t4", "NVIDIA T4 16GB")])
def test_a_card_without_bf16_runs_the_default_in_fp16_with_a_note(command, card, name):
    """fit, mfu and plan refused their own default (bf16) on a V100 or T4 where estimate ran its progression
    in fp16, without a word; a bf16 the user names is still refused by each (memcalc.model.gpus.check_precision)."""
    out = run(*COMMANDS[command], "--gpu", card)
    assert out.exit_code == 0, out.output
    assert out.stderr.splitlines() == [f"warning: the {name} has no bf16 tensor cores (Volta, Turing): fp16 in "
                                       "place of bf16 in the default tricks; --tricks names others"]  # fmt: skip
    assert "fp16" in out.stdout and "bf16" not in out.stdout.replace("bf16/fp32", "")
    named = run(*COMMANDS[command], "--gpu", card, "--tricks", "bf16,flash")
    assert named.exit_code == 2 and named.stderr.strip().endswith("has none (torch.cuda.is_bf16_supported() is False "
                                                                  "there): use fp16")  # fmt: skip
