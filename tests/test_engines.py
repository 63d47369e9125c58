"""Engine stacks beyond one GPU: FSDP2 as torchtitan runs it, Megatron-LM, DeepSpeed ZeRO (issue 12).

Each charge cites the engine's file (commits in memcalc/parallel/engines.py); the engines' own memory
formulas are held against memcalc in tests/test_engine_goldens.py.
"""

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.memory.state import StateSharding, model_state
from memcalc.model.gpus import gpu
from memcalc.model.params import n_params
from memcalc.model.presets import preset, preset_model
from memcalc.model.shape import Model
from memcalc.model.stacks import STACKS, stack_for
from memcalc.model.tricks import Tricks
from memcalc.parallel.engines import (
    DEEPSPEED_DEFAULTS,
    DeepSpeedConfig,
    grad_reduce_bytes,
    largest_module,
    megatron_bucket_size,
    persistent_params,
)
from memcalc.parallel.activations import layer_activations
from memcalc.model.layout import Layout
from memcalc.parallel.params import tp_layer_params
from memcalc.parallel.pipeline import stage_layers
from memcalc.parallel.stage_memory import layout_memory
from memcalc.parallel.plan import layout_estimate, plan

H100 = gpu("h100-sxm")
FLASH = Tricks(flash=True)
LLAMA70 = preset_model("llama3-70b")
N = 8_000_000_000
WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}


def memory(stack: str, model=LLAMA70, tricks=FLASH, seq=4096, m=8, **layout):
    setup = Setup(seq_len=seq, grad_accum=m, stack=STACKS[stack])
    return layout_estimate(model, setup, H100, tricks, Layout(**layout)).memory


def parts(state) -> dict[str, float]:
    return {p.name: p.bytes_per_param for p in state.parts}


# ---- the stacks ------------------------------------------------------------------------------------


def test_engine_stacks_join_the_registry():
    assert {k: (s.engine, s.recipe) for k, s in STACKS.items() if s.engine != "none"} == {
        "fsdp2": ("fsdp2", "autocast"), "megatron": ("megatron", "main_grad"), "deepspeed": ("deepspeed", "grad_partition"),
    }  # fmt: skip
    assert all(STACKS[k].engine == "none" for k in ("reference", "torch", "hf"))
    assert stack_for("megatron", recipe="master").label == "megatron (master)"


# ---- model state: bytes per parameter ----------------------------------------------------------------


def test_megatron_charges_18_bytes_and_6_plus_12_over_d():
    # bf16 weight 2 + fp32 main_grad 4 + fp32 master 4 + Adam m, v 8 (megatron/training/arguments.py,
    # theoretical_memory_usage.py num_bytes_per_parameter: 18, or 6 + 12/d with the distributed optimizer)
    assert parts(model_state(N, "bf16", recipe="main_grad")) == {"weights": 2, "grads": 4, "master": 4, "adam_m": 4,
                                                                  "adam_v": 4}  # fmt: skip
    assert model_state(N, "bf16", "adamw", StateSharding(8, 1), "main_grad").total_bytes == (6 + 12 / 8) * N
    # fp16 keeps its gradients in 16 bits (accumulate_allreduce_grads_in_fp32 is set for bf16 only)
    assert model_state(N, "fp16", recipe="main_grad").bytes_per_param == 16


def test_megatron_distributed_optimizer_shards_over_dp_times_cp():
    # the distributed optimizer's group is the data-parallel group with context parallel
    st = memory("megatron", tp=8, cp=2, dp=4, zero=1).peak.state
    assert st.parts[1].name == "grads" and st.parts[1].sharded_over == 1
    assert {p.sharded_over for p in st.parts if p.name in ("master", "adam_m", "adam_v")} == {8}


@pytest.mark.parametrize("zero, per_gpu", [(0, 20), (1, 4 + 16 / 8), (2, 2 + 18 / 8), (3, 20 / 8)])
def test_deepspeed_keeps_an_fp32_gradient_partition(zero, per_gpu):
    # 16-bit params and grads, fp32 grads of the partition (stage_1_and_2.py step: .to(fp32)), fp32 master,
    # m, v; ZeRO-2 is estimate_zero2_model_states_mem_needs' 2 + 18/N
    st = model_state(N, "bf16", "adamw", StateSharding(8, zero), "grad_partition")
    assert st.total_bytes == per_gpu * N


