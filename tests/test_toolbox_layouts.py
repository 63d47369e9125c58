"""The OOM toolbox proposes only steps the layout can take (issue 10, defect 1)."""

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.engine.toolbox import toolbox
from memcalc.memory.estimate import Setup
from memcalc.model.layout import Layout
from memcalc.model.gpus import gpu
from memcalc.model.presets import canonical_model, preset_model
from memcalc.model.tricks import Tricks, parse_tricks

H100 = gpu("h100-sxm")
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


@pytest.mark.parametrize("gpus,zero", [(2, 0), (8, 0), (64, 0), (1, 0), (8, 1), (8, 3)])
def test_every_proposed_step_is_a_valid_layout(gpus, zero):
    """Defect 1: with ZeRO 0 over several GPUs, optimizer offload is not a step the toolbox may take."""
    box = toolbox(canonical_model(8_000_000_000), Setup(seq_len=8192), H100, Tricks("fp32"), Layout(dp=gpus, zero=zero))
    for step in box.steps:  # raised InputError before the fix
        lay = step.layout
        assert not lay.offload_optimizer or lay.zero >= 1 or lay.dp == 1, step.name


def test_offload_is_still_proposed_where_the_layout_allows_it():
    """Defect 1: ZeRO >= 1 over several GPUs keeps offload as the alternative on the GPUs you had."""
    box = toolbox(preset_model("llama3.1-405b"), Setup(seq_len=8192), H100, Tricks("fp32"), Layout(dp=2, zero=1))
    offload = next(s for s in box.steps if s.name == "CPU offload of optimizer state")
    assert offload.layout == Layout(dp=2, zero=1, offload_optimizer=True)


@pytest.mark.parametrize("args", [
    ["--params", "7.5e9", "--seq", "1024", "--gpus", "64"],
    ["--model", "gpt2", "--seq", "1024", "--tricks", "bf16,flash,ckpt", "--gpus", "2"],
    ["--model", "llama3-8b", "--gpus", "8"],
])  # fmt: skip
def test_multi_gpu_zero0_estimates_run(args):
    """Defect 1: any estimate over several GPUs with the default ZeRO 0 stopped with an offload error."""
    result = run("estimate", *args)
    assert result.exit_code == 0, result.output
    assert "offload over several" not in result.output


def test_zero_paper_baseline():
    """Defect 1, the issue's done-when: 7.5B on 64 GPUs at ZeRO 0 is 16 bytes/param, 120 GB per GPU."""
    result = run("estimate", "--params", "7.5e9", "--seq", "1024", "--gpus", "64", "--format", "json")
    assert result.exit_code == 0, result.output
    state = json.loads(result.stdout)["model_state"]
    assert state["total_bytes"] == 120_000_000_000
    assert sum(p["bytes_per_param"] for p in state["parts"]) == 16
    table = run("estimate", "--params", "7.5e9", "--seq", "1024", "--gpus", "64").stdout
    assert "120,000,000,000" in table or "120 GB" in table or "120.0 GB" in table


def test_gpt2_on_two_gpus_fits_without_tools():
    """Defect 1: the small job that fits easily needs no step at all."""
    box = toolbox(preset_model("gpt2"), Setup(1024), H100, parse_tricks("bf16,flash,ckpt"), Layout(dp=2))
    assert box.outcome == "fits as it is" and box.fits_at is None
