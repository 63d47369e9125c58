"""Expert parallelism: the experts' state over EP and edp ranks, the MoE layers' activations and all-to-all
buffers per GPU, the all-to-all's bytes and time, and `memcalc plan` on DeepSeek-V3 over 256 H100s."""

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.model.gpus import gpu
from memcalc.model.moe import Routing
from memcalc.model.moe_mla import moe_layer_count
from memcalc.model.params import expert_params, n_params, param_counts
from memcalc.model.presets import preset
from memcalc.model.shape import Model
from memcalc.model.tricks import parse_tricks
from memcalc.parallel.experts import moe_tokens
from memcalc.model.layout import Layout
from memcalc.parallel.params import expert_gpu_params, gpu_params
from memcalc.parallel.stage_memory import layout_memory
from memcalc.parallel.plan import layout_estimate

H100 = gpu("h100-sxm")
FLASH = parse_tricks("bf16,flash")


def model(name):
    shape = preset(name)
    return Model(shape, n_params(shape), name)


def test_every_expert_is_held_once_per_ep_group():
    """Summed over the ep ranks of a group, the routed experts are the model's, once (etp 1), and the rest of
    the model is on every GPU (tp 1, pp 1): the GPU's parameters add up to the model's."""
    m = model("deepseek-v3")
    c = param_counts(m.shape)
    routed = (moe_layer_count(m.shape) + 1) * 256 * expert_params(m.shape)  # + the MTP module's block
    for ep in (1, 8, 64, 256):
        lay = Layout(dp=256, ep=ep, zero=1)
        assert ep * expert_gpu_params(m.shape, lay, 0) == routed
        assert gpu_params(m, 1, 1, 0) + routed == c.total


def test_tp_shards_as_megatrons_formula():
    """One GPU's parameters at tp 4, ep 8 (Qwen3-235B-A22B): megatron/training/theoretical_memory_usage.py's
    num_parameters_on_most_loaded_model_shard, plus Qwen3's per-head q/k norms (replicated) it leaves out."""
    m = model("qwen3-235b-a22b")
    s, t, ep = m.shape, 4, 8
    h, L = s.hidden, s.n_layers
    attention = 2 * h * h * ((1 + s.n_kv_heads / s.n_heads) * s.n_heads * s.head_dim / h)
    tp_sharded = attention * L + 2 * h * s.vocab  # embedding and untied output layer, vocab-parallel
    replicated = (2 * h + h * s.n_experts) * L + h
    experts = 2 * h * s.routed_ffn * s.n_experts * 3 / 2 * L / ep
    megatron = tp_sharded / t + replicated + experts
    lay = Layout(tp=t, sp=True, dp=16, ep=ep, zero=1)
    ours = gpu_params(m, t, 1, 0) + expert_gpu_params(s, lay, 0)
    assert ours == int(megatron) + 2 * s.head_dim * L


