"""One time model (issue 12): layouts and plan time every stage with the roofline of its GPU's kernels, plus
the bubble and the collectives with their overlap; --mfu X is an end-to-end rate that adds nothing."""

import json
import random

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.memory.estimate import Setup
from memcalc.model.gpus import gpu
from memcalc.model.moe import Routing
from memcalc.model.presets import preset, preset_model
from memcalc.model.stacks import STACKS
from memcalc.model.tricks import Tricks
from memcalc.parallel.comm import step_lower_bound, tp_shape
from memcalc.model.layout import Layout
from memcalc.parallel.plan import layout_estimate, plan
from memcalc.time.calibration import calibration_for
from memcalc.time.stages import block_lower_bound, stage_kernels

H100 = gpu("h100-sxm")
CAL = calibration_for("h100-sxm")
FLASH = Tricks(flash=True)
LLAMA8B = preset_model("llama3-8b")
WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


def test_a_layout_of_one_gpu_is_the_one_gpu_step():
    # the issue: --tp 1 switched to 0.4 · peak and gave another step time for the same work
    args = ["estimate", "--params", "8e9", "--seq", "4096", "--tricks", "bf16,flash", "--format", "json"]
    one = json.loads(run(*args).stdout)
    layout = json.loads(run(*args, "--tp", "1").stdout)
    (time,), (layout_time,) = one["time"], layout["time"]
    assert layout_time["step_seconds"] == pytest.approx(time["step_seconds"], rel=1e-12)
    assert layout["time_model"] == one["time_model"] == "roofline"


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2", "mixtral-8x7b"])
@pytest.mark.parametrize("stack", ["reference", "torch", "hf", "fsdp2"])
@pytest.mark.parametrize("tricks", ["fp32", "bf16,flash", "bf16,flash,ckpt:3", "bf16,flash,sac"])
def test_one_gpu_s_layout_runs_the_stack_s_own_kernels(name, stack, tricks):
    """Issue 18: one path times every job, so one GPU's layout must be one GPU's roofline step for every stack
    (autocast's casts, the libraries' optimizers) and trick set (ckpt:N's two kinds of block, sac), at one
    micro-batch and more: the stage kernels were the reference stack's."""
    from memcalc.errors import InputError
    from memcalc.model.tricks import layer_uniform, parse_tricks
    from memcalc.time.roofline import rooflines

    model, t = preset_model(name), parse_tricks(tricks)
    if stack == "hf" and not layer_uniform(t):  # Transformers checkpoints every layer or none
        with pytest.raises(InputError, match="every decoder layer"):
            layout_estimate(model, Setup(1024, stack=STACKS[stack]), H100, t, Layout(), timing=CAL)
        return
    if model.shape.is_moe and stack != "reference" and not layer_uniform(t):  # not replayed: the textbook decides
        with pytest.raises(InputError, match="the textbook"):
            layout_estimate(model, Setup(1024, stack=STACKS[stack]), H100, t, Layout(), timing=CAL)
        return
    for accum in (1, 2):
        setup = Setup(1024, grad_accum=accum, stack=STACKS[stack])
        (one,) = rooflines(model, setup, H100, (t,), CAL)
        layout = layout_estimate(model, setup, H100, t, Layout(), timing=CAL).time
        assert layout.step_seconds == pytest.approx(one.step_seconds, rel=1e-12), accum