def test_deepspeed_zero3_casts_fp32_grads_one_sub_group_at_a_time():
    # stage3.py _prepare_fp32_grad_for_sub_group: sub_group_size (1e9) elements at most
    big = Model(preset("llama3.1-405b"), n_params(preset("llama3.1-405b")), "405B")
    st = memory("deepspeed", model=big, dp=8, zero=3, offload_optimizer=False).peak.state
    fp32 = next(p for p in st.parts if p.name == "grads_fp32")
    assert fp32.bytes == 4 * DEEPSPEED_DEFAULTS.sub_group_size < 4 * big.n_params // 8


def test_deepspeed_offload_moves_the_16_bit_gradients_at_zero_2_and_3():
    for zero in (2, 3):
        st = memory("deepspeed", dp=8, zero=zero, offload_optimizer=True, tp=8).peak.state
        assert [p.name for p in st.parts if not p.on_host] == ["weights"]
    st = memory("deepspeed", dp=8, zero=1, offload_optimizer=True, tp=8).peak.state
    assert [p.name for p in st.parts if not p.on_host] == ["weights", "grads"]  # ZeRO-1: whole 16-bit grads


def test_fsdp2_shards_fp32_parameters_gradients_and_adam():
    # MixedPrecisionPolicy(param_dtype=bf16) over fp32 sharded parameters: 4 + 4 + 8 = 16 bytes, all sharded
    st = memory("fsdp2", tp=8, dp=8).peak.state
    assert parts(st) == {"weights": 4, "grads": 4, "adam_m": 4, "adam_v": 4}
    assert {p.sharded_over for p in st.parts} == {8}


# ---- the engines' rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("stack, layout, message", [
    ("fsdp2", {"dp": 8, "zero": 1}, "FSDP2 shards parameters, gradients and optimizer state"),
    ("fsdp2", {"dp": 8, "zero": 3, "offload_optimizer": True}, "CPUOffloadPolicy"),
    ("megatron", {"dp": 8, "zero": 3}, "Megatron-LM runs DDP"),
    ("megatron", {"dp": 8, "zero": 3, "offload_optimizer": True, "offload_params": True}, "Megatron-LM runs DDP"),
    ("deepspeed", {"pp": 2, "dp": 4, "zero": 3}, "PipelineEngine"),
    ("reference", {"pp": 2, "dp": 4, "zero": 2}, "ZeRO-2 with pipeline parallel is unsupported"),
    ("reference", {"dp": 8, "zero": 3, "reshard_after_forward": True}, "reshard_after_forward.*not on reference"),
    ("deepspeed", {"dp": 8, "zero": 3, "reshard_after_forward": False}, "reshard_after_forward.*not on deepspeed"),
    ("megatron", {"dp": 8, "zero": 1, "reshard_after_forward": False}, "reshard_after_forward.*not on megatron"),
    ("fsdp2", {"tp": 8, "reshard_after_forward": True}, "reshard_after_forward.*one data-parallel rank"),
    ("fsdp2", {"reshard_after_forward": False}, "reshard_after_forward.*one data-parallel rank"),
])  # fmt: skip
def test_what_each_engine_refuses(stack, layout, message):
    """--reshard/--no-reshard were accepted, and ignored, on every stack but FSDP2 sharding over dp > 1."""
    with pytest.raises(InputError, match=message):
        memory(stack, **layout)


def test_fsdp2_runs_with_pipeline_parallel_and_is_zero3_by_default():
    mem = memory("fsdp2", tp=8, pp=4, dp=2)  # torchtitan: fully_shard whenever dp_shard · cp > 1
    assert mem.layout.zero == 3 and mem.stage_layers == (20, 21, 20, 19)
    assert memory("fsdp2", tp=8).layout.zero == 0  # one data-parallel rank: no FSDP (torchtitan autocasts)


# ---- buffers ------------------------------------------------------------------------------------------


def test_fsdp2_working_memory_at_the_start_of_backward():
    # the running and the prefetched blocks in bf16, one unit's bf16 gradients and its fp32 reduce-scatter
    # input; the last stage keeps [norm, lm_head] gathered (torchtitan: not resharded after forward)
    shape = LLAMA70.shape
    block = tp_layer_params(shape, 8)
    head = 128256 // 8 * 8192 + 8192
    (st,) = memory("fsdp2", tp=8, dp=8).stages
    unit = max(block, head)  # the largest unit reduced: here [norm, lm_head] (131M against a block's 107M)
    assert [b.value for b in st.buffers] == [2 * 2 * block, 2 * unit, 4 * unit, 2 * head]
    # without resharding after forward every block of the stage stays gathered until its backward
    (kept,) = memory("fsdp2", tp=8, dp=8, reshard_after_forward=False).stages
    assert kept.buffers[0].value == 2 * 80 * block and "kept unsharded" in kept.buffers[0].name


