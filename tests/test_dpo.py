"""TRL 1.16's DPOTrainer (--stack trl:1.16 --rl dpo, issue 43): memcalc.exact.hf.dpo equals trl 1.16 itself
(DPOTrainer._compute_loss over its fused LM head, Transformers and PEFT: verify/trl_dpo.py) allocation by
allocation on meta, and on CPU tensors under the Trainer's autocast; --micro-batch counts pairs.
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
from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.rl import with_rl
from memcalc.model.stacks import STACKS, stack_for
from tests.test_fuzz import examples

LORA, QLORA = Finetune(4), Finetune(4, quantize="nf4")


def dpo(finetune: Finetune = LORA, recipe: str = "pure", precompute_ref: bool = False):
    return replace(STACKS["trl:1.16"], finetune=finetune, recipe=recipe, rl="dpo", precompute_ref=precompute_ref)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("name,tricks,finetune,rows,precompute", [
    ("llama", "bf16", LORA, 2, False),  # one pair: its chosen and rejected sequences
    ("llama", "bf16,flash,ckpt", QLORA, 4, False),  # the reference forward with checkpointing turned off
    ("qwen3", "bf16,flash,ckpt", LORA, 2, False),
    ("llama", "bf16", Finetune(4, dora=True), 2, False),  # disabled adapters: DoRA's magnitude unused too
    ("llama", "bf16", LORA, 2, True),  # precompute_ref_log_probs: no reference forward
    ("llama", "bf16,flash,ckpt", Finetune(), 4, True),  # a full fine-tune, no reference model
    ("llama", "bf16,flash,ckpt", Finetune(), 2, False),  # a full fine-tune: the reference a second model
    ("llama-mha-tied", "bf16", Finetune(), 2, False),
])  # fmt: skip
def test_allocation_by_allocation(name, tricks, finetune, rows, precompute):
    pytest.importorskip("trl")
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    assert_watched_meta(TINY[name], tricks, dpo(finetune, precompute_ref=precompute), batch=rows)


def test_reentrant_checkpointing():
    """gradient_checkpointing_kwargs={"use_reentrant": True}: DPOTrainer turns checkpointing off for the reference and
    on again with the same arguments, so the next step's policy checkpoints reentrantly still."""
    pytest.importorskip("trl")
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    for finetune in (LORA, Finetune()):
        assert_watched_meta(TINY["llama"], "bf16,flash,ckpt", replace(dpo(finetune), reentrant=True), batch=2)


@pytest.mark.parametrize("name,tricks,finetune,rl,precompute", [
    ("llama", "bf16", LORA, "", False),  # SFTTrainer: Liger's layers beside TRL's own fused LM head
    ("qwen3", "bf16,flash,ckpt", QLORA, "", False),
    ("llama", "bf16,flash,ckpt", LORA, "dpo", False),  # the reference, its adapters disabled, through them too
    ("llama", "bf16", Finetune(), "dpo", True),
])  # fmt: skip
def test_liger_beside_the_fused_head(name, tricks, finetune, rl, precompute):
    """TRL from 1.15 with use_liger_kernel: the Trainer applies Liger's RMSNorm, RoPE and SwiGLU with
    liger_kernel_config fused_linear_cross_entropy False (TRL sets it: its fused LM head stays the model's forward)."""
    pytest.importorskip("trl")
    pytest.importorskip("liger_kernel")
    from memcalc.model.savers import ON_META, Savers
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    stack = replace(dpo(finetune, precompute_ref=precompute), rl=rl, savers=Savers(liger=ON_META))
    assert_watched_meta(TINY[name], tricks, stack, batch=2)


def test_cpu_under_autocast():
    """TRL's default (bf16=True: Accelerate's autocast over the bf16 base): the reference's call goes through the
    prepared forward too."""
    pytest.importorskip("trl")
    from tests.replay import assert_watched_cpu
    from tests.test_stack_hf import TINY

    assert_watched_cpu(TINY["llama"], dpo(recipe="autocast"), "bf16")
    assert_watched_cpu(TINY["llama"], dpo(Finetune(), "autocast", precompute_ref=True), "bf16")  # fp32 weights
    assert_watched_cpu(TINY["llama"], dpo(Finetune(), "autocast"), "bf16")  # and an fp32 reference beside them


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
    (["--stack", "trl:1.16", "--liger"], "--liger and a second model"),
    (["--stack", "trl:1.16", "--lora", "8", "--modules-to-save", "lm_head"], "--modules-to-save"),
    (["--stack", "trl:1.16", "--precompute-ref", "--rl", "dpo", "--model", "gpt2"], "dropout"),
    (["--stack", "trl:1.16", "--gpus", "4", "--zero", "2"], "DeepSpeed engine of its own"),
])  # fmt: skip
def test_refused(args, said):
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "512", *args, "--rl", "dpo")
    assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, r.output