def test_experts_state_is_sharded_over_their_edp_group():
    m = model("qwen3-30b-a3b")
    setup = Setup(seq_len=4096)
    one = layout_memory(m, setup, H100, FLASH, Layout(dp=16, zero=1, ep=1)).peak
    eight = layout_memory(m, setup, H100, FLASH, Layout(dp=16, zero=1, ep=8)).peak
    experts = 48 * 128 * expert_params(m.shape)
    assert one.expert_params == experts and eight.expert_params == experts // 8
    master = {p.name: p.bytes for p in eight.state.parts}["master"]
    dense = m.n_params - experts
    assert master == -(-4 * dense // 16) + 4 * (experts // 8) // 2  # dense over dp 16; experts over edp 2
    assert eight.total_bytes < one.total_bytes


def test_all_to_all_bytes_and_links():
    """Per MoE layer and micro-batch: dispatch and combine forward, both backward; each sends (ep−1)/ep of the
    GPU's T·k token copies, on NVLink inside a node and InfiniBand beyond it."""
    m = model("qwen3-30b-a3b")
    setup = Setup(seq_len=4096)
    for ep, link in ((8, "nvlink4"), (16, "ndr")):
        est = layout_estimate(m, setup, H100, FLASH, Layout(dp=16, zero=1, ep=ep))
        a2a = next(c for c in est.time.comms if c.group == "ep")
        T, R = moe_tokens(m, setup, est.layout)
        assert (T, R) == (4096, 4096 * 8)
        per_call = R * (ep - 1) // ep * 2048 * 2
        assert (a2a.link, a2a.calls, a2a.bytes) == (link, 4 * 48, 4 * 48 * per_call)
    nvlink = layout_estimate(m, setup, H100, FLASH, Layout(dp=16, zero=1, ep=8))
    ib = layout_estimate(m, setup, H100, FLASH, Layout(dp=16, zero=1, ep=16))
    assert ib.time.breakdown["ep"] > nvlink.time.breakdown["ep"]


def test_imbalance_moves_the_busiest_gpu():
    """With EP the busiest GPU receives X times its share: more activations, a longer all-to-all, more expert
    compute; on one GPU (ep 1) the same tokens are spread differently and nothing moves."""
    m = model("qwen3-30b-a3b")
    lay = Layout(dp=16, zero=1, ep=16)
    calm, busy = (layout_estimate(m, Setup(seq_len=4096, routing=Routing(imbalance=x)), H100, FLASH, lay)
                  for x in (1.0, 2.0))  # fmt: skip
    assert busy.memory.total_bytes > calm.memory.total_bytes
    assert busy.time.breakdown["ep"] > calm.time.breakdown["ep"]
    assert busy.time.compute_seconds > calm.time.compute_seconds
    alone = replace(lay, ep=1)
    a, b = (layout_memory(m, Setup(seq_len=4096, routing=Routing(imbalance=x)), H100, FLASH, alone) for x in (1.0, 2.0))
    assert a.total_bytes == b.total_bytes


@settings(max_examples=30, deadline=None)
@given(st.floats(1, 16), st.floats(1, 16), st.sampled_from([1, 2, 8, 16, 32]),
       st.sampled_from(["bf16,flash", "bf16,flash,ckpt", "bf16"]))  # fmt: skip
def test_imbalance_never_lowers_the_layout_peak(x1, x2, ep, tricks):
    m, t = model("qwen3-30b-a3b"), parse_tricks(tricks)
    low, high = sorted((x1, x2))
    lay = Layout(dp=32, zero=1, ep=ep)
    calm, busy = (layout_memory(m, Setup(seq_len=2048, routing=Routing(imbalance=x)), H100, t, lay)
                  for x in (low, high))  # fmt: skip
    assert busy.total_bytes >= calm.total_bytes


def test_dense_layouts_are_untouched():
    dense = model("qwen3-8b")
    lay = Layout(tp=2, dp=4, zero=1)
    assert lay.label == "tp2 pp1 cp1 dp4 zero1"
    st_ = layout_memory(dense, Setup(seq_len=4096), H100, FLASH, lay).peak
    assert st_.moe_layer is None and st_.expert_params == 0
    assert not [c for c in layout_estimate(dense, Setup(seq_len=4096), H100, FLASH, lay).time.comms if c.group == "ep"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(dp=24, ep=3), "must divide the 128 experts"),
    (dict(dp=16, ep=32), "expert parallel 32 x expert tensor parallel 1 must divide the tp x cp x dp = 16"),
    (dict(dp=16, etp=5), "expert parallel 1 x expert tensor parallel 5 must divide"),
    (dict(tp=2, dp=8, ep=8), "need sequence parallel (--sp)"),
])  # fmt: skip
def test_bad_expert_layouts(kwargs, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout_memory(model("qwen3-30b-a3b"), Setup(seq_len=4096), H100, FLASH, Layout(zero=1, **kwargs))
    with pytest.raises(InputError, match="this model has none"):
        layout_memory(model("qwen3-8b"), Setup(seq_len=4096), H100, FLASH, Layout(dp=8, ep=8))


WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}


def test_plan_finds_an_expert_parallel_layout_for_deepseek_v3_on_256_h100s():
    """The issue's check: `memcalc plan` puts DeepSeek-V3's experts over EP on 256 H100s, shows the all-to-all's
    cost, and says why no EP loses."""
    # docs/moe.md shows this command's output, and tests/test_docs.py holds it to what memcalc prints
    command = "memcalc plan --model deepseek-v3 --gpus 256 --global-batch 256 --seq 4096 --top 3 --detail"
    page = (Path(__file__).parent.parent / "docs" / "moe.md").read_text()
    marker = re.search(r"<!-- example(, takes [^:]+)?: " + re.escape(command) + " -->", page)  # its output shown
    stdout = page[marker.end():].split("```text\n")[1].split("```")[0]
    verdict = stdout.split("Fastest: ")[1]
    assert "experts over ep " in verdict.splitlines()[0]
    times = stdout.split("Step time of those layouts, by part (seconds)")[1].splitlines()
    assert " ep " in times[1] and "edp" in times[1]
    first = next(line for line in times if line.split()[:1] == ["1"])  # layout 1's row, under the wrapped header
    ep_time = float(first.split()[times[1].split().index("ep")])
    assert ep_time > 0  # the all-to-all's exposed seconds per step
    assert "without expert parallel" in stdout


