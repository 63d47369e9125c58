"""LoRA and QLoRA on many GPUs (issue 40 item 2): FSDP2 over PEFT's LoRA model and ZeRO with a frozen base.

memcalc.exact.replay.fsdp2_lora replays one FSDP2 rank of the model accelerate shards (fully_shard per decoder
layer and the root, MixedPrecisionPolicy(bf16, fp32)); verify/fsdp2_lora.py runs the same step on PyTorch's
FSDP2 and PEFT on the fake process group. Live bytes between steps and each phase's peak: equal to the byte.
A preset at full width with two layers (every per-rank byte of a layer is full size).
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.exact.base.config import StepConfig
from memcalc.exact.replay.meta import simulate
from memcalc.exact.replay.zero import Sharding
from memcalc.model.finetune import finetune_for
from memcalc.model.presets import PRESETS
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import parse_tricks
from memcalc.parallel.engines import DEEPSPEED_DEFAULTS

LORA = finetune_for("16", None, None, None, None)


def replayed(shape, seq_len, tricks, ranks) -> dict[str, int]:
    """The fsdp2 stack's LoRA step (PEFT's model, the base loaded in bf16, no autocast), on CPU's kernels."""
    stack = replace(stack_for("fsdp2"), model="hf", recipe="pure", finetune=LORA)
    cfg = StepConfig(shape, seq_len, 1, tricks, stack, "adamw", 1, "cpu")
    p = simulate(cfg, warm_up=True, sharding=Sharding(3, ranks, fsdp2=tricks.precision))[0]
    return {"between steps": p.state_bytes + p.inputs_bytes, "forward peak": p.forward_peak_bytes,
            "backward peak": p.backward_peak_bytes, "optimizer peak": p.optimizer_peak_bytes}  # fmt: skip


@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp2_lora_equals_pytorch(ranks):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from verify.fsdp2_lora import measure_fsdp2_lora

    shape, tricks = replace(PRESETS["llama3.2-1b"], n_layers=2), parse_tricks("bf16")
    measured = measure_fsdp2_lora(shape, 256, tricks, LORA, ranks)
    got = replayed(shape, 256, tricks, ranks)
    assert got == {k: measured[k] for k in got}


@pytest.mark.parametrize("name", ["llama3-8b", "phi3-mini", "gemma2-9b"])
def test_a_backward_prefetch_is_copied_out_at_its_own_turn(name):
    """FSDP2's backward prefetch (_prefetch_unshard) issues the all-gather alone; the copy-out into the unsharded
    parameters waits for that layer's own pre_backward (wait_for_unshard). The replay made both at the prefetch,
    holding one more unsharded layer beside the one in backward: Llama-3-8B's backward peak 424 MB too high at
    seq 256 on 2 ranks (two layers at full width); equal to the byte now, Phi-3 and Gemma 2 too."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from verify.fsdp2_lora import measure_fsdp2_lora

    shape, tricks = replace(PRESETS[name], n_layers=2), parse_tricks("bf16")
    measured = measure_fsdp2_lora(shape, 256, tricks, LORA, 2)
    got = replayed(shape, 256, tricks, 2)
    assert got == {k: measured[k] for k in got}


def verdict(*args) -> dict:
    r = CliRunner().invoke(app, ["estimate", "--model", "llama3-8b", "--seq", "2048", "--tricks", "bf16,flash,ckpt",
                                 "--lora", "16", *args, "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["verdict"][0]


def test_lora_under_fsdp2_answers():
    """Was refused ("LoRA ... sharded over GPUs ... not replayed yet"): one FSDP2 rank's replay now."""
    v = verdict("--gpus", "8", "--zero", "3", "--stack", "fsdp2")
    assert "FSDP2" in v["replay"] and v["peak_bytes"] > v["state_bytes"] > 0


@pytest.mark.parametrize("quantize", [[], ["--quantize", "nf4"]])
def test_zero3_shards_the_frozen_base(quantize):
    """ZeRO-3 partitions the frozen base too (QLoRA's packed weights in bf16 storage): a rank of 8 keeps about an
    eighth of what one GPU keeps, besides DeepSpeed's reduce bucket; ZeRO-2 shards only the adapters' grads and
    state, so keeps nearly all."""
    one = verdict(*quantize)["state_bytes"]
    zero2 = verdict("--gpus", "8", "--zero", "2", *quantize)["state_bytes"]
    zero3 = verdict("--gpus", "8", "--zero", "3", *quantize)["state_bytes"] - 2 * DEEPSPEED_DEFAULTS.reduce_bucket_size
    assert one > zero2 > 0.9 * one and one / 8 <= zero3 < one / 6


