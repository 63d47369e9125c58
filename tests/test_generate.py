"""The policy's own generate (--rl grpo|rloo without --vllm, TRL 1.16's default): memcalc.exact.hf.generate equals
Transformers' model.generate as GRPOTrainer calls it (verify/trl_generate.py) allocation by allocation on CPU tensors,
and the answer holds it as the rollout phase beside the trainer's state.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.exact.hf.generate import generation, replay
from memcalc.model.finetune import FULL, Finetune
from memcalc.model.rl import OnlineRL, with_rl
from memcalc.model.stacks import STACKS
from memcalc.model.tricks import parse_tricks
from tests.replay import assert_same_allocations
from tests.test_exact_verdict import estimate_json
from tests.test_lora import step_config
from tests.test_stack_hf import TINY

VARIANT = pytest.mark.slow("test_generate_allocation_by_allocation's quick cases (the same loop on another decoder, "
                           "adapter or dtype, or peaking in the prefill)")  # fmt: skip


def config(name: str, rows: int, prompt: int, completion: int, finetune: Finetune = FULL, recipe: str = "pure",
           rl: str = "grpo"):  # fmt: skip
    online = OnlineRL(completion_len=completion, num_generations=2, beta=0.0)
    stack = with_rl(replace(STACKS["trl:1.16"], finetune=finetune, recipe=recipe), rl, online=online)
    return replace(step_config(TINY[name], prompt + completion, rows, "bf16,flash", stack, device="cpu"), watched=True)


@pytest.mark.parametrize("name,rows,prompt,completion,finetune,recipe", [
    ("llama", 2, 3, 9, FULL, "pure"),  # the peak in the last decode step
    ("llama", 2, 3, 5, Finetune(4, quantize="nf4"), "pure"),  # QLoRA: each 4-bit projection dequantised as it runs
    pytest.param("llama", 3, 5, 4, FULL, "pure", marks=VARIANT),  # the peak in the prefill
    pytest.param("llama", 2, 3, 6, Finetune(4, lora_dropout=0.1), "pure", marks=VARIANT),  # dropout on in training
    pytest.param("llama", 1, 4, 6, FULL, "pure", marks=VARIANT),  # one row: no check of the last column
    pytest.param("qwen3", 2, 3, 7, FULL, "pure", marks=VARIANT),  # q_norm and k_norm
    pytest.param("qwen2", 2, 5, 3, FULL, "pure", marks=VARIANT),  # biases on q, k, v
    pytest.param("llama-mha-tied", 2, 3, 6, FULL, "pure", marks=VARIANT),  # the head is the embedding table
    pytest.param("llama", 2, 3, 6, FULL, "autocast", marks=VARIANT),  # fp32 weights: generate runs in fp32
])  # fmt: skip
def test_generate_allocation_by_allocation(name, rows, prompt, completion, finetune, recipe):
    """Every allocation generate makes, its size and the live bytes at it, from the prompts to the last token."""
    pytest.importorskip("trl")
    from verify.trl_generate import measure_generate

    cfg = config(name, rows, prompt, completion, finetune, recipe)
    predicted, mem = replay(cfg, rows, every_step=True, timeline=True)
    live = measure_generate(TINY[name], parse_tricks("bf16,flash"), rows, prompt, completion, finetune,
                            recipe == "autocast", timeline=True)  # fmt: skip
    assert_same_allocations(mem, "input", live)
    assert predicted.peak_bytes == live.peak_bytes - live.base


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 4), prompt=st.integers(1, 6), completion=st.integers(1, 12),
       lora=st.booleans())  # fmt: skip
def test_the_steps_between_stand_for_one_another(rows, prompt, completion, lora):
    """Replaying the first and the last decode step, the ones between grown over, equals replaying every step."""
    cfg = config("llama", rows, prompt, completion, Finetune(4) if lora else FULL)
    every = replay(cfg, rows, every_step=True)[0]
    assert generation(cfg, rows) == every
    assert every.cache_bytes == 2 * 2 * rows * 2 * 16 * (prompt + completion - 1) * 2  # layers, k and v, bf16


JOB = ("--model", "llama3.2-1b", "--rl", "grpo", "--lora", "16", "--seq", "4096", "--completion-len", "3584",
       "--num-generations", "4", "--tricks", "bf16,flash,ckpt", "--gpu", "rtx4090")  # fmt: skip


def test_the_rollout_phase_is_the_state_and_generate():
    """Rows: per_device_train_batch_size x steps_per_generation; the phase: the state between steps + generate's
    peak; its cache: 2 x layers x kv heads x head_dim x 2 bytes per token of every row."""
    out = estimate_json(*JOB, "--micro-batch", "4", "--grad-accum", "16")
    rollout, verdict = out["rollout"], out["verdict"][0]
    gen, phase = rollout["generations"][0], rollout["phases"][0]
    assert rollout["engine"] is None and gen["rows"] == 64 and (gen["prompt_len"], gen["completion_len"]) == (512,
                                                                                                            3584)
    assert gen["cache_bytes"] == 64 * (512 + 3584 - 1) * 2 * 16 * 8 * 64 * 2 and gen["peak_at"] == "decode"
    assert phase["rollout_bytes"] == verdict["state_bytes"] + gen["peak_bytes"]
    assert phase["rollout_bytes"] > phase["train_bytes"]  # the cache of 64 rows outgrows the step here


def test_a_rollout_that_does_not_fit_is_said():
    """Eleven rows per micro-batch: the step fits a 24 GB card, the generation batch's cache does not."""
    out = CliRunner().invoke(app, ["estimate", *JOB, "--micro-batch", "11", "--grad-accum", "16"])
    assert out.exit_code == 0, out.output
    assert "The step fits:" in out.output and "but the rollout (the trainer's state beside the policy's own " \
        "generate) needs" in " ".join(out.output.split())  # fmt: skip