def test_estimate_layout_with_ep_shows_the_all_to_all():
    out = CliRunner().invoke(app, ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--ep", "16", "--zero", "1",
                                   "--tricks", "bf16,flash", "--detail"], env=WIDE)  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "experts over ep 16 (edp 1)" in out.stdout
    assert "EP all-to-all dispatch + combine" in out.stdout and "EP all-to-all send + receive buffers" in out.stdout


# ---- merged with main's engines, stacks and per-stage roofline ------------------------------------------


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_a_moe_layout_of_one_gpu_is_the_one_gpu_step(model):
    """The layout roofline's block is the average of the dense and MoE blocks (each kind weighted by its
    count), the MTP block's recompute on the last stage: one GPU's layout runs the one-GPU step's kernels."""
    args = ["estimate", "--model", model, "--seq", "4096", "--tricks", "bf16,flash,ckpt", "--format", "json"]
    one = json.loads(CliRunner().invoke(app, args).stdout)
    layout = json.loads(CliRunner().invoke(app, [*args, "--tp", "1"]).stdout)
    (time,), (layout_time,) = one["time"], layout["time"]
    assert layout_time["step_seconds"] == pytest.approx(time["step_seconds"], rel=1e-12)


@pytest.mark.parametrize("stack", ["torch", "hf", "fsdp2"])
def test_moe_is_replayed_on_the_reference_stack_only(stack):
    """Autocast's casts, the libraries' optimizers and Transformers' classes are replayed for dense models;
    a MoE under them is the textbook's, saying why, never a replay of another model."""
    args = ["estimate", "--model", "mixtral-8x7b", "--seq", "4096", "--stack", stack]
    out = CliRunner().invoke(app, args, env=WIDE)
    assert out.exit_code == 0, out.output
    assert "replays a mixture of experts, latent attention and MTP on the reference stack only" in out.output
    assert not re.search(r"(^|\s)-\d", out.output.split("\n\n")[-1])  # the answer holds no negative bytes


@pytest.mark.parametrize("stack, zero", [("fsdp2", "3"), ("deepspeed", "3")])
def test_moe_layouts_run_on_the_reference_and_megatron_engines(stack, zero):
    """FSDP2's and DeepSpeed-MoE's expert paths are not modelled: refused in a line."""
    out = CliRunner().invoke(app, ["estimate", "--model", "mixtral-8x7b", "--seq", "4096", "--stack", stack,
                                   "--gpus", "8", "--zero", zero, "--ep", "8"], env=WIDE)  # fmt: skip
    assert out.exit_code == 2 and "modelled on the reference stack's engine and Megatron-LM's" in out.output, out.output


@pytest.mark.parametrize("name, lay", [
    ("qwen3-30b-a3b", Layout(tp=2, sp=True, dp=8, ep=4, zero=1)),  # edp 4: experts' optimizer over 4, the rest over 8
    ("mixtral-8x7b", Layout(tp=2, sp=True, pp=4, dp=8, ep=8, zero=1)),  # the first stage, edp 2
    ("qwen3-30b-a3b", Layout(tp=1, dp=16, ep=8, zero=0)),  # DDP: 18 bytes a parameter
])  # fmt: skip
def test_megatron_expert_state_is_megatrons_formula(name, lay):
    """Megatron-LM's own estimate of one GPU's weights and optimizer state with experts
    (megatron/training/theoretical_memory_usage.py @ d98e8a64ddf34856e74b24714e3bedb2f5a39553,
    compute_weight_and_optimizer_memory): the non-expert parameters at 6 + 12/dp bytes with the distributed
    optimizer (18 without), the experts' at 6 + 12/edp, edp = world / (etp · ep · pp)."""
    from memcalc.model.stacks import stack_for

    m = model(name)
    mem = layout_memory(m, Setup(seq_len=4096, stack=stack_for("megatron")), H100, FLASH, lay)
    stage = mem.stages[0]
    dense, experts = gpu_params(m, lay.tp, lay.pp, 0), expert_gpu_params(m.shape, lay, 0)
    edp = lay.world // (lay.etp * lay.ep * lay.pp)

    def per_param(dp):
        return 6 + 12 / dp if lay.zero else 18

    assert stage.state.total_bytes == pytest.approx(dense * per_param(lay.dp) + experts * per_param(edp), abs=16)