@pytest.mark.parametrize("zero", [2, 3])
def test_the_trainers_zero_holds_deepspeeds_reduce_bucket(zero):
    """The Trainer's ZeRO is DeepSpeed's (accelerate), with its reduce bucket: reduce_bucket_size (5e8) elements of
    the 16-bit dtype. Stage 3 allocates it after its optimizer state and keeps it (deepspeed/runtime/zero/stage3.py
    __init__: ipg_buckets' torch.empty(reduce_bucket_size)); stage 2 at backward's first gradient, freed as
    backward ends (stage_1_and_2.py setup_buckets, _release_ipg_buffers). memcalc's generic ZeRO has none."""
    shape, tricks = replace(PRESETS["llama3.2-1b"], n_layers=2), parse_tricks("bf16,flash")
    cfg = StepConfig(shape, 256, 1, tricks, replace(stack_for("hf"), recipe="pure", finetune=LORA), "adamw", 1)
    generic = simulate(cfg, warm_up=True, sharding=Sharding(zero, 8))[0]
    deepspeed, _, mem = simulate(cfg, timeline=True, warm_up=True,
                                 sharding=Sharding(zero, 8, bucket_numel=1000, bucket_dtype="bf16"))  # fmt: skip
    held = deepspeed.state_bytes - generic.state_bytes
    events = [(phase, op, n) for phase, op, n, _ in mem.timeline if "reduce bucket" in op]
    if zero == 3:  # once, with the state, never freed
        assert held == 2000 and events == [("", "DeepSpeed reduce bucket", 2000)]
    else:  # each backward (the warm-up's, then the measured one's) allocates and frees it
        step = [("DeepSpeed reduce bucket", 2000), ("free DeepSpeed reduce bucket", -2000)]
        assert held == 0 and [(op, n) for _, op, n in events] == step * 2
        assert [phase for phase, _, _ in events[2:]] == ["backward", "backward"]


@pytest.mark.parametrize("quantize,bucket", [("nf4", 1000), (None, 1000), ("nf4", 0)])
def test_a_quantized_model_loads_whole_before_zero3_shards_it(quantize, bucket):
    """Transformers builds an unquantized model under deepspeed.zero.Init (each parameter partitioned as it is made)
    but a quantized one whole on every GPU (modeling_utils.py get_init_context: zero.Init only `if not
    is_quantized`; the bitsandbytes quantizer's device_map {"": current_device()}), and DeepSpeed's stage 3
    partitions it as the Trainer prepares it: QLoRA's load holds what one GPU's step builds. memcalc's generic
    ZeRO (no DeepSpeed: bucket 0) loads nothing whole."""
    shape, tricks = replace(PRESETS["llama3.2-1b"], n_layers=2), parse_tricks("bf16,flash")
    stack = replace(stack_for("hf"), recipe="pure", finetune=finetune_for("16", quantize=quantize))
    cfg = StepConfig(shape, 256, 1, tricks, stack, "adamw", 1)
    one = simulate(cfg, warm_up=True)[0]
    rank = simulate(cfg, warm_up=True, sharding=Sharding(3, 8, bucket_numel=bucket))[0]
    assert rank.load_bytes == (one.weights_bytes if quantize and bucket else 0)
    assert rank.run_peak_bytes == max(rank.step_peak_bytes, rank.load_bytes)


@pytest.mark.slow("test_a_quantized_model_loads_whole_before_zero3_shards_it (the load's peak, the same rule)")
def test_qlora_70b_under_zero3_peaks_as_it_loads():
    """PEFT's DeepSpeed ZeRO-3 QLoRA guide (Llama-2-70B on two 40 GB cards) says 36.6 GB per GPU: the whole 4-bit
    model before it is partitioned (benchmarks/finetune/). The verdict peaks at the load, says so, and `fit` on a
    24 GB card names the load as what does not fit."""
    args = ["--model", "llama2-70b", "--seq", "2048", "--lora", "8", "--quantize", "nf4", "--tricks",
            "bf16,flash,ckpt", "--gpus", "2", "--zero", "3"]  # fmt: skip
    r = CliRunner().invoke(app, ["estimate", *args, "--gpu", "a100-40gb", "--format", "json"])
    v = json.loads(r.stdout)["verdict"][0]
    assert v["peak_at"].startswith("load:") and v["peak_bytes"] == v["phases"]["load_bytes"] > v["state_bytes"]
    assert v["total_bytes"] >= v["peak_bytes"] > v["phases"]["step_peak_bytes"]
    page = " ".join(Path(__file__).parents[1].joinpath("docs", "finetune.md").read_text().split())
    assert (f"{v['peak_bytes'] / 1e9:.1f} GB on each GPU; its step at seq 2,048 peaks at "
            f"{v['phases']['step_peak_bytes'] / 1e9:.1f} GB") in page  # fmt: skip
    text = CliRunner().invoke(app, ["fit", *args[2:], "--model", "llama2-70b", "--gpu", "rtx4090"]).output
    assert "Nothing fits: the model's load alone is larger than the GPU" in " ".join(text.split())
    short = [*args[:2], "--seq", "256", *args[4:], "--gpu", "a100-40gb", "--timeline", "--format", "json"]
    r = CliRunner().invoke(app, ["estimate", *short])  # --timeline draws the step, held to the verdict's step peak
    assert r.exit_code == 0, r.output
    v, t = json.loads(r.stdout)["verdict"][0], json.loads(r.stdout)["timeline"][0]
    assert v["peak_at"].startswith("load:") and t["peak_bytes"] == v["phases"]["step_peak_bytes"] < v["peak_bytes"]


