"""The fit verdict, the OOM toolbox and the fit solver, measured by the textbook (the lesson's numbers;
tests/test_exact_verdict.py measures them by the replayed step, as estimate does)."""

from dataclasses import replace

from memcalc.memory.estimate import Setup, memory_for
from memcalc.memory.toolbox import fit_limits, largest, textbook, toolbox
from memcalc.model.gpus import gpu
from memcalc.model.presets import canonical_model, preset_model
from memcalc.model.tricks import Tricks, parse_tricks

H100 = gpu("h100-sxm")
MODEL_8B = canonical_model(8_000_000_000)


def test_8b_from_fp32_walks_the_ladder_in_order():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"), measure=textbook)
    names = [s.name for s in box.steps]
    assert names[:3] == ["bf16 mixed precision", "FlashAttention", "full activation checkpointing"]
    assert names[3].startswith("ZeRO-") and names[4] == "CPU offload of optimizer state"
    assert box.fits_at == 3  # 128 GB of state never fits one 80 GB GPU: ZeRO is the first that fits
    zero = box.steps[3]
    assert zero.setup.parallel.gpus == 2 and zero.memory.fits
    totals = [s.memory.total_bytes for s in box.steps[:4]]
    assert totals == sorted(totals, reverse=True)  # each step on top of the last saves memory


def test_offload_is_the_single_gpu_alternative():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"), measure=textbook)
    offload = box.steps[-1]
    assert offload.setup.parallel.gpus == 1 and offload.setup.parallel.offload
    assert offload.memory.fits  # 32 GB of bf16 weights + grads + checkpointed activations
    assert offload.saves_alone_bytes == 64_000_000_000  # from fp32: Adam m + v move to the host (no master)


def test_saves_alone_applies_the_same_change_to_the_start():
    box = toolbox(MODEL_8B, Setup(seq_len=8192), H100, Tricks("fp32"), measure=textbook)
    start = box.start.total_bytes
    bf16 = memory_for(MODEL_8B, Setup(seq_len=8192), H100, Tricks("bf16"))[3].total_bytes
    assert box.steps[0].saves_alone_bytes == start - bf16


def test_micro_batch_step_keeps_the_tokens_per_step():
    setup = Setup(seq_len=4096, micro_batch=8)
    box = toolbox(preset_model("llama3-8b"), setup, gpu("h200"), parse_tricks("bf16,flash"), measure=textbook)
    step = next(s for s in box.steps if s.name.startswith("micro-batch"))
    assert step.setup.micro_batch == 1 and step.setup.grad_accum == 8
    assert step.setup.tokens_per_step == setup.tokens_per_step


def test_a_config_that_fits_needs_no_tools():
    box = toolbox(preset_model("gpt2"), Setup(seq_len=1024), H100, Tricks("bf16"), measure=textbook)
    assert box.start.fits and box.fits_at == -1


def test_activations_too_large_for_any_gpu_count():
    box = toolbox(MODEL_8B, Setup(seq_len=1 << 22), H100, Tricks("bf16", flash=True), measure=textbook)
    assert box.fits_at is None


def test_largest():
    assert largest(lambda n: n <= 37, 1000) == 37
    assert largest(lambda n: True, 1000) == 1000
    assert largest(lambda n: False, 1000) == 0
    assert largest(lambda n: n <= 1, 1) == 1


def test_fit_limits_are_tight():
    setup = Setup(seq_len=8192)
    tricks = parse_tricks("bf16,flash,ckpt")
    limits = fit_limits(MODEL_8B, setup, gpu("h200"), tricks, measure=textbook)
    at = memory_for(MODEL_8B, replace(setup, seq_len=limits.max_seq_len), gpu("h200"), tricks)[3]
    past = memory_for(MODEL_8B, replace(setup, seq_len=limits.max_seq_len + 1), gpu("h200"), tricks)[3]
    assert at.fits and not past.fits
    batch = memory_for(MODEL_8B, replace(setup, micro_batch=limits.max_micro_batch + 1), gpu("h200"), tricks)[3]
    assert not batch.fits


def test_fit_limits_when_state_alone_is_too_big():
    limits = fit_limits(preset_model("llama3-70b"), Setup(seq_len=2048), H100, parse_tricks("bf16,flash,ckpt"), measure=textbook)
    assert limits.max_seq_len == 0 and limits.max_micro_batch == 0 and limits.memory_at_max_seq is None