def test_fsdp2_under_pipeline_parallel_keeps_the_stage_gathered_and_its_gradients_in_fp32():
    # torch/distributed/pipelining/stage.py: every backward but the last with reshard_after_backward and
    # requires_gradient_sync off: the stage's bf16 parameters stay gathered, its gradients accumulate
    # unsharded in reduce_dtype fp32 (_fsdp_param.py to_accumulated_grad_if_needed)
    mem = memory("fsdp2", tp=8, pp=4, dp=2)
    for st in mem.stages:
        assert [b.value for b in st.buffers] == [2 * st.params, 4 * st.params]
    again = memory("fsdp2", tp=8, pp=4, dp=2, reshard_after_forward=True)  # gathered again after the first backward
    assert again.total_bytes == mem.total_bytes


def test_fsdp2_in_fp32_gathers_fp32():
    (st,) = memory("fsdp2", tricks=Tricks("fp32"), tp=8, dp=8).stages
    block = tp_layer_params(LLAMA70.shape, 8)
    head = 128256 // 8 * 8192 + 8192
    assert [b.value for b in st.buffers] == [2 * 4 * block, 4 * head, 4 * head, 4 * head]


def test_deepspeed_buckets():
    # ZeRO 1-2: one reduce bucket of 5e8 16-bit elements (overlap_comm is off below stage 3); two with it
    (st,) = memory("deepspeed", tp=8, dp=8, zero=2).stages
    assert [b.value for b in st.buffers] == [2 * 500_000_000]
    # ZeRO-3: the bucket, the largest module + the 5e7 prefetch bucket, its gradient, the persistent norms
    (st,) = memory("deepspeed", tp=8, dp=8, zero=3).stages
    largest = 128256 // 8 * 8192  # the embedding (and the output layer) on one TP rank
    assert largest == largest_module(LLAMA70.shape, 8, True, True, 1)
    small = 80 * 2 * 8192  # two RMSNorm weights per layer, each under 1e5 elements
    assert [b.value for b in st.buffers] == [2 * 500_000_000, 2 * (largest + 50_000_000), 2 * largest,
                                             2 * (small - small // 8)]  # fmt: skip


def test_deepspeed_max_live_parameters_caps_the_prefetch():
    from memcalc.parallel.engines import deepspeed_buffers

    ds = DeepSpeedConfig(prefetch_bucket_size=10**9, max_live_parameters=3 * 10**8)
    gathered = deepspeed_buffers(LLAMA70.shape, 8, 3, 2, True, True, 1, 80, 8, ds)[1]
    assert gathered.value == 2 * 3 * 10**8


def test_persistent_params_are_the_small_tensors():
    gpt = preset("gpt2")  # LayerNorm weights and biases (768), every bias (768, 3072 split) are under 1e5
    assert persistent_params(gpt, 1, 100_000) == 4 * 768 + (3 * 768 + 768 + 3072 + 768)
    assert persistent_params(gpt, 1, 1000) == 4 * 768 + 3 * 768 + 768 + 768


def test_megatron_holds_no_bucket_memory():
    # DDP buckets are views into the contiguous param and grad buffers (param_and_grad_buffer.py _get)
    (st,) = memory("megatron", tp=8, dp=8, zero=1).stages
    assert st.buffers == ()
    assert megatron_bucket_size(8) == 40_000_000 and megatron_bucket_size(64) == 64_000_000


def test_gradients_on_the_wire():
    assert grad_reduce_bytes("fsdp2", "bf16") == 4  # reduce_dtype fp32
    assert grad_reduce_bytes("megatron", "bf16") == 4 and grad_reduce_bytes("megatron", "fp16") == 2
    assert grad_reduce_bytes("deepspeed", "bf16") == grad_reduce_bytes("none", "bf16") == 2


# ---- activations ----------------------------------------------------------------------------------------


def test_megatron_layer_is_18_plus_4f_over_h():
    # theoretical_memory_usage.py compute_activation_memory: s·b·h·(18 + 4·f/h)/t with SP and selective
    shape = LLAMA70.shape
    s, h, f, t = 4096, shape.hidden, shape.ffn, 8
    layer = layer_activations(shape, s, 1, Tricks(recompute="selective"), t, True, 1, "megatron")
    assert layer.per_layer_bytes == s * h * (18 + 4 * f // h) // t
    gpt = preset("gpt3-175b")  # at f = 4h, Korthikanti et al. 2022, Table 2's 34·s·b·h/t
    assert (layer_activations(gpt, 2048, 1, Tricks(recompute="selective"), 8, True, 1, "megatron").per_layer_bytes
            == layer_activations(gpt, 2048, 1, Tricks(recompute="selective"), 8, True).per_layer_bytes)  # fmt: skip


def test_megatron_first_stage_keeps_token_ids_and_the_embedding_dropout():
    gpt = Model(preset("gpt3-175b"), n_params(preset("gpt3-175b")), "gpt3")
    mem = memory("megatron", model=gpt, tricks=Tricks(recompute="selective"), seq=2048, m=64, tp=8, pp=8, sp=True)
    first = mem.stages[0]
    assert [(t.name.split(",")[0], t.value) for t in first.inputs] == [
        ("token ids (int64)", 8 * 2048 * 8), ("embedding dropout mask", 2048 * 12288 // 8 * 8)]  # fmt: skip
    assert all(st.inputs == () for st in mem.stages[1:])
    llama = memory("megatron", tp=8, pp=4, sp=True)  # no dropout in Llama: the ids only
    assert [t.name.split(",")[0] for t in llama.stages[0].inputs] == ["token ids (int64)"]


# ---- pipeline stages --------------------------------------------------------------------------------------


def test_torchtitan_and_megatron_stage_splits():
    # Llama 3.1 405B: 126 layers + embedding + head = 128 = 8 x 16 (torchtitan _generate_llm_fqn_per_model_part)
    assert stage_layers(8, 0, 0, 126) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert stage_layers(4, 0, 0, 80) == (20,) * 4 and stage_layers(4, 0, 0, 80, weighted=True) == (20, 21, 20, 19)
    assert stage_layers(7, 0, 0, 80) == (11, 12, 12, 12, 12, 11, 10)  # 82 = 7 x 11 + 5: the first five take one more
    # Megatron-LM's --decoder-first/last-pipeline-num-layers
    assert stage_layers(8, 15, 15, 126) == stage_layers(8, 0, 0, 126)  # the same split, said explicitly
    assert stage_layers(4, 17, 17, 80) == (17, 23, 23, 17) and stage_layers(4, 26, 0, 80) == (26, 18, 18, 18)
    assert stage_layers(2, 30, 50, 80) == (30, 50)


def test_llama_405b_on_8_stages_is_estimated():
    big = preset_model("llama3.1-405b")
    mem = memory("reference", model=big, seq=8192, m=16, tp=8, pp=8, dp=2, zero=1, sp=True)
    assert [st.layers for st in mem.stages] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert [st.held for st in mem.stages][:2] == [8 * 15, 7 * 16]  # 1F1B: min(p − i, m) micro-batches of its layers
    assert sum(st.params for st in mem.stages) > big.n_params / 8  # every layer is on some stage


def test_uneven_stages_peak_where_the_planner_looks():
    big = preset_model("llama3.1-405b")
    setup = Setup(seq_len=8192, grad_accum=16, stack=STACKS["fsdp2"])
    lay = Layout(tp=8, pp=8, dp=8, zero=3, sp=True)
    every = layout_memory(big, setup, H100, FLASH, lay)
    ends = layout_memory(big, setup, H100, FLASH, lay, ends_only=True)
    assert [st.stage for st in ends.stages] == [0, 1, 7] and ends.total_bytes == every.total_bytes


# ---- the command line ---------------------------------------------------------------------------------------


def test_estimate_and_plan_take_the_engine_stacks():
    run = CliRunner().invoke
    out = run(app, ["estimate", "--model", "llama3.1-405b", "--seq", "8192", "--tricks", "bf16,flash", "--gpus", "512",
                    "--tp", "8", "--pp", "8", "--sp", "--stack", "fsdp2", "--grad-accum", "16"], env=WIDE)  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "ZeRO-3 over dp x cp = 8 ranks" in out.stdout and "FSDP2 stage parameters kept gathered" in out.stdout
    out = run(app, ["estimate", "--model", "llama3-70b", "--tp", "8", "--pp", "4", "--pp-layers", "17,17", "--sp",
                    "--tricks", "bf16,flash", "--format", "csv"], env=WIDE)  # fmt: skip
    assert out.exit_code == 0 and [row.split(",")[2] for row in out.stdout.splitlines()[1:]] == ["17", "23", "23", "17"]
    bad = run(app, ["estimate", "--model", "llama3-70b", "--pp", "4", "--pp-layers", "18"], env=WIDE)
    assert bad.exit_code == 2 and "--pp-layers takes FIRST,LAST" in bad.stderr
    p = plan(preset_model("llama3-8b"), H100, 8, 4096, 16, stack=STACKS["megatron"], top=3)
    assert p.best and all(e.layout.zero in (0, 1) and e.setup.stack.key == "megatron" for e in p.best)
    out = run(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--stack", "deepspeed",
                    "--format", "csv"], env=WIDE)  # fmt: skip
    assert out.exit_code == 0 and out.stdout.startswith("rank,")
