"""The fit verdict, the OOM toolbox and the fit solver, all measured by the verdict estimate gives the same
job (memcalc.parallel.verdict): the stack's step replayed, sharded inside the step."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memcalc.engine.fit import fit_limits, largest, largest_reserved
from memcalc.engine.toolbox import toolbox
from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.model.gpus import gpu
from memcalc.model.layout import Layout
from memcalc.model.presets import canonical_model, preset_model
from memcalc.model.tricks import Tricks, parse_tricks
from memcalc.parallel.verdict import gpu_verdict
from memcalc.report.answer import toolbox_section

H100 = gpu("h100-sxm")
MODEL_8B = canonical_model(8_000_000_000)


def test_8b_from_fp32_walks_the_ladder_in_order():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"))
    names = [s.name for s in box.steps]
    assert names[:3] == ["bf16 mixed precision", "FlashAttention", "full activation checkpointing"]
    assert names[3].startswith("ZeRO-") and names[4] == "CPU offload of optimizer state"
    zero = box.steps[3]
    assert zero.layout.dp == 2 and zero.verdict.fits
    kept = [s.verdict.total_bytes for s in box.steps[:4] if s.kept]
    assert kept == sorted(kept, reverse=True)  # each kept step on top of the last holds less
    assert box.steps[box.fits_at].verdict.fits


def test_each_step_is_the_verdict_of_its_job():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"))
    for s in box.steps:
        assert s.verdict == gpu_verdict(MODEL_8B, s.setup, H100, s.tricks, s.layout) or not s.kept


def test_offload_is_the_single_gpu_alternative():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"))
    offload = box.steps[-1]
    assert offload.layout.dp == 1 and offload.layout.offload_optimizer
    assert offload.verdict.fits  # bf16 weights, grads and checkpointed activations on the GPU
    assert offload.verdict.state_bytes == 2 * offload.verdict.n_params  # only the bf16 weights stay


def test_saves_alone_applies_the_same_change_to_the_start():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"))
    bf16 = gpu_verdict(MODEL_8B, Setup(seq_len=8192), H100, Tricks("bf16")).total_bytes
    assert box.steps[0].saves_alone_bytes == box.start.total_bytes - bf16


def test_micro_batch_step_keeps_the_tokens_per_step():
    setup = Setup(seq_len=4096, micro_batch=8)
    box = toolbox(preset_model("llama3-8b"), setup, gpu("h200"), parse_tricks("bf16,flash"))
    step = next(s for s in box.steps if s.name.startswith("micro-batch"))
    assert step.setup.micro_batch == 1 and step.setup.grad_accum == 8
    assert step.setup.tokens_per_step == setup.tokens_per_step


def test_a_config_that_fits_needs_no_tools():
    """fits_at was -1 here, an index that reads the last step (steps[-1] is the bf16 step it applied)."""
    box = toolbox(preset_model("gpt2"), Setup(seq_len=1024), H100, Tricks("bf16"))
    assert box.start.fits and box.outcome == "fits as it is" and box.fits_at is None


def test_activations_too_large_for_any_gpu_count():
    box = toolbox(MODEL_8B, Setup(seq_len=1 << 22), H100, Tricks("bf16", flash=True))
    assert box.outcome == "fits nowhere" and box.fits_at is None


def test_the_json_says_where_the_job_fits():
    """Each outcome in the estimate's JSON: its name, and the index of the step that fits or null (never -1)."""
    import json

    from typer.testing import CliRunner

    from memcalc.cli import app

    def toolbox_json(*args):
        out = CliRunner().invoke(app, ["estimate", *args, "--format", "json"])
        return json.loads(out.stdout)["toolbox"]

    for args, outcome in ((["--model", "gpt2", "--seq", "1024"], "fits as it is"),
                          (["--params", "8e9", "--seq", "4m", "--tricks", "bf16,flash"], "fits nowhere")):  # fmt: skip
        tb = toolbox_json(*args)
        assert (tb["outcome"], tb["fits_at"]) == (outcome, None)
    tb = toolbox_json("--params", "8e9", "--seq", "8192")
    assert tb["outcome"] == "fits after a step" and tb["steps"][tb["fits_at"]]["verdict"]["fits"]


def test_a_step_that_saves_nothing_is_not_taken():
    """Issue 18: at seq 1024 checkpointing saves nothing on Llama-3-8B (the peak is the optimizer step's), yet
    the toolbox recommended bf16+flash+ckpt with ZeRO; bf16+flash with the same ZeRO fits, faster."""
    box = toolbox(preset_model("llama3-8b"), Setup(seq_len=1024), H100, Tricks("fp32"))
    ckpt = next(s for s in box.steps if s.name == "full activation checkpointing")
    assert ckpt.saves_bytes <= 0 and not ckpt.kept
    chosen = box.steps[box.fits_at]
    assert chosen.tricks == parse_tricks("bf16,flash") and chosen.layout.dp == 2


