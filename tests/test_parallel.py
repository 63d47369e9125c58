"""Per-GPU memory under TP, SP, PP, CP and ZeRO/FSDP: golden numbers from the papers, invariants, bad layouts."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcalc.errors import InputError
from memcalc.memory.estimate import Setup, estimate
from memcalc.model.gpus import gpu
from memcalc.model.params import layer_params, n_params
from memcalc.model.presets import preset, preset_model
from memcalc.model.shape import Model, ModelShape
from memcalc.model.tricks import Tricks
from memcalc.parallel.activations import layer_activations
from memcalc.parallel.checks import check_layout
from memcalc.model.layout import Layout, layout_for
from memcalc.parallel.params import stage_shape_params, tp_layer_params
from memcalc.parallel.pipeline import bubble_fraction, held_layers
from memcalc.parallel.stage_memory import layout_memory
from memcalc.parallel.plan import layout_estimate
from memcalc.time.calibration import calibration_for
from memcalc.time.roofline import roofline as roofline_step

GPT3 = preset("gpt3-175b")  # a 96, h 12288, L 96 (Brown et al. 2020)
H100 = gpu("h100-sxm")


# ---- Korthikanti et al. 2022, Table 2, for GPT-3 175B at s 2048, b 1, t 8 (decimal MB) -------------


@pytest.mark.parametrize("tricks, tp, sp, expected", [
    (Tricks(), 1, False, 2_868_903_936),  # sbh(34 + 5as/h) = 114·sbh: 2,869 MB
    (Tricks(), 8, False, 578_813_952),  # sbh(10 + 24/t + 5as/(ht)) = 23·sbh: 578.8 MB
    (Tricks(), 8, True, 358_612_992),  # (sbh/t)(34 + 5as/h) = 14.25·sbh: 358.6 MB
    (Tricks(recompute="selective"), 8, False, 327_155_712),  # sbh(10 + 24/t) = 13·sbh
    (Tricks(recompute="selective"), 8, True, 106_954_752),  # 34·sbh/t: 106.95 MB
    (Tricks(recompute="full"), 8, False, 50_331_648),  # 2·sbh: 50.33 MB
    (Tricks(recompute="full"), 8, True, 6_291_456),  # with SP the checkpointed input is sequence-split: 2sbh/t
])  # fmt: skip
def test_korthikanti_table_2_gpt3(tricks, tp, sp, expected):
    assert layer_activations(GPT3, 2048, 1, tricks, tp, sp).per_layer_bytes == expected


def test_table_2_selective_and_flash_keep_the_same_and_rebuild_differently():
    # selective recompute keeps what flash keeps; only selective rebuilds the s×s scores in backward
    sel = layer_activations(GPT3, 2048, 1, Tricks(recompute="selective"), 8, True)
    flash = layer_activations(GPT3, 2048, 1, Tricks(flash=True), 8, True)
    assert sel.per_layer_bytes == flash.per_layer_bytes
    assert sel.rebuilt_bytes == 5 * 96 * 2048 * 2048 // 8 and flash.rebuilt_bytes == 0


def test_context_parallel_splits_the_sequence():
    # CP splits every per-token tensor over the cp ranks: 34·(s/c)·b·h/t with flash and SP
    one = layer_activations(GPT3, 2048, 1, Tricks(flash=True), 8, True, 1).per_layer_bytes
    four = layer_activations(GPT3, 2048, 1, Tricks(flash=True), 8, True, 4).per_layer_bytes
    assert four * 4 == one == 34 * 2048 * 12288 // 8


# ---- pipeline: Korthikanti et al. 2022, sec. 4.2.3; Narayanan et al. 2021 ---------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_first_stage_holds_L_layers_worth_whatever_p(p):
    # the first stage keeps p micro-batches of its L/p layers
    assert held_layers(Layout(pp=p), 0, micro_batches=64, n_layers=96) == 96
    assert held_layers(Layout(pp=p), p - 1, micro_batches=64, n_layers=96) == 96 // p  # the last stage: one


def test_interleaved_factor():
    # interleaving with v chunks multiplies the first stage's memory by 1 + (p − 1)/(p·v)
    p, v, L = 8, 2, 96
    assert held_layers(Layout(pp=p, vpp=v), 0, 64, L) == L * (1 + (p - 1) / (p * v)) == 138


def test_few_micro_batches_cap_what_is_in_flight():
    assert held_layers(Layout(pp=8), 0, micro_batches=2, n_layers=96) == 2 * 12


def test_bubble_fraction():
    # Narayanan et al. 2021, sec. 2.2: (p − 1)/m, and (p − 1)/(v·m) interleaved
    assert bubble_fraction(Layout(pp=8), 64) == 7 / 64
    assert bubble_fraction(Layout(pp=8, vpp=4), 64) == 7 / 256


# ---- parameters on one GPU -------------------------------------------------------------------------


def test_gpt3_layer_under_tp():
    # Shoeybi et al. 2019: the 12h² weights and the column-parallel biases (3h QKV + 4h MLP) split over t;
    # LayerNorms (4h) and the two row-parallel biases (2h) are replicated
    h = 12288
    assert layer_params(GPT3) == 12 * h * h + 13 * h
    assert tp_layer_params(GPT3, 8) == (12 * h * h + 7 * h) // 8 + 6 * h


def test_llama3_70b_on_tp8_pp4():
    # stage 0: 20 layers + the token embedding (vocab split over t); last stage: 20 layers + norm + lm_head
    shape = preset("llama3-70b")
    layer = tp_layer_params(shape, 8)
    emb = 128256 // 8 * 8192
    assert stage_shape_params(shape, 8, 4, 0) == 20 * layer + emb
    assert stage_shape_params(shape, 8, 4, 3) == 20 * layer + 8192 + emb
    assert stage_shape_params(shape, 8, 4, 1) == 20 * layer


def test_tied_embeddings_get_a_copy_on_the_last_stage():
    shape = preset("gpt2")
    rows = 50257 * 768
    assert stage_shape_params(shape, 1, 1, 0) == n_params(shape)  # one table serves both ends
    # with pp > 1 the last stage holds a full output matrix, tied or not
    assert stage_shape_params(shape, 1, 2, 1) == stage_shape_params(replace(shape, tied_embeddings=False), 1, 2, 1)
    assert stage_shape_params(shape, 1, 2, 0) + stage_shape_params(shape, 1, 2, 1) == n_params(shape) + rows


# ---- ZeRO over dp × cp: Rajbhandari et al. 2019, sec. 5 -------------------------------------------------


@pytest.mark.parametrize("zero, paper", [(0, 16.0), (1, 4 + 12 / 64), (2, 2 + 14 / 64), (3, 16 / 64)])
def test_zero_per_device_formulas(zero, paper):
    # Ψ = 7.5B over N_d = 64 (Fig. 1): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB; here N_d = dp 16 x cp 4
    psi = 7_500_000_000
    model = Model(GPT3, psi, "7.5B on the GPT-3 shape")
    setup = Setup(seq_len=2048)
    mem = layout_memory(model, setup, H100, Tricks(flash=True), Layout(cp=4, dp=16, zero=zero))
    assert mem.peak.state.total_bytes == pytest.approx(paper * psi, abs=64)


def test_hybrid_shard_shards_inside_the_node():
    lay = Layout(tp=2, dp=32, zero=3, hybrid=True)
    assert (lay.shard_ranks, lay.node_shard_ranks, lay.shard_group) == (32, 4, 4)


def test_parameter_offload_leaves_only_buffers():
    model = preset_model("llama3-8b")
    mem = layout_memory(model, Setup(seq_len=4096), H100, Tricks(flash=True),
                        Layout(dp=8, zero=3, offload_optimizer=True, offload_params=True))  # fmt: skip
    st = mem.peak
    assert st.state.total_bytes == 0 and st.state.host_bytes > 0
    assert [b.name for b in st.buffers] == ["ZeRO-3 gathered layers (2 weights + 1 gradient)"]
    assert st.buffer_bytes == 3 * 2 * layer_params(model.shape)


# ---- bad layouts: one clear line each ------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"sp": True}, "sequence parallel needs tensor parallel"),
    ({"vpp": 2}, "need pipeline parallel"),
    ({"dp": 2, "zero": 2, "offload_optimizer": True, "offload_params": True}, "needs ZeRO-3"),
    ({"dp": 2, "zero": 3, "offload_params": True}, "add optimizer offload"),
    ({"dp": 2, "offload_optimizer": True}, "needs ZeRO >= 1"),
    ({"dp": 4, "hybrid": True}, "hybrid shard needs ZeRO >= 1"),
    ({"tp": 3, "dp": 4, "zero": 3, "hybrid": True}, "whole data-parallel groups inside a node"),
    ({"tp": 0}, "tp must be a whole number"),
    ({"zero": 4}, "zero stage must be 0, 1, 2 or 3"),
])  # fmt: skip
def test_bad_layouts(kwargs, message):
    with pytest.raises(InputError, match=message):
        Layout(**kwargs)


@pytest.mark.parametrize("kwargs, tricks, seq, m, message", [
    ({"tp": 5}, Tricks(), 2048, 1, "must divide the 64 attention heads"),
    ({"tp": 16}, Tricks(), 2048, 1, "must divide the 8 KV heads"),
    ({"pp": 64}, Tricks(), 2048, 1, "pipeline 64 leaves a stage without layers"),  # 80 + 2 over 64 stages
    ({"pp": 4, "first_layers": 30}, Tricks(), 2048, 1, "the other 3 stages cannot share the remaining 50"),
    ({"pp": 2, "dp": 2, "zero": 2}, Tricks(), 2048, 1, "ZeRO-2 with pipeline parallel is unsupported"),
    ({"pp": 4, "vpp": 8}, Tricks(), 2048, 8, "x virtual stages 8 must divide"),
    ({"pp": 4, "vpp": 2}, Tricks(), 2048, 6, "multiple of pp"),
    ({"cp": 2}, Tricks(), 2048, 1, "context parallel needs flash"),
    ({"cp": 4}, Tricks(flash=True), 2044, 1, "divisible by 2·cp"),
    ({"tp": 8, "sp": True}, Tricks(), 2044, 1, "divisible by tp"),
])  # fmt: skip
def test_layouts_the_model_rejects(kwargs, tricks, seq, m, message):
    # Llama 3 70B: 64 heads, 8 KV heads, 80 layers
    with pytest.raises(InputError, match=message):
        check_layout(Layout(**kwargs), preset("llama3-70b"), seq, tricks, m)


def test_world_size_must_be_the_product():
    with pytest.raises(InputError, match="world size: tp 8 x pp 2 x cp 1 x dp 3 = 48, not the 64 GPUs given"):
        layout_for(64, tp=8, pp=2, dp=3)
    with pytest.raises(InputError, match="do not split"):
        layout_for(64, tp=3)
    assert layout_for(64, tp=8, pp=2).dp == 4


# ---- invariants ---------------------------------------------------------------------------------------


@st.composite
def shapes(draw):
    head_dim = draw(st.sampled_from([16, 32, 64]))
    n_heads = draw(st.sampled_from([8, 16, 32]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if n_heads % k == 0]))
    gated = draw(st.booleans())
    return ModelShape(
        n_layers=draw(st.sampled_from([4, 8, 12, 24])), hidden=head_dim * n_heads, n_heads=n_heads, n_kv_heads=kv,
        ffn=8 * draw(st.integers(1, 64)), gated_mlp=gated, norm="rmsnorm" if gated else "layernorm",
        vocab=draw(st.integers(1, 100_000)), tied_embeddings=draw(st.booleans()), linear_bias=not gated,
    )  # fmt: skip


tricks_sets = st.builds(
    lambda p, f, r: Tricks("bf16" if f and p == "fp32" else p, f, r),
    st.sampled_from(["fp32", "fp16", "bf16"]), st.booleans(), st.sampled_from(["none", "selective", "full"]),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(shapes(), st.integers(1, 1 << 14), st.integers(1, 8), st.integers(1, 8), tricks_sets,
       st.sampled_from([1, 2, 8, 64]), st.sampled_from([0, 1, 2, 3]), st.booleans())  # fmt: skip
def test_one_gpu_layout_equals_the_single_gpu_estimate(shape, seq, b, m, tricks, dp, zero, offload):
    # TP = PP = CP = 1: every byte as memcalc.memory.estimate of the same layout, and the same step time
    offload = offload and (zero > 0 or dp == 1)
    model = Model(shape, n_params(shape), "test")
    setup, layout = Setup(seq_len=seq, micro_batch=b, grad_accum=m), Layout(dp=dp, zero=zero, offload_optimizer=offload)
    est = estimate(model, setup, H100, (tricks,), layout)
    lay = layout_estimate(model, setup, H100, tricks, layout)
    (st_,) = lay.memory.stages
    assert st_.state.parts == est.model_state.parts
    assert st_.state.total_bytes == est.memory[0].model_state_bytes
    assert st_.activation_peak_bytes == est.activations[0].peak_bytes
    assert st_.logits_bytes == est.logits[0].total_bytes
    assert lay.memory.total_bytes == est.memory[0].total_bytes
    if dp == 1 and not offload:  # one time model: the one-GPU roofline's kernels, and --mfu's step
        single = roofline_step(shape, seq, b, m, tricks, H100, calibration_for("h100-sxm"))
        assert lay.time.step_seconds == pytest.approx(single.step_seconds, rel=1e-12)
        assert lay.time.mfu == pytest.approx(single.mfu, rel=1e-12)
        by_mfu = layout_estimate(model, setup, H100, tricks, Layout(), timing=0.4)
        assert by_mfu.time.step_seconds == pytest.approx(est.compute[0].step_seconds, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(shapes(), st.integers(1, 10**12), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2, 3, 4, 8]), st.integers(0, 3), st.sampled_from(["fp32", "bf16", "fp16"]))  # fmt: skip
def test_more_gpus_never_increase_per_gpu_model_state(shape, params, tp, pp, dp, zero, precision):
    model = Model(shape, params, "test")
    tricks = Tricks(precision, flash=precision != "fp32")
    setup = Setup(seq_len=64 * tp)
    zero = zero if pp == 1 else min(zero, 1)  # ZeRO-2/3 do not combine with PP

    def state(**kw) -> int | None:
        lay = Layout(**{"tp": tp, "pp": pp, "dp": dp, "zero": zero, **kw})
        if shape.n_heads % lay.tp or shape.n_kv_heads % lay.tp or shape.ffn % lay.tp or shape.n_layers % lay.pp:
            return None
        return max(st.state.total_bytes for st in layout_memory(model, setup, H100, tricks, lay).stages)

    base = state()
    if base is None:
        return
    more = [state(dp=2 * dp), state(tp=2 * tp)]
    if tricks.flash:
        more.append(state(cp=2))
    assert all(x is None or x <= base for x in more)
    if zero <= 1:
        assert state(pp=2 * pp) is None or state(pp=2 * pp) <= base


@settings(max_examples=60, deadline=None)
@given(shapes(), st.integers(1, 64), st.integers(1, 4), tricks_sets, st.booleans(), st.sampled_from([1, 2, 4]))
def test_more_tp_never_increases_per_gpu_activations(shape, seq_k, b, tricks, sp, cp):
    seq = 2 * cp * 8 * seq_k  # divisible by 2·cp and by every tp tried
    if cp > 1:
        tricks = replace(tricks, flash=True, precision=tricks.precision.replace("fp32", "bf16"))
    before = None
    for t in (1, 2, 4, 8):
        if shape.n_heads % t or shape.n_kv_heads % t:
            break
        layer = layer_activations(shape, seq, b, tricks, t, sp and t > 1, cp)
        now = layer.per_layer_bytes + layer.rebuilt_bytes
        assert before is None or now <= before
        before = now


@given(shapes())
def test_tp_ranks_together_hold_every_layer_parameter(shape):
    # t ranks hold the split part once and the replicated part t times: (t·P_t − P)/(t − 1) is the same for every t
    assert tp_layer_params(shape, 1) == layer_params(shape)
    replicated = {(t * tp_layer_params(shape, t) - layer_params(shape)) // (t - 1)
                  for t in (2, 4, 8) if not (shape.n_heads % t or shape.n_kv_heads % t or shape.ffn % t)}  # fmt: skip
    assert len(replicated) <= 1


def test_the_halves_of_stage_memory_cover_the_layout():
    # stage_state and stage_activations are remembered by the layout fields they read: every field is read
    # by one or both, and each leaves alone only what it cannot depend on (a new field must be placed)
    from dataclasses import fields

    from memcalc.parallel.stage_memory import ACTIVATION_FIELDS, STATE_FIELDS

    every = {f.name for f in fields(Layout)}
    assert every - set(STATE_FIELDS) == {"sp", "vpp"}
    assert every - set(ACTIVATION_FIELDS) == {"zero", "hybrid", "offload_optimizer", "offload_params",
                                              "reshard_after_forward"}  # fmt: skip


PEAK_MODELS = {"dense": preset_model("llama3-70b"), "moe": preset_model("qwen3-30b-a3b")}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(kind=st.sampled_from(["dense", "moe"]), stack=st.sampled_from(["reference", "megatron", "deepspeed", "fsdp2"]),
       tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2, 8]), zero=st.integers(0, 3), hybrid=st.booleans(), sp=st.booleans(),
       vpp=st.sampled_from([1, 2]), offload=st.sampled_from([(False, False), (True, False), (True, True)]),
       ep=st.sampled_from([1, 2, 8]), b=st.sampled_from([1, 2]), m=st.sampled_from([1, 4]),
       recompute=st.sampled_from(["none", "full"]))  # fmt: skip
def test_the_planner_peak_is_the_layout_memory(kind, stack, tp, pp, cp, dp, zero, hybrid, sp, vpp, offload, ep, b, m,
                                               recompute):  # fmt: skip
    # plan decides fit from layout_peak, the sums of each stage's two remembered halves: equal to
    # layout_memory's stages, and the same whether a half was remembered from another layout or made anew
    from hypothesis import assume

    from memcalc.model.stacks import STACKS
    from memcalc.parallel.stage_memory import HALVES, layout_peak

    model = PEAK_MODELS[kind]
    sp, vpp, zero = sp and tp > 1 or (kind == "moe" and tp > 1), vpp if pp > 1 else 1, 3 if offload[1] else zero
    tricks, setup = Tricks(flash=True, recompute=recompute), Setup(seq_len=4096, micro_batch=b, grad_accum=m,
                                                                  stack=STACKS[stack if kind == "dense" else "reference"])  # fmt: skip
    try:
        layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp, zero=zero, hybrid=hybrid, sp=sp, vpp=vpp, ep=ep if kind == "moe" else 1,
                        offload_optimizer=offload[0], offload_params=offload[1])  # fmt: skip
        memory = layout_memory(model, setup, H100, tricks, layout, ends_only=True)
    except InputError:
        assume(False)
    warm = layout_peak(model, setup, H100, tricks, layout)
    HALVES.clear()
    cold = layout_peak(model, setup, H100, tricks, layout)
    assert (warm.total_bytes, warm.fits, warm.params) == (cold.total_bytes, cold.fits, cold.params)
    assert (cold.total_bytes, cold.fits, cold.stage_layers) == (memory.total_bytes, memory.fits, memory.stage_layers)
    assert cold.params == memory.params
