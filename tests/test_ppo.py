"""--rl ppo: TRL 1.3-1.12's PPOTrainer (trl.experimental.ppo; memcalc.exact.hf.ppo, ppo_rollout). The replay's PPO
epoch and rollout equal PPOTrainer.train() itself, trl 1.12.0 and 1.5.1 installed apart and run in their own process
(tests/trl_release.py: every allocation of a steady epoch and of the next update's rollout on CPU tensors, and what
the trainer holds when each starts); what it holds between steps is the trainer's four models, the trained two's
AdamW state and the rollout's tensors, counted here from the trainer's code, a smaller critic's included; the CLI
answers on every line and refuses what is not replayed.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.exact.base.config import StepConfig
from memcalc.exact.replay.meta import simulate
from memcalc.model.params import n_params
from memcalc.model.rl import PPO_LINE, PPO_LINES, Ppo
from memcalc.model.stacks import STACKS
from memcalc.model.tricks import parse_tricks
from tests.test_fuzz import examples
from tests.test_stack_hf import TINY
from tests.trl_release import assert_release


@pytest.mark.slow("test_what_the_trainer_holds (its models, their state and the rollout's tensors), "
                  "test_the_rollout_grows_its_middle_steps")
def test_trl_1_12_itself():
    """Llama at fp32 with SDPA, Qwen2's biases (their own optimizer group) in bf16 over three micro-batches, Qwen3's
    norms at one, a tied head over four; LoRA (PEFT's policy, no reference model, the value model whole) on Llama
    and Qwen3; a critic (--critic) narrower and shallower than the policy, and one of another architecture. With
    flash, the second update's rollout too (generate, the scoring loop, GAE), beside what the first update left, in
    one chunk and in several (local_rollout_forward_batch_size 3 of 4 rows: the last padded; 2 of 6)."""
    assert_release("1.12.0", "ppo:1.12:llama:fp32,flash:full:2", "ppo:1.12:qwen2:bf16:full:3",
                   "ppo:1.12:qwen3:bf16,flash:full:1", "ppo:1.12:llama-mha-tied:bf16,flash:full:4",
                   "ppo:1.12:llama:bf16,flash:lora:2", "ppo:1.12:qwen3:bf16:lora:3",
                   "ppo:1.12:llama:bf16,flash:lora:2:narrow", "ppo:1.12:qwen3:bf16:full:2:llama-mha-tied",
                   "ppo:1.12:llama:bf16,flash:full:2:chunk3", "ppo:1.12:qwen3:bf16,flash:lora:3:narrow:chunk2")


@pytest.mark.slow("test_every_line_answers (the same loop on each line, the replay the same)")
def test_trl_1_5_itself():
    """1.3-1.5's release, whose helpers (get_reward, first_true_indices, selective_log_softmax) are the oldest the
    lines replay: the PPO epoch and, over several chunks, the rollout."""
    assert_release("1.5.1", "ppo:1.5:llama:bf16,flash:full:2:chunk3", "ppo:1.5:qwen3:bf16,flash:lora:2")


@pytest.mark.parametrize("line", PPO_LINES)
def test_every_line_answers(line):
    """1.3.0 to 1.12.0 ship the same PPO loop (diffed; 1.3.0, 1.5.1, 1.6.0, 1.7.0, 1.8.0, 1.9.2, 1.10.0, 1.11.0 and
    1.12.0 each held to the replay by tests.trl_release), so every line answers alike."""
    args = ("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "256", "--rl", "ppo", "--tricks",
            "bf16,flash", "--format", "json")  # fmt: skip
    on_line = json.loads(run(*args, "--stack", f"trl:{line}").stdout)["verdict"][0]["peak_bytes"]
    assert on_line == json.loads(run(*args).stdout)["verdict"][0]["peak_bytes"]


def config(shape, tricks: str = "bf16,flash", batch: int = 2, accumulation: int = 2, seq: int = 48,
           ppo: Ppo = Ppo(16)) -> StepConfig:  # fmt: skip
    stack = replace(STACKS[f"trl:{PPO_LINE}"], rl="ppo", loss="full", use_cache=True, recipe="pure", ppo=ppo)
    return StepConfig(shape, seq, batch, parse_tricks(tricks), stack, "adamw", accumulation, device="cuda")


def test_what_the_trainer_holds():
    """Between steps (trl/experimental/ppo/ppo_trainer.py @ 1.12.0, PPOTrainer.__init__ and train()): the policy,
    its reference copy, the value and reward models (AutoModelForSequenceClassification: the backbone and a
    1 x hidden score, no LM head), each with its two fp32 rotary buffers; AdamW's exp_avg and exp_avg_sq in the
    weights' dtype and a 0-d fp32 step per tensor for the two that train; and the rollout's tensors: the stats
    (seven (epochs, 1, accumulation) fp32), the loader's batch and the one it prefetched, the generated ids, the
    generation's fp32 scores (B x C x V: the largest), the last chunk's locals, fourteen (B, C) and five (B,)
    tensors, each GAE step's advantage and its delta, the previous mini-batch's vf_loss_max."""
    shape = TINY["llama"]
    B, A, T, C = 2, 3, 48, 16
    phases = simulate(config(shape, accumulation=A), warm_up=False)[0]
    h, V, rows = shape.hidden, shape.vocab, B * A
    policy, critic = n_params(shape), n_params(shape) - V * h + h
    rope = 2 * (shape.head_dim // 2) * 4
    weights = 2 * (2 * policy + 2 * critic) + 4 * rope
    tensors = 2 * (shape.n_layers * 9 + 3)  # each model's: embedding, 9 per layer, norm, head (or score)
    adam = 2 * 2 * (policy + critic) + 4 * tensors
    by_dtype = {"fp32": 4, "bf16": 2, "int64": 8, "bool": 1}
    held = [("fp32", 7 * 4 * 1 * A), ("int64", 2 * rows * (T - C)), ("int64", rows * T), ("fp32", rows * C * V),
            ("int64", rows * T + 2 * rows)]  # fmt: skip
    held += [(d, rows * C) for d in ("int64", "int64", "int64", "bool", "fp32", "bf16", "bool", "bf16", "fp32",
                                     "fp32", "fp32", "fp32", "fp32", "fp32")]  # fmt: skip
    held += [(d, rows) for d in ("int64", "bf16", "bool", "int64", "int64", "int64")]
    held += [("fp32", rows * (C + 1)), ("fp32", B * C)]
    rollout = sum(by_dtype[d] * n for d, n in held)
    assert phases.weights_bytes == weights
    assert phases.state_bytes == weights + adam + rollout


def test_a_smaller_critic_holds_less():
    """--critic: the value and reward models' architecture; a smaller one shrinks what the trainer holds by theirs
    (weights of both, AdamW's state of the value model), nothing else."""
    shape = TINY["llama"]
    small = replace(shape, n_layers=1, hidden=32, n_heads=2, n_kv_heads=1, ffn=48)
    same, smaller = (simulate(config(shape, ppo=Ppo(16, critic=c)), warm_up=False)[0] for c in (None, small))
    scoring = n_params(shape) - shape.vocab * shape.hidden + shape.hidden  # the backbone and a 1 x hidden score
    less = scoring - (n_params(small) - small.vocab * small.hidden + small.hidden)
    tensors = (shape.n_layers - small.n_layers) * 9  # AdamW's 0-d step per tensor of the value model
    assert same.state_bytes - smaller.state_bytes == 2 * 2 * less + 2 * 2 * less + 4 * tensors


def test_the_rollout_grows_its_middle_steps():
    """rollout_peaks grows the decode steps between the second and the last (memcalc.exact.hf.generate.grown, the
    warped scores they keep too): the same start and peaks as replaying every step."""
    from memcalc.exact.replay.ppo import simulate_rollout

    cfg = config(TINY["qwen3"], accumulation=3, ppo=Ppo(9, rollout_batch=4))  # two chunks, the second of two rows
    assert simulate_rollout(cfg, every_step=False)[0] == simulate_rollout(cfg)[0]


def test_three_micro_batches_stand_for_all():
    """The replay runs the first micro-batch, a middle one and the last (whose metrics follow the optimizer step):
    equal, every phase, to running all five."""
    cfg = config(TINY["qwen3"], accumulation=5)
    assert simulate(cfg)[0] == simulate(cfg, every_micro_batch=True)[0]


def test_longer_responses_hold_more():
    """The full logits, the rollout's scores and the response's losses grow with response_length."""
    peaks = [simulate(config(TINY["llama"], ppo=Ppo(c)), warm_up=False)[0].step_peak_bytes for c in (8, 16, 32)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_estimate_answers_on_its_line():
    """The default stack under --rl ppo is trl:1.12, pure; --completion-len is response_length, --rollout-batch
    local_rollout_forward_batch_size."""
    r = run("estimate", "--model", "qwen3-0.6b", "--seq", "512", "--rl", "ppo", "--completion-len", "64",
            "--rollout-batch", "8", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    stack = json.loads(r.output)["setup"]["stack"]
    assert (stack["key"], stack["recipe"], stack["rl"]) == ("trl:1.12", "pure", "ppo")
    assert (stack["ppo"]["completion_len"], stack["ppo"]["rollout_batch"]) == (64, 8)


@pytest.mark.parametrize("args, said", [
    (("--stack", "trl:1.16"), "replayed on --stack trl:1.5, trl:1.6, trl:1.7, trl:1.8, trl:1.9, trl:1.10, trl:1.12"),
    (("--lora", "8", "--quantize", "nf4"), "QLoRA, DoRA"),
    (("--tricks", "bf16,flash,ckpt"), "never enables it"),
    (("--recipe", "autocast"), "without mixed_precision"),
    (("--num-generations", "4"), "GRPOConfig's"),
    (("--gpus", "8", "--zero", "3"), "one GPU, or each GPU of plain data parallelism"),
    (("--completion-len", "512"), "leaves no prompt"),
])  # fmt: skip
def test_refused(args, said):
    r = run("estimate", "--model", "qwen3-0.6b", "--seq", "512", "--rl", "ppo", *args)
    assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("view", ["--exact", "--timeline", "--explain"])
def test_every_view_answers(view):
    """The views beside the verdict read the same replay (the value head's FLOPs among the step's)."""
    r = run("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "256", "--rl", "ppo", "--tricks",
            "bf16,flash", view)  # fmt: skip
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


def test_the_rollout_is_a_phase():
    """A local batch of 64 rows (the rollout chunk): the reference's logits over the whole chunk outgrow the step."""
    r = run("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "512", "--rl", "ppo", "--tricks",
            "bf16,flash", "--micro-batch", "4", "--grad-accum", "16", "--format", "json")  # fmt: skip
    data = json.loads(r.stdout)
    phase, rollout = data["rollout"]["phases"][0], data["rollout"]["ppos"][0]
    assert (rollout["rows"], rollout["chunk"]) == (64, 64)
    assert phase["score_bytes"] == rollout["score_bytes"] > phase["train_bytes"] == data["verdict"][0]["peak_bytes"]
    table = run("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "512", "--rl", "ppo", "--tricks",
                "bf16,flash", "--micro-batch", "4", "--grad-accum", "16").stdout  # fmt: skip
    assert "PPO phases per GPU" in table and "rollout peaks higher" in " ".join(table.split())


def test_a_smaller_rollout_chunk_holds_less():
    """--rollout-batch: the reference's logits over fewer rows at once."""
    args = ("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "512", "--rl", "ppo", "--tricks",
            "bf16,flash", "--micro-batch", "4", "--grad-accum", "4", "--format", "json")  # fmt: skip
    peaks = [json.loads(run(*args, "--rollout-batch", n).stdout)["rollout"]["ppos"][0]["score_bytes"]
             for n in ("16", "4")]  # fmt: skip
    assert peaks[0] > peaks[1]


def test_an_eager_rollout_is_not_sized():
    r = run("estimate", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "256", "--rl", "ppo", "--tricks", "bf16")
    assert r.exit_code == 0 and "not sized: PPOTrainer's generate is replayed with SDPA's kernels" in " ".join(
        r.stdout.split())  # fmt: skip


@pytest.mark.parametrize("option", [["--critic", "qwen3-0.6b"], ["--rollout-batch", "8"]])
def test_ppo_options_are_ppos(option):
    r = run("estimate", "--model", "qwen3-0.6b", "--seq", "512", "--rl", "grpo", *option)
    assert r.exit_code == 2 and "give --rl ppo" in r.output


def test_verify_refuses():
    r = run("verify", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "64", "--rl", "ppo")
    assert r.exit_code == 2 and "tests/test_ppo.py" in r.output


@pytest.mark.slow("test_estimate_answers_on_its_line, test_longer_responses_hold_more (the replay's growth)")
@examples(3, slow=10)
@given(model=st.sampled_from(["llama3.2-1b", "qwen3-0.6b"]), seq=st.sampled_from(["256", "1024"]),
       micro=st.sampled_from([1, 2]), accumulation=st.sampled_from(["1", "3"]),
       how=st.sampled_from([[], ["--lora", "8"], ["--lora", "8", "--critic", "qwen3-0.6b"]]),
       tricks=st.sampled_from(["bf16,flash", "fp32,flash"]))  # fmt: skip
def test_ppo_jobs_say_one_verdict_and_grow_with_the_rows(model, seq, micro, accumulation, how, tricks):
    """Every PPO job: table, JSON and CSV give the same verdict; a row more per micro-batch never needs less, nor
    does a response longer by half."""
    args = ["estimate", "--model", model, "--seq", seq, "--rl", "ppo", *how, "--tricks", tricks, "--grad-accum",
            accumulation, "--gpu", "rtx4090"]  # fmt: skip
    data = json.loads(run(*args, "--micro-batch", str(micro), "--format", "json").stdout)
    more = json.loads(run(*args, "--micro-batch", str(micro + 1), "--format", "json").stdout)
    longer = json.loads(run(*args, "--micro-batch", str(micro), "--completion-len", "80", "--format", "json").stdout)
    v = data["verdict"][0]
    assert more["verdict"][0]["peak_bytes"] > v["peak_bytes"] < longer["verdict"][0]["peak_bytes"]
    rows = list(csv.DictReader(io.StringIO(run(*args, "--micro-batch", str(micro), "--format", "csv").stdout)))
    assert (rows[0]["fits"], int(rows[0]["peak_bytes"])) == (str(v["fits"]), v["peak_bytes"])
    table = " ".join(run(*args, "--micro-batch", str(micro)).stdout.split())
    assert ("Fits: " in table) == v["fits"]