def test_eager_attention_is_not_sized():
    """A trick set without flash (eager attention, not replayed in generate): the section says why."""
    result = CliRunner().invoke(app, ["estimate", *JOB[:-4], "--tricks", "bf16", "--gpu", "h100-sxm", "--seq", "1024",
                                      "--completion-len", "512", "--micro-batch", "4"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "not sized: the policy's own generate is replayed with SDPA's kernels" in " ".join(result.output.split())


def test_rloo_generates_the_same():
    """RLOOTrainer's generate is GRPOTrainer's (its _generate_single_turn): the same phase for the same batch."""
    batch = ("--micro-batch", "4", "--grad-accum", "4")
    grpo = estimate_json(*JOB, *batch)["rollout"]["generations"][0]
    rloo = estimate_json(*JOB[:3], "rloo", *JOB[4:], *batch)["rollout"]["generations"][0]
    assert grpo == rloo


@pytest.mark.slow("test_generate_allocation_by_allocation and test_scoring.py's (the same measurements, the "
                   "harnesses verify calls)")  # fmt: skip
def test_verify_measures_generate_and_scoring():
    """memcalc verify --rl rloo without --vllm: a row for generate and one for the scoring passes (RLOO's policy and
    reference at its beta 0.05), each measured beside its replay, exact."""
    pytest.importorskip("trl")
    result = CliRunner().invoke(app, ["verify", "--model", "llama3.2-1b", "--layers", "2", "--seq", "128", "--lora",
                                      "8", "--rl", "rloo", "--completion-len", "64", "--tricks", "bf16,flash,ckpt",
                                      "--format", "json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output)["rows"] if "own generate" in r["quantity"] or "scoring" in
            r["quantity"]]  # fmt: skip
    assert len(rows) == 2 and all(r["exact"] == r["measured"] > 0 and r["passed"] for r in rows), rows


FIT_JOB = (*JOB[:10], "--micro-batch", "4", "--grad-accum", "16", *JOB[10:])


def phases_fit(*args: str) -> bool:
    return estimate_json(*args)["rollout"]["phases"][0]["fits"]


@pytest.mark.slow("test_a_rollout_that_does_not_fit_is_said (the same phase the fit's search checks)")
def test_fit_stops_where_the_rollout_does():
    """fit's limits where the rollout, not the step, ends them: estimate's phases fit at each and not one past."""
    result = CliRunner().invoke(app, ["fit", *FIT_JOB, "--format", "json"])
    assert result.exit_code == 0, result.output
    limits = json.loads(result.output)
    assert limits["seq_bound_by"] == limits["batch_bound_by"] == "rollout"
    seq, batch = limits["max_seq_len"], limits["max_micro_batch"]
    at_seq = [*FIT_JOB[:7], str(seq), *FIT_JOB[8:]]
    assert phases_fit(*at_seq) and not phases_fit(*FIT_JOB[:7], str(seq + 1), *FIT_JOB[8:])
    assert phases_fit(*FIT_JOB[:11], str(batch), *FIT_JOB[12:])
    assert not phases_fit(*FIT_JOB[:11], str(batch + 1), *FIT_JOB[12:])  # one more row per micro-batch


@pytest.mark.parametrize("model,rows,seq,completion,finetune", [
    ("llama3-8b", 16, 2048, 1536, Finetune(16)),  # the peak in the last decode step
    ("qwen2.5-7b", 8, 1536, 1024, Finetune(16)),  # in the prefill
    ("qwen3-8b", 4, 1024, 1, Finetune(16, quantize="nf4")),  # one new token: no decode step
    ("llama3.2-1b", 3, 512, 2, FULL),
])  # fmt: skip
def test_two_depths_carry_to_the_full_depth(model, rows, seq, completion, finetune):
    """generation's peaks from two short replays, carried along the depth, equal the full-depth replay's."""
    from memcalc.exact.base.config import StepConfig
    from memcalc.model.presets import PRESETS

    online = OnlineRL(completion_len=completion, num_generations=2)
    stack = with_rl(replace(STACKS["trl:1.16"], finetune=finetune, recipe="pure"), "grpo", online=online)
    cfg = StepConfig(PRESETS[model], seq, 2, parse_tricks("bf16,flash,ckpt"), stack)
    assert generation(cfg, rows) == replay(cfg, rows)[0]
