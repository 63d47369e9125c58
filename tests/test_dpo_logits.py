"""TRL 1.3-1.13's DPOTrainer (--stack trl:1.5 to trl:1.13 --rl dpo): memcalc.exact.hf.dpo_logits equals the release
itself, trl 1.6.0 and 1.5.1 installed apart (`pip install --target`) and run in their own process (tests/trl_release.py:
verify/trl_dpo.py's _compute_loss and model preparation, allocation by allocation on CPU tensors under the Trainer's
autocast); selective_log_softmax's 16-bit path (the pure recipe's) equals TRL's function on CPU tensors; the CLI
answers on those lines and refuses what it does not replay.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.model.stacks import DPO_LOGITS
from tests.trl_release import assert_release


@pytest.mark.slow("test_selective_log_softmax_as_trl (the log-probabilities, forward and backward, as TRL runs them)")
def test_trl_1_6_itself():
    """1.6-1.13's _compute_loss (views of the shifted logits): a full fine-tune beside its reference model, LoRA
    beside its disabled adapters, QLoRA, a tied head, the reference's log-probs precomputed."""
    assert_release("1.6.0", "dpo:1.6:llama:bf16:full", "dpo:1.6:llama:bf16,flash,ckpt:lora",
                   "dpo:1.6:llama:bf16,flash,ckpt:qlora", "dpo:1.6:llama-mha-tied:bf16:full",
                   "dpo:1.6:llama:bf16,flash,ckpt:full:precompute")


@pytest.mark.slow("test_selective_log_softmax_as_trl")
def test_trl_1_5_itself():
    """1.3-1.5's (their .contiguous() copies), with Qwen3's norms too."""
    assert_release("1.5.1", "dpo:1.5:llama:bf16:full", "dpo:1.5:qwen3:bf16,flash,ckpt:lora")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_selective_log_softmax_as_trl(dtype):
    """TRL's selective_log_softmax (1.16's runs the same loops on CPU tensors as 1.3-1.13's) over a shifted logits
    view, then the masked zeroing and the sum, forward and backward: the same allocations as the replay's."""
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("trl.trainer.utils")
    from memcalc.exact import aten
    from memcalc.exact.hf import dpo_logits
    from memcalc.exact.sim.graph import Graph
    from memcalc.exact.sim.tensors import LiveBytes
    from tests.replay import assert_same_allocations
    from verify.track import LiveBytes as Tracker

    B, T, V, types = 4, 9, 32, {"bf16": torch.bfloat16, "fp32": torch.float32}
    logits = torch.randn(B, T, V, dtype=types[dtype], requires_grad=True)
    ids, mask = torch.randint(0, V, (B, T)), torch.ones(B, T, dtype=torch.long)
    with Tracker("cpu", timeline=True) as live:
        live.track([logits, ids, mask])
        live.base = live.live_bytes
        per_token = utils.selective_log_softmax(logits[..., :-1, :], ids[..., 1:])
        per_token[mask[..., 1:] == 0] = 0.0
        per_token.sum(dim=1).sum().backward()
        del per_token
    g = Graph(LiveBytes(timeline=[]))
    g.watched = True  # as the tracker's dispatch mode sees it: gather's backward out of place
    x = g.leaf(g.empty((B, T, V), dtype, "input", kind="input"))
    idx, m = g.empty((B, T), "int64", "input", kind="input"), g.empty((B, T), "int64", "input", kind="input")
    with g.scoped("loss"):
        shifted = dpo_logits.shifted_logits(g, x, copy=False)
        per_token = dpo_logits.selective_log_softmax(g, shifted, g.view(idx, (B, T - 1)), watched=True)
        dpo_logits.zero_masked(g, per_token, g.view(m, (B, T - 1)), "cpu")
        g.backward(aten.sum_all(g, aten.sum_last(g, per_token)))
    assert_same_allocations(g.mem, "gather" if dtype == "fp32" else "_log_softmax", live)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.slow("test_the_full_logits_cost_more_than_the_fused_head (trl:1.6), tests/test_dpo.py's property test and "
                  "tests/test_rl_report.py (trl:1.5 and 1.6)")
@pytest.mark.parametrize("line", DPO_LOGITS)
def test_every_line_answers(line):
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "512", "--micro-batch", "2", "--lora", "8", "--tricks",
            "bf16,flash,ckpt", "--gpu", "rtx4090", "--stack", f"trl:{line}", "--rl", "dpo")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "DPOTrainer (sigmoid loss): each pair's chosen and rejected sequences to their full" in " ".join(
        r.output.split())


def test_the_full_logits_cost_more_than_the_fused_head():
    """The same job on 1.6 (every position's logits, an fp32 copy, log-softmax rows saved) and on 1.16 (none)."""
    from tests.test_exact_verdict import estimate_json

    job = ("--model", "llama3.2-1b", "--seq", "1024", "--micro-batch", "2", "--lora", "8", "--tricks",
           "bf16,flash,ckpt", "--gpu", "rtx4090", "--rl", "dpo")  # fmt: skip
    old, new = (estimate_json(*job, "--stack", s)["verdict"][0]["peak_bytes"] for s in ("trl:1.6", "trl:1.16"))
    assert old > new + 2 * 2 * 1023 * 128256 * 4  # at least the policy's fp32 logits copy


@pytest.mark.parametrize("args,said", [
    (("--stack", "trl:1.14"), "replayed on --stack trl:1.5, trl:1.6"),
    (("--stack", "trl:1.2"), "not --stack trl:1.2"),
    (("--stack", "trl:1.6", "--liger"), "LigerFusedLinearDPOLoss"),
    (("--stack", "trl:1.7", "--loss", "chunked_nll"), "DPOTrainer's own loss"),
])  # fmt: skip
def test_refused(args, said):
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "512", "--lora", "8", "--rl", "dpo", *args)
    assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output


def test_the_toolbox_names_the_pairs_it_keeps():
    """A DPO step that fits once its micro-batch is one pair says so (Setup.samples counts pairs)."""
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "2048", "--lora", "16", "--rl", "dpo", "--tricks",
            "bf16,flash,ckpt", "--gpu", "l4", "--micro-batch", "32")  # fmt: skip
    said = " ".join(r.output.split())
    assert "Cheapest combination that fits: bf16+flash+ckpt, micro-batch 1 x 32 accumulation" in said
