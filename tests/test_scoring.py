"""The scoring passes GRPOTrainer and RLOOTrainer run between generating and training (memcalc.exact.hf.scoring):
equal to trl 1.16's own _get_per_token_logps_and_entropies over the padded batch (verify/trl_scoring.py) allocation
by allocation on CPU tensors, and shown as the phases' score column.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.exact.hf.scoring import passes, replay, scoring
from memcalc.model.finetune import FULL, Finetune
from memcalc.model.rl import OnlineRL, with_rl
from memcalc.model.stacks import STACKS
from memcalc.model.tricks import parse_tricks
from tests.replay import assert_same_allocations
from tests.test_exact_verdict import estimate_json
from tests.test_lora import step_config
from tests.test_stack_hf import TINY

LORA = Finetune(4)
VARIANT = pytest.mark.slow("test_scoring_allocation_by_allocation's first cases (the same passes over another "
                           "model, adapter or recipe)")  # fmt: skip


def config(name: str, rl: str, chunk: int, seq: int, completion: int, beta: float, vllm: str, finetune: Finetune,
           recipe: str = "autocast"):  # fmt: skip
    online = OnlineRL(completion_len=completion, num_generations=2, beta=beta, vllm=vllm)
    stack = with_rl(replace(STACKS["trl:1.16"], finetune=finetune, recipe=recipe), rl, online=online)
    return replace(step_config(TINY[name], seq, chunk, "bf16,flash,ckpt", stack, device="cpu"), watched=True)


@pytest.mark.parametrize("name,rl,rows,beta,vllm,finetune,recipe", [
    pytest.param("llama", "grpo", 4, 0.04, "", LORA, "autocast", marks=VARIANT),  # the reference's: adapters off
    ("llama", "grpo", 8, 0.04, "colocate", FULL, "autocast"),  # the policy's, the ratio, a second model's
    ("llama", "rloo", 5, 0.05, "", LORA, "autocast"),  # RLOO's defaults; a last chunk of one row
    pytest.param("llama", "rloo", 6, 0.0, "", Finetune(4, lora_dropout=0.1), "autocast", marks=VARIANT),
    pytest.param("qwen3", "grpo", 6, 0.0, "server", LORA, "autocast", marks=VARIANT),
    pytest.param("llama", "grpo", 4, 0.04, "", Finetune(4, quantize="nf4"), "autocast", marks=VARIANT),
    pytest.param("llama", "grpo", 4, 0.04, "server", LORA, "pure", marks=VARIANT),  # bf16 weights, no autocast
])  # fmt: skip
def test_scoring_allocation_by_allocation(name, rl, rows, beta, vllm, finetune, recipe):
    """Every allocation from the padded batch to the last pass's concatenated log-probs, with the live bytes at it."""
    pytest.importorskip("trl")
    from verify.trl_scoring import measure_scoring

    cfg = config(name, rl, 2, 12, 8, beta, vllm, finetune, recipe)
    predicted, mem = replay(cfg, rows, every_chunk=True, timeline=True)
    live = measure_scoring(TINY[name], parse_tricks("bf16,flash,ckpt"), rows, 2, 12, cfg.stack.online, rl, finetune,
                           recipe == "autocast", timeline=True)  # fmt: skip
    assert_same_allocations(mem, "pad", live)
    assert predicted.peak_bytes == live.peak_bytes - live.base and predicted.passes == passes(cfg)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), chunk=st.integers(1, 4), rl=st.sampled_from(["grpo", "rloo"]),
       beta=st.sampled_from([0.0, 0.04]))  # fmt: skip
def test_the_chunks_between_stand_for_one_another(rows, chunk, rl, beta):
    """Replaying the first two chunks and the last, the log-probs of those between made, equals every chunk's."""
    cfg = config("llama", rl, chunk, 12, 8, beta, "server", LORA)
    assert scoring(cfg, rows) == replay(cfg, rows, every_chunk=True)[0]


JOB = ("--model", "qwen2.5-7b", "--rl", "grpo", "--lora", "16", "--seq", "1536", "--completion-len", "1024",
       "--micro-batch", "8", "--tricks", "bf16,flash,ckpt", "--gpu", "h100-sxm")  # fmt: skip


def test_the_score_phase_beside_the_engine():
    """With vLLM the policy's pass runs (importance sampling), beside the engine as the step has it; at --beta the
    reference's after it; GRPO's own generate at beta 0 runs none."""
    awake = estimate_json(*JOB, "--vllm", "colocate")["rollout"]
    asleep = estimate_json(*JOB, "--vllm", "colocate", "--vllm-sleep")["rollout"]
    both = estimate_json(*JOB, "--vllm", "colocate", "--beta", "0.04")["rollout"]
    none = estimate_json(*JOB)["rollout"]
    assert awake["scorings"][0]["passes"] == ["old"] and both["scorings"][0]["passes"] == ["old", "reference"]
    assert none["scorings"] == [None] and none["phases"][0]["score_bytes"] == 0
    gap = awake["engine"]["awake_bytes"] - awake["engine"]["asleep_bytes"]
    assert awake["phases"][0]["score_bytes"] - asleep["phases"][0]["score_bytes"] == gap
    assert both["scorings"][0]["peak_bytes"] >= awake["scorings"][0]["peak_bytes"]  # a pass more, none less


def test_a_score_phase_that_does_not_fit_is_said():
    """The phase's verdict names it, and the verdict sentence says so."""
    from memcalc.engine.rollout import RolloutPhases

    p = RolloutPhases(1, 10, 1, 10, 5, 10, True, 11, 10)
    assert p.failed == "score" and not p.fits and p.margin() == 1


@pytest.mark.parametrize("model,finetune,beta,vllm", [
    ("llama3-8b", Finetune(16), 0.04, "colocate"),
    ("qwen2.5-7b", FULL, 0.04, ""),  # the reference a second model
    ("qwen3-8b", Finetune(16, quantize="nf4"), 0.04, ""),
])  # fmt: skip
def test_two_depths_carry_to_the_full_depth(model, finetune, beta, vllm):
    """scoring's peak from two short replays, carried along the depth, equals the full-depth replay's (under
    autocast each layer's fp32 weights leave their 16-bit copies until the forward returns: a full fine-tune's
    whole model)."""
    from memcalc.exact.base.config import StepConfig
    from memcalc.model.presets import PRESETS

    online = OnlineRL(completion_len=1024, num_generations=2, beta=beta, vllm=vllm)
    stack = with_rl(replace(STACKS["trl:1.16"], finetune=finetune, recipe="autocast"), "grpo", online=online)
    cfg = StepConfig(PRESETS[model], 1536, 4, parse_tricks("bf16,flash,ckpt"), stack)
    assert scoring(cfg, 16) == replay(cfg, 16)[0]