def test_the_hf_stacks_zero_is_deepspeeds():
    """--zero over the hf and TRL stacks replays DeepSpeed's reduce bucket; over the reference loop it is
    memcalc's generic ZeRO, with none."""
    from types import SimpleNamespace

    from memcalc.model.layout import Layout
    from memcalc.parallel.verdict import replay_sharding

    layout = Layout(dp=8, zero=3)
    bucket = DEEPSPEED_DEFAULTS.reduce_bucket_size
    for key, numel in (("hf", bucket), ("trl:1.16", bucket), ("reference", 0)):
        assert replay_sharding(SimpleNamespace(stack=stack_for(key)), layout).bucket_numel == numel


def test_tensor_parallel_lora_refused():
    r = CliRunner().invoke(app, ["estimate", "--model", "llama3-8b", "--lora", "16", "--gpus", "8", "--tp", "2"])
    assert r.exit_code == 2 and "tensor" in r.output and "Traceback" not in r.output


def test_deepspeed_lora_from_a_file(tmp_path):
    """A Trainer's arguments with PEFT and a DeepSpeed ZeRO-3 config: replayed (it was refused), the base sharded."""
    args = {"model_name_or_path": "qwen3-0.6b", "max_length": 256, "use_peft": True,
            "deepspeed": {"zero_optimization": {"stage": 3}}}  # fmt: skip
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    r = CliRunner().invoke(app, ["estimate", "--from", str(path), "--gpus", "8", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert "ZeRO-3 over 8 ranks" in json.loads(r.stdout)["verdict"][0]["replay"]


def test_verify_fsdp_lora_cli():
    """`memcalc verify --fsdp 2 --lora 16 --stack fsdp2`: the LoRA model under FSDP2, not full training's check."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    r = CliRunner().invoke(app, ["verify", "--model", "llama3.2-1b", "--layers", "2", "--seq", "256", "--lora", "16",
                                 "--stack", "fsdp2", "--fsdp", "2", "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert "PEFT's LoRA model" in r.stdout and r.stdout.count('"error_bytes": 0') >= 4, rows


def test_the_corpus_expresses_sharded_lora():
    """benchmarks/finetune/report.py: PEFT's DeepSpeed ZeRO-3 LoRA run is a `--gpus 8 --zero 3` estimate; the
    FSDP1 runs (Answer.AI's fsdp_qlora, accelerate's FSDP1) name FSDP1 as what is not replayed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from benchmarks.finetune.corpus import load
    from benchmarks.finetune.report import command

    runs = {f"{r.source.id}/{r.id}": r for r in load()}
    args = command(runs["peft_docs_accelerate/llama2-70b-lora-ds-zero3-8xh100"])
    assert args[-4:] == ["--gpus", "8", "--zero", "3"] and "--lora" in args
    assert "FSDP1" in command(runs["answerai_fsdp_qlora/llama2-7b-lora-ctx512-bs1-3090"])


def test_qlora_under_fsdp2_answers():
    """QLoRA's packed 4-bit weights shard and all-gather as their bf16 quant storage: a rank keeps less than LoRA's."""
    lora = verdict("--gpus", "8", "--zero", "3", "--stack", "fsdp2")
    qlora = verdict("--gpus", "8", "--zero", "3", "--stack", "fsdp2", "--quantize", "nf4")
    assert "FSDP2" in qlora["replay"] and qlora["state_bytes"] < lora["state_bytes"] / 2


@pytest.mark.slow("test_lora_under_fsdp2_answers (the verdict fit searches with)")
def test_fit_shards_lora():
    """fit answers LoRA under FSDP2 (some ten replays: ~10 s)."""
    r = CliRunner().invoke(app, ["fit", "--model", "llama3-8b", "--lora", "16", "--tricks", "bf16,flash,ckpt",
                                 "--stack", "fsdp2", "--gpus", "8", "--zero", "3"])  # fmt: skip
    assert r.exit_code == 0 and "Longest sequence that fits" in r.output, r.output


def test_plan_shards_lora():
    """plan searches the sharded data-parallel layouts for LoRA, ZeRO-3 alone for --stack fsdp2, and no tensor or
    pipeline parallel."""
    r = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--lora", "16", "--seq", "4096", "--gpus", "8",
                                 "--global-batch", "64", "--stack", "fsdp2", "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    layouts = [b["layout"] for b in json.loads(r.stdout)["best"]]
    assert layouts and all(x["zero"] == 3 and x["tp"] == x["pp"] == 1 for x in layouts), layouts


def test_verify_fsdp_lora_on_the_head_cli():
    """LoRA on lm_head too under FSDP2 (the head's adapters in the root's unit): equal to real FSDP2 over PEFT."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    r = CliRunner().invoke(app, ["verify", "--model", "llama3-8b", "--layers", "2", "--hidden", "256", "--heads", "4",
                                 "--kv-heads", "2", "--seq", "64", "--lora", "8", "--lora-targets", "q,v,lm_head",
                                 "--stack", "fsdp2", "--fsdp", "2", "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.count('"error_bytes": 0') >= 4, r.stdout