def test_the_stack_is_trl_1_16_unless_typed():
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "512", "--lora", "8", "--rl", "dpo", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["setup"]["stack"]["key"] == "trl:1.16"


def test_unknown_rl():
    with pytest.raises(InputError, match="unknown --rl"):
        with_rl(replace(stack_for("trl:1.16"), finetune=LORA), "sft")
    with pytest.raises(InputError, match="QLoRA, DoRA"):
        with_rl(replace(stack_for("trl:1.12"), finetune=replace(LORA, dora=True)), "ppo")


def test_dropout_is_disabled():
    """DPOConfig.disable_dropout: LoRA's dropout too (disable_dropout_in_model sets every nn.Dropout's p to 0)."""
    stack = with_rl(replace(stack_for("trl:1.16"), finetune=Finetune(8, lora_dropout=0.1)), "dpo")
    assert stack.rl == "dpo" and stack.finetune.lora_dropout == 0.0


def test_sweep_counts_pairs():
    """--sweep micro-batch=1,2 under --rl dpo: the same verdicts as --micro-batch 1 and 2 (pairs)."""
    args = ["estimate", "--model", "llama3.2-1b", "--stack", "trl:1.16", "--lora", "8", "--rl", "dpo", "--tricks",
            "bf16,flash,ckpt", "--seq", "512", "--format", "json"]  # fmt: skip
    swept = json.loads(run(*args, "--sweep", "micro-batch=1,2").stdout)["points"]
    for point in swept:
        one = json.loads(run(*args, "--micro-batch", str(point["value"])).stdout)["verdict"][0]
        assert point["memory_bytes"] == one["total_bytes"]


@pytest.mark.slow("test_sweep_counts_pairs (the same verdicts, in pairs)")
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


def test_precompute_ref():
    """--precompute-ref: no reference forward, so the forward holds no more and the step is shorter; a full
    fine-tune keeps no second model; alone it is refused."""
    args = ["estimate", "--model", "llama3.2-1b", "--seq", "512", "--stack", "trl:1.16", "--tricks",
            "bf16,flash,ckpt", "--rl", "dpo", "--format", "json"]  # fmt: skip
    with_ref, pre = run(*args, "--lora", "8"), run(*args, "--lora", "8", "--precompute-ref")
    full, full_ref = run(*args, "--precompute-ref"), run(*args)
    assert with_ref.exit_code == pre.exit_code == full.exit_code == full_ref.exit_code == 0, full_ref.output
    forward = [json.loads(r.stdout)["verdict"][0]["phases"]["forward_peak_bytes"] for r in (with_ref, pre)]
    seconds = [json.loads(r.stdout)["time"][0]["step_seconds"] for r in (with_ref, pre)]
    assert forward[1] <= forward[0] and seconds[1] < seconds[0]
    assert json.loads(full.stdout)["setup"]["stack"]["precompute_ref"] is True
    weights = [json.loads(r.stdout)["verdict"][0]["phases"]["weights_bytes"] for r in (full, full_ref)]
    assert weights[1] == 2 * weights[0]  # a second copy (fp32 under autocast), its rotary tables too
    alone = run("estimate", "--model", "llama3.2-1b", "--precompute-ref")
    assert alone.exit_code == 2 and "give --rl dpo" in alone.output


@pytest.mark.parametrize("tricks,layers,precompute", [("bf16,flash,ckpt", 6, False), ("bf16", 5, False),
                                                      ("bf16,flash,ckpt", 7, True)])  # fmt: skip