def test_the_bound_never_exceeds_the_step_with_experts():
    """plan skips the layouts step_lower_bound proves slower: with experts over ep (each GPU's E/ep experts on
    ep times the tokens) and dense and MoE blocks averaged, the bound stays under the step."""
    from memcalc.parallel.comm import step_lower_bound

    rng, model = random.Random(13), Model(preset("qwen3-30b-a3b"), n_params(preset("qwen3-30b-a3b")), "qwen3-30b-a3b")
    for _ in range(12):
        tp, ep, b = rng.choice([1, 2]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2])
        layout = Layout(tp=tp, dp=8 // tp, zero=rng.choice([1, 3]), sp=tp > 1, ep=ep)
        setup = Setup(seq_len=2048, micro_batch=b, grad_accum=rng.choice([1, 4]))
        est = layout_estimate(model, setup, gpu("h100-sxm"), parse_tricks("bf16,flash"), layout)
        for traced in (True, False):
            bound = step_lower_bound(model, setup, gpu("h100-sxm"), est.tricks, layout, est.memory, traced=traced)
            assert 0 < bound <= est.time.step_seconds, (layout, traced)


def test_expert_parallel_feeds_each_expert_more_tokens():
    """Qwen3-30B-A3B at seq 2048: a GPU's 128 experts see 128 tokens each, memory-bound; over ep 8 each GPU
    runs 16 experts on 8 times the tokens, reading an eighth of the weights: the MoE blocks run faster, while
    the step's FLOPs per GPU stay the same."""
    from memcalc.parallel.comm import tp_shape
    from memcalc.time.calibration import calibration_for
    from memcalc.time.stages import stage_kernels

    h100, t = gpu("h100-sxm"), parse_tricks("bf16,flash")
    shape = tp_shape(preset("qwen3-30b-a3b"), 1)
    one = stage_kernels(shape, 2048, 1, t, h100, calibration_for("h100-sxm"))
    eight = stage_kernels(shape, 2048, 1, t, h100, calibration_for("h100-sxm"), experts=8)
    assert eight.block_forward < one.block_forward and eight.block_backward < one.block_backward
    assert eight.optimizer_block < one.optimizer_block / 4  # the experts are nearly all of a block's weights
    assert eight.first_forward == one.first_forward and eight.last_forward == one.last_forward


def test_an_offloaded_optimizer_steps_on_the_cpu_only():
    """ZeRO-Offload's Adam runs on the host: the GPU's optimizer kernels are not in the step."""
    model = Model(preset("qwen3-30b-a3b"), n_params(preset("qwen3-30b-a3b")), "qwen3-30b-a3b")
    setup, t = Setup(seq_len=2048), parse_tricks("bf16,flash")
    on_gpu = layout_estimate(model, setup, gpu("h100-sxm"), t, Layout(dp=8, zero=3, ep=8)).time
    offload = layout_estimate(model, setup, gpu("h100-sxm"), t, Layout(dp=8, zero=3, ep=8, offload_optimizer=True)).time
    assert on_gpu.optimizer_seconds > 0 and on_gpu.cpu_optimizer_seconds == 0
    assert offload.optimizer_seconds == 0 and offload.cpu_optimizer_seconds > 0


def test_deepseek_v3_over_an_uneven_pipeline_of_16():
    """DeepSeek-V3 trained its 61 layers over PP 16 (report sec. 3.2): the stages split as a dense model's
    (the embedding and head weighed as a layer each: 3, 4, ..., 4, 2), the first stage holding the three
    dense layers, each stage's MoE layers counted from its own range, every parameter placed exactly once."""
    from memcalc.parallel.pipeline import moe_split

    m, lay = model("deepseek-v3"), Layout(pp=16, dp=128, ep=64)
    shape = m.shape
    splits = [moe_split(shape, 16, i) for i in range(16)]
    assert [d + e for d, e in splits] == [3] + [4] * 14 + [2] and splits[0] == (3, 0)
    assert sum(e for _, e in splits) == moe_layer_count(shape)
    mem = layout_memory(m, Setup(seq_len=4096, grad_accum=16), H100, parse_tricks("bf16,flash,ckpt"), lay)
    assert mem.stage_layers == (3,) + (4,) * 14 + (2,)
    experts = sum(expert_gpu_params(shape, lay, i) for i in range(16)) * lay.ep
    layers_moe = moe_layer_count(shape) + shape.mtp_layers  # the MTP module's block is a MoE block on the last stage
    assert experts == layers_moe * shape.n_experts * expert_params(shape)
    with pytest.raises(InputError, match="no --pp-layers"):
        layout_memory(m, Setup(seq_len=4096, grad_accum=16), H100, FLASH, replace(lay, first_layers=5))