def test_a_step_that_costs_memory_is_shown_as_a_cost():
    """Issue 18: on Qwen3-235B-A22B checkpointing 'saved -0.001 GB' and was recommended."""
    box = toolbox(preset_model("qwen3-235b-a22b"), Setup(seq_len=4096), H100, Tricks("fp32"))
    ckpt = next(s for s in box.steps if s.name == "full activation checkpointing")
    assert ckpt.saves_alone_bytes < 0 and ckpt.saves_bytes <= 0 and not ckpt.kept
    assert all(s.kept for s in box.steps if s.saves_bytes > 0)
    row = next(r for r in toolbox_section(box, "gb").rows if r[0] == ckpt.name)
    assert row[1] == "costs 0.001 GB" and row[2] == "not applied"


def test_the_cheapest_per_token_is_recommended():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"))
    fitting = [s for s in box.steps if s.kept and s.verdict.fits]
    assert len(fitting) >= 2  # ZeRO over more GPUs, and offload on the one
    assert box.steps[box.fits_at].gpu_seconds_per_token == min(s.gpu_seconds_per_token for s in fitting)


def test_largest():
    assert largest(lambda n: n <= 37, 1000) == 37
    assert largest(lambda n: True, 1000) == 1000
    assert largest(lambda n: False, 1000) == 0
    assert largest(lambda n: n <= 1, 1) == 1


@given(st.integers(0, 200_000), st.integers(1, 200_000), st.integers(1, 10**6), st.integers(0, 10**3),
       st.lists(st.integers(-10**7, 10**7), min_size=1))
def test_largest_follows_the_margins_to_the_same_answer(root, limit, per_unit, square, noise):
    """With each probe's margin (bytes over the budget) recorded, largest lands where halving does, whatever the
    margins say (noise: how far from the truth they are), and where they are a line or nearly, in a handful of probes
    where doubling and halving take some thirty: a fit at 8B width replays the step once per probe."""
    probes, margins = [], {}

    def fits(n: int) -> bool:
        probes.append(n)
        margins[n] = per_unit * (n - root) + square * (n * n - root * root) + noise[len(probes) % len(noise)]
        return n <= root

    assert largest(fits, limit, margins) == min(root, limit)
    if not any(noise) and square == 0 and 2 <= root < limit:
        assert len(probes) <= 4
    assert len(probes) <= 2 * (2 * math.ceil(math.log2(limit + 1)) + 2)


@given(st.integers(1, 60_000), st.integers(0, 60_000), st.lists(st.integers(0, 10**10), min_size=1),
       st.integers(1, 10**7))
def test_largest_reserved_finds_the_allocators_limit_whatever_it_says_it_lacked(tensors, room, shorts, per_unit):
    """The search below the tensors' limit lands on the allocator's own, however wrong the bytes it lacked are as a
    guide (fragmentation: a large segment refused near the limit), in no more than three times halving's probes."""
    room = min(room, tensors)
    probes = []

    def verdict(n: int, allocator: bool = True) -> SimpleNamespace:
        fits = n <= (room if allocator else tensors)
        if allocator:
            probes.append(n)
        short = 0 if fits else shorts[len(probes) % len(shorts)]
        return SimpleNamespace(fits=fits, peak_bytes=n * per_unit, reserved=SimpleNamespace(short_bytes=short))

    assert largest_reserved(verdict, 60_000) == room
    assert len(probes) <= 3 * (math.ceil(math.log2(tensors + 1)) + 1)


@pytest.mark.parametrize("layout", [Layout(), pytest.param(Layout(dp=8, zero=3), marks=pytest.mark.slow(
    "the one-GPU case (the same search); the sharded verdict it searches with: tests/test_zero_monotone.py"))])
def test_fit_limits_are_tight(layout):
    setup, tricks, h200 = Setup(seq_len=8192), parse_tricks("bf16,flash,ckpt"), gpu("h200")
    limits = fit_limits(MODEL_8B, setup, h200, tricks, layout)

    def fits(**change):
        return gpu_verdict(MODEL_8B, replace(setup, **change), h200, tricks, layout).fits

    assert fits(seq_len=limits.max_seq_len) and not fits(seq_len=limits.max_seq_len + 1)
    assert fits(micro_batch=limits.max_micro_batch) and not fits(micro_batch=limits.max_micro_batch + 1)


def test_fit_limits_when_state_alone_is_too_big():
    limits = fit_limits(preset_model("llama3-70b"), Setup(seq_len=2048), H100, parse_tricks("bf16,flash,ckpt"))
    assert limits.max_seq_len == 0 and limits.max_micro_batch == 0 and limits.memory_at_max_seq is None


def test_a_tool_the_verdict_cannot_answer_is_left_out(monkeypatch):
    """A tool whose job the verdict refuses (as the FSDP2 replay refused gradient accumulation under sac before
    the textbook counted sac's blocks) is skipped; the command answers with the others."""
    import memcalc.engine.toolbox as tb

    def verdict(model, setup, gpu_, tricks, layout):
        if setup.grad_accum > 1:
            raise InputError("this job cannot be answered")
        return gpu_verdict(model, setup, gpu_, tricks, layout)

    monkeypatch.setattr(tb, "gpu_verdict", verdict)
    setup = Setup(seq_len=16384, micro_batch=4)
    box = tb.toolbox(preset_model("llama3-8b"), setup, gpu("h100-sxm"), parse_tricks("bf16,flash"), Layout())
    assert not box.start.fits and box.steps and not any("accumulation" in s.name for s in box.steps)