def test_stage_kernels_rescale_what_sp_cp_and_zero_split():
    shape, s = tp_shape(LLAMA8B.shape, 4), 4096
    plain = stage_kernels(shape, s, 1, FLASH, H100, CAL)
    sp = stage_kernels(shape, s, 1, FLASH, H100, CAL, sequence_split=4)
    assert sp.block_forward < plain.block_forward and sp.block_attention == plain.block_attention
    ring = stage_kernels(shape, s // 4, 1, FLASH, H100, CAL, ring=4)
    quarter = stage_kernels(shape, s // 4, 1, FLASH, H100, CAL)
    assert ring.block_attention == pytest.approx(4 * quarter.block_attention, rel=0.01)  # flash is compute-bound
    sharded = stage_kernels(shape, s, 1, FLASH, H100, CAL, optimizer_shards=8)
    assert sharded.optimizer_block < plain.optimizer_block and sharded.block_forward == plain.block_forward


def test_the_bound_never_exceeds_the_step():
    # plan times layouts in the order of step_lower_bound and skips those it proves slower
    rng = random.Random(12)
    model = preset_model("llama3-70b")
    for _ in range(25):
        tp, pp, cp = rng.choice([2, 4, 8]), rng.choice([1, 2, 4]), rng.choice([1, 2])
        b, m, rec = rng.choice([1, 2, 4]), rng.choice([4, 8]), rng.choice(["none", "full"])
        layout = Layout(tp=tp, pp=pp, cp=cp, dp=2, zero=1, sp=rng.random() < 0.5)
        setup = Setup(seq_len=8192, micro_batch=b, grad_accum=m)
        est = layout_estimate(model, setup, H100, Tricks(flash=True, recompute=rec), layout)
        exact = est.time.step_seconds
        for traced in (True, False):
            bound = step_lower_bound(model, setup, H100, est.tricks, layout, est.memory, traced=traced)
            assert 0 < bound <= exact
    shape = tp_shape(model.shape, 8)
    for b in (2, 4, 16):
        exact = stage_kernels(shape, 8192, b, FLASH, H100, CAL)
        assert block_lower_bound(shape, 8192, b, FLASH, H100, CAL) <= exact.block_forward + exact.block_backward


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_the_bound_never_exceeds_the_step_of_a_mixture_of_experts(name):
    # the bound counts the MoE layers' routed and shared experts and latent attention at their own width,
    # the all-to-alls no compute hides and the CPU's Adam under offload: all of them stay at or below the step
    rng = random.Random(7)
    model = preset_model(name)
    pps = [p for p in (1, 2) if model.shape.n_layers % p == 0]  # a MoE's stages are even
    for _ in range(6):
        tp, cp, ep = rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.choice([1, 8, 16])
        offload = rng.random() < 0.3
        layout = Layout(tp=tp, pp=1 if offload else rng.choice(pps), cp=cp, dp=16, zero=3 if offload else 1, sp=tp > 1, ep=ep,
                        offload_optimizer=offload)  # fmt: skip
        routing = rng.choice([Routing(), Routing(capacity_factor=0.5), Routing(imbalance=1.5)])
        setup = Setup(seq_len=4096, micro_batch=rng.choice([1, 2]), grad_accum=rng.choice([2, 4]), routing=routing)
        tricks = Tricks(flash=True, recompute=rng.choice(["none", "full"]))
        est = layout_estimate(model, setup, H100, tricks, layout)
        for traced in (True, False):
            bound = step_lower_bound(model, setup, H100, tricks, layout, est.memory, traced=traced)
            assert 0 < bound <= est.time.step_seconds, (layout, setup, tricks, traced)


@pytest.mark.parametrize("name, gpus, seq, batch", [("llama3-8b", 16, 4096, 64), ("qwen3-0.6b", 8, 2048, 32),
                                                   ("qwen3-30b-a3b", 8, 2048, 16)])
def test_pruning_changes_nothing(name, gpus, seq, batch):
    pruned = plan(preset_model(name), H100, gpus, seq, batch)
    every = plan(preset_model(name), H100, gpus, seq, batch, prune=False)
    assert [(e.layout, e.setup, e.tricks) for e in pruned.best] == [(e.layout, e.setup, e.tricks) for e in every.best]
    assert [e.time.step_seconds for e in pruned.best] == [e.time.step_seconds for e in every.best]
    assert [(a.name, a.estimate.layout, a.cause) for a in pruned.alternatives] == [
        (a.name, a.estimate.layout, a.cause) for a in every.alternatives]  # fmt: skip
    assert pruned.fitting == every.fitting


@pytest.mark.slow("tests/test_cli.py::test_plan_ranks_layouts_that_fit (the plan's ranking by tokens/s)")
def test_plan_ranks_flash_above_eager():
    # the issue: the FLOP count made eager attention (selective recompute) look faster than flash
    model = preset_model("llama3-8b")
    flash = plan(model, H100, 8, 8192, 32).best[0].time
    eager = plan(model, H100, 8, 8192, 32, tricks=Tricks("bf16")).best[0].time
    assert flash.tokens_per_second > 1.1 * eager.tokens_per_second


def test_mfu_is_an_end_to_end_rate():
    # --mfu X: hardware FLOPs at X of peak on every GPU; the bubble, the traffic and the optimizer are in X
    setup = Setup(seq_len=4096, grad_accum=8)
    est = layout_estimate(LLAMA8B, setup, H100, FLASH, Layout(tp=4, pp=2, dp=2, zero=1, sp=True), timing=0.5)
    t = est.time
    assert t.time_model == "mfu" and t.bubble_seconds == t.exposed_comm_seconds == t.optimizer_seconds == 0
    assert t.comms and all(c.seconds > 0 for c in t.comms)  # still listed, with their bytes and times
    assert t.step_seconds == pytest.approx(t.hardware_flops_per_step / (16 * 0.5 * t.peak_flops), rel=1e-12)
    assert t.hfu == pytest.approx(0.5, rel=1e-12)
    out = run("estimate", "--model", "llama3-8b", "--tp", "4", "--pp", "2", "--gpus", "16", "--tricks", "bf16,flash",
              "--mfu", "0.5", "--detail")  # fmt: skip
    assert out.exit_code == 0 and "end-to-end rate: the bubble, the traffic and the optimizer are inside it" in out.stdout


def test_uneven_stages_time_the_slowest():
    model = preset_model("llama3.1-405b")
    setup = Setup(seq_len=8192, grad_accum=16)
    est = layout_estimate(model, setup, H100, Tricks(flash=True, recompute="full"), Layout(tp=8, pp=8, dp=2, zero=1))
    k = stage_kernels(tp_shape(model.shape, 8), 8192, 1, est.tricks, H100, CAL, 1, 1, 1, 2)
    middle = 16 * (k.block_forward + k.block_backward + k.block_recompute)
    assert est.memory.stage_layers == (15, 16, 16, 16, 16, 16, 16, 15)
    assert est.time.recompute_seconds == pytest.approx(16 * 16 * k.block_recompute)  # a 16-layer middle stage
    assert est.time.micro_batch_seconds >= middle


# ---- the engines' traffic ---------------------------------------------------------------------------------


def comms(stack, **layout):
    setup = Setup(seq_len=4096, grad_accum=4, stack=STACKS[stack])
    return {c.name: c for c in layout_estimate(LLAMA8B, setup, H100, FLASH, Layout(**layout)).time.comms}


def test_fsdp2_reduces_in_fp32_and_megatron_its_main_grad():
    ref = comms("reference", dp=8, zero=3)["ZeRO-3 gradient reduce-scatter"]
    fsdp = comms("fsdp2", dp=8)["ZeRO-3 gradient reduce-scatter"]
    assert fsdp.bytes == 2 * ref.bytes  # MixedPrecisionPolicy(reduce_dtype=fp32)
    ddp = comms("reference", dp=8)["DP gradient all-reduce"]
    assert comms("megatron", dp=8)["DP gradient all-reduce"].bytes == 2 * ddp.bytes  # fp32 main_grad
    assert comms("deepspeed", dp=8)["DP gradient all-reduce"].bytes == ddp.bytes


def test_the_last_bucket_is_exposed():
    # Megatron-LM's last bucket (40M parameters at dp 8) is reduced after the backward ends
    c = comms("megatron", dp=8)["DP gradient all-reduce"]
    params = LLAMA8B.n_params
    assert c.exposed_seconds == pytest.approx(c.seconds * 40_000_000 / params, rel=1e-9)
    assert comms("reference", dp=8)["DP gradient all-reduce"].exposed_seconds == 0


def test_fsdp2_with_pipeline_parallel_gathers_and_reduces_once_per_step():
    c = comms("fsdp2", tp=2, pp=2, dp=2)
    assert [(x.name, x.calls) for x in c.values() if x.group == "dp×cp"] == [
        ("FSDP2 weight all-gather, first micro-batch", 1), ("FSDP2 gradient reduce-scatter after the last backward", 1)]
    rs = c["FSDP2 gradient reduce-scatter after the last backward"]
    assert rs.exposed_seconds == rs.seconds  # stage.py perform_reduce_grad: after the last backward
    without = comms("fsdp2", dp=8, reshard_after_forward=False)
    assert "ZeRO-3 weight all-gather, backward" not in without and "ZeRO-3 weight all-gather, backward" in comms(
        "fsdp2", dp=8)  # fmt: skip


@pytest.mark.slow("test_fsdp2_with_pipeline_parallel_gathers_and_reduces_once_per_step (the layout the plan finds)")
def test_plan_searches_fsdp_with_pipeline_parallel_for_405b():
    # FSDP2 (ZeRO-3 over dp × cp) with pipeline parallel over uneven stages: torchtitan's split gives the end
    # stages one layer fewer for the embedding and the head
    p = plan(preset_model("llama3.1-405b"), H100, 512, 8192, 512, stack=STACKS["fsdp2"], top=3)
    piped = next(a for a in p.alternatives if a.name == "with pipeline parallel")
    best = piped.estimate
    assert piped.fits and best.layout.zero == 3 and best.layout.pp > 1
    layers = best.memory.stage_layers
    assert sum(layers) == preset("llama3.1-405b").n_layers == 126 and layers[0] == layers[-1] == layers[1] - 1