def test_grown_step_equals_the_full_depth_replay(tricks, layers, precompute):
    """The verdict grows the step from two short ones (memcalc.exact.growth): the reference forward's blocks peak
    apart from the policy's (their own segments), and the grown phases equal the replay at full depth."""
    from memcalc.exact.base.config import StepConfig
    from memcalc.exact.replay.meta import simulate
    from memcalc.exact.step import exact_step
    from memcalc.model.presets import PRESETS
    from memcalc.model.tricks import parse_tricks

    shape, run_as = replace(PRESETS["llama3.2-1b"], n_layers=layers), parse_tricks(tricks)
    stack = replace(dpo(Finetune(8)), precompute_ref=precompute)
    assert exact_step(shape, 512, 2, run_as, stack=stack).phases == simulate(StepConfig(shape, 512, 2, run_as,
                                                                                          stack))[0]  # fmt: skip


DPO_FILE = """model_name_or_path: meta-llama/Llama-3.2-1B
per_device_train_batch_size: 2
max_length: 512
beta: 0.1
loss_type: sigmoid
precompute_ref_log_probs: {precompute}
use_peft: true
lora_r: 16
lora_target_modules: [q_proj, v_proj]
"""


@pytest.mark.parametrize("precompute", [False, True])
def test_a_dpo_config_file(tmp_path, precompute):
    """`trl dpo --config FILE`'s DPOConfig under --rl dpo: the same verdict as its options typed out; without --rl
    dpo its DPO keys are refused (memcalc would answer for SFT)."""
    path = tmp_path / "dpo.yaml"
    path.write_text(DPO_FILE.format(precompute=str(precompute).lower()))
    r = run("estimate", "--from", str(path), "--rl", "dpo", "--model", "llama3.2-1b", "--format", "json")
    typed = run("estimate", "--model", "llama3.2-1b", "--stack", "trl:1.16", "--rl", "dpo", "--micro-batch", "2",
                "--seq", "512", "--lora", "16", "--lora-targets", "q,v", "--tricks", "bf16,flash,ckpt", "--format",
                "json", *(["--precompute-ref"] if precompute else []))  # fmt: skip
    assert r.exit_code == 0 and typed.exit_code == 0, r.output + typed.output
    assert json.loads(r.stdout)["verdict"] == json.loads(typed.stdout)["verdict"]
    alone = run("estimate", "--from", str(path), "--model", "llama3.2-1b")
    assert alone.exit_code == 2 and "give --rl dpo" in alone.output and "Traceback" not in alone.output


def test_a_dpo_config_it_does_not_replay(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text(DPO_FILE.format(precompute="false") + "use_weighting: true\n")
    r = run("estimate", "--from", str(path), "--rl", "dpo", "--model", "llama3.2-1b")
    assert r.exit_code == 2 and "use_weighting" in r.output and "Traceback" not in r.output, r.output


@examples(3, slow=10)
@given(model=st.sampled_from(["llama3.2-1b", "qwen3-0.6b"]), seq=st.sampled_from(["256", "1024"]),
       pairs=st.sampled_from([1, 2]), how=st.sampled_from([["--lora", "8"], ["--lora", "8", "--quantize", "nf4"],
                                                            ["--precompute-ref"], []]),
       tricks=st.sampled_from(["bf16,flash,ckpt", "bf16,flash"]),
       stack=st.sampled_from(["trl:1.16", "trl:1.6", "trl:1.5"]))  # fmt: skip
def test_dpo_jobs_say_one_verdict_and_grow_with_the_pairs(model, seq, pairs, how, tricks, stack):
    """Every DPO job, on the fused head (1.16) or the full logits (1.3-1.13): table, JSON and CSV give the same
    verdict; one pair more never needs less."""
    args = ["estimate", "--model", model, "--seq", seq, "--stack", stack, "--rl", "dpo", *how, "--tricks",
            tricks, "--gpu", "rtx4090"]  # fmt: skip
    data = json.loads(run(*args, "--micro-batch", str(pairs), "--format", "json").stdout)
    more = json.loads(run(*args, "--micro-batch", str(pairs + 1), "--format", "json").stdout)
    v = data["verdict"][0]
    assert more["verdict"][0]["peak_bytes"] > v["peak_bytes"]
    rows = list(csv.DictReader(io.StringIO(run(*args, "--micro-batch", str(pairs), "--format", "csv").stdout)))
    assert (rows[0]["fits"], int(rows[0]["peak_bytes"])) == (str(v["fits"]), v["peak_bytes"])
    table = " ".join(run(*args, "--micro-batch", str(pairs)).stdout.split())
    assert ("Fits: " in table) == v["fits"] and f"micro-batch {pairs} pair" in table
