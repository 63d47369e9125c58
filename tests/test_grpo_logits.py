"""TRL 1.9-1.13's GRPOTrainer (--stack trl:1.9, trl:1.10, trl:1.12, trl:1.13 --rl grpo): memcalc.exact.hf.
grpo_logits, the log-probabilities from the logits, equals each release itself, installed apart (`pip install
--target`) and run in its own process (tests/trl_release.py: verify/trl_grpo.py's GRPOTrainer._compute_loss of that
release, allocation by allocation on CPU tensors under the Trainer's autocast); gather's backward runs in place
outside a dispatch mode, as the replay's prediction takes it; the CLI answers on those lines, with each line's
defaults, and refuses what it does not replay.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.model.stacks import GRPO_LOGITS
from tests.trl_release import assert_release

# LoRA, QLoRA, a full fine-tune (fp32 weights under autocast), Qwen3's norms, a tied head, the head on every position
# (completion 23 of 24), one completion position, a short completion under QLoRA
CASES = ("llama:bf16,flash,ckpt:lora", "llama:bf16,flash,ckpt:qlora", "llama:bf16:full",
         "qwen3:bf16,flash,ckpt:lora:completion20", "llama-mha-tied:bf16:full",
         "llama:bf16,flash,ckpt:full:completion23", "llama:bf16,flash,ckpt:lora:completion1",
         "llama:bf16,flash,ckpt:qlora:completion5")  # fmt: skip
JOB = ("estimate", "--model", "qwen3-1.7b", "--rl", "grpo", "--lora", "8", "--seq", "300", "--micro-batch", "8",
       "--tricks", "bf16,flash,ckpt", "--gpu", "rtx4090")  # fmt: skip


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.slow("test_gather_backward_in_place_outside_a_dispatch_mode and test_every_line_answers (the line's "
                  "replay on the CLI)")  # fmt: skip
@pytest.mark.parametrize("version,line", [("1.13.0", "1.13"), ("1.12.0", "1.12"), ("1.10.0", "1.10"),
                                          ("1.9.2", "1.9")])  # fmt: skip
def test_each_release_itself(version, line):
    """1.10-1.13 divide the logits into a new tensor, 1.9 in place (CopySlices): every case, each release."""
    assert_release(version, *(f"grpo:{line}:{case}" for case in CASES))


def test_gather_backward_in_place_outside_a_dispatch_mode():
    """torch's gather_backward makes one zero tensor and scatter_add_s the gradient into it (FunctionsManual.cpp),
    unless a tensor is subclass-like, as every one is under a TorchDispatchMode (verify's tracker): then scatter_add
    makes a second. The profiler (no dispatch mode) sees the in-place op; the replay allocates one tensor, or two
    where watched."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    from memcalc.exact import aten
    from memcalc.exact.sim.graph import Graph
    from memcalc.exact.sim.tensors import LiveBytes

    x = torch.randn(4, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x.gather(1, torch.randint(0, 64, (4, 2))).sum().backward()
    names = [e.name for e in prof.events()]
    assert "aten::scatter_add_" in names and "aten::scatter_add" not in names
    made = {}
    for watched in (False, True):
        g = Graph(LiveBytes(timeline=[]))
        g.watched = watched
        leaf = g.leaf(g.empty((4, 64), "fp32", "input", kind="input"))
        index = g.empty((4, 2), "int64", "input", kind="input")
        g.backward(aten.sum_all(g, aten.gather(g, leaf, index)))
        made[watched] = [op for _, op, size, _ in g.mem.timeline if size == 4 * 64 * 4 and op != "input"]
    assert made == {False: ["new_zeros"], True: ["new_zeros", "scatter_add"]}


@pytest.mark.slow("test_the_in_place_division_holds_the_logits_through_backward (trl:1.9 and trl:1.10 answer) and "
                  "test_each_line_has_its_grpo_config_defaults")  # fmt: skip
@pytest.mark.parametrize("line", GRPO_LOGITS)
def test_every_line_answers(line):
    r = run(*JOB, "--stack", f"trl:{line}", "--completion-len", "256")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "GRPOTrainer (loss_type dapo): each completion's" in said and "scored from the logits" in said
    assert ("in place (logits.div_)" in said) == (line == "1.9")


def test_the_in_place_division_holds_the_logits_through_backward():
    """1.9's logits.div_ on the fp32 logits' view keeps them (the log-probs read the view) and its CopySlices makes two
    logits-sized buffers in backward: above 1.10's step, whose division frees the logits as the scoring returns."""
    peak = {}
    for line in ("1.9", "1.10"):
        r = run(*JOB, "--stack", f"trl:{line}", "--completion-len", "200", "--format", "json")
        assert r.exit_code == 0, r.output
        peak[line] = json.loads(r.stdout)["verdict"][0]["phases"]["backward_peak_bytes"]
    assert peak["1.9"] > peak["1.10"]


@pytest.mark.parametrize("line,completion", [("1.9", 256), ("1.10", 512)])
def test_each_line_has_its_grpo_config_defaults(line, completion):
    """GRPOConfig's max_completion_length: 256 up to 1.9, 512 from 1.10."""
    r = run(*JOB[:-6], "--seq", "1024", "--micro-batch", "8", "--tricks", "bf16,flash,ckpt", "--gpu", "h100-sxm",
            "--stack", f"trl:{line}")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"GRPO, {completion}-token completions" in " ".join(r.output.split())


@pytest.mark.parametrize("args,said", [
    (("--stack", "trl:1.8"), "replayed on --stack trl:1.9, trl:1.10, trl:1.12, trl:1.13, trl:1.16"),
    (("--stack", "trl:1.7"), "replayed on --stack trl:1.9"),
    (("--stack", "trl:1.12", "--vllm", "colocate"), "its vLLM generation is not replayed"),
    (("--stack", "trl:1.10", "--liger"), "GRPOTrainer's LigerFusedLinearGRPOLoss is not replayed"),
    (("--stack", "trl:1.9", "--lora-targets", "q,v,lm_head"), "LoRA on lm_head"),
])  # fmt: skip
def test_refused(args, said):
    r = run(*JOB, *args)
    assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output
