"""Mixture-of-experts and latent attention shapes: parameter counts against the published ones, the
config.json reading, the layer patterns, and bad input."""

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.errors import InputError
from memcalc.model.hfconfig import config_model, shape_from_config
from memcalc.model.moe_mla import is_moe_layer, moe_layer_count
from memcalc.model.params import active_params, expert_params, n_params, param_counts
from memcalc.model.presets import PRESETS, preset
from memcalc.model.shape import ModelShape

MOE = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")

# Exact counts of the shapes as their config.json describes them (the main model: DeepSeek-V3's MTP module apart).
EXACT = {  # (total, active per token)
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
    "deepseek-v3": (671_026_404_352, 37_552_282_624),
}

# What each publisher says, in billions, and how its figure is rounded from the exact count.
PUBLISHED = {
    # Jiang et al. 2024 (Mixtral of Experts, arXiv 2401.04088) and the Mistral release: 46.7B total, 12.9B active
    "mixtral-8x7b": ((46.7, 1, round), (12.9, 1, round)),
    # Qwen3 technical report (arXiv 2505.09388, Table 2) and the Qwen3-30B-A3B model card: 30.5B total, 3.3B
    # activated; 3.353B is written 3.3B: cut, not rounded
    "qwen3-30b-a3b": ((30.5, 1, round), (3.3, 1, math.floor)),
    # the same report and the Qwen3-235B-A22B model card: 235B total, 22B activated
    "qwen3-235b-a22b": ((235, 0, round), (22, 0, round)),
    # DeepSeek-V3 technical report (arXiv 2412.19437, abstract): 671B total, 37B activated per token; 37.55B
    # is written 37B: cut (without the input embedding, 36.63B, it would round to 37 too)
    "deepseek-v3": ((671, 0, round), (37, 0, math.floor)),
}


def billions(count: int, digits: int, rule) -> float:
    scale = 10**digits
    return rule(count / 1e9 * scale) / scale


@pytest.mark.parametrize("name", MOE)
def test_exact_counts(name):
    counts = param_counts(preset(name))
    assert (counts.main, counts.active) == EXACT[name]


@pytest.mark.parametrize("name", MOE)
def test_counts_give_the_published_figures(name):
    (total, td, trule), (active, ad, arule) = PUBLISHED[name]
    exact_total, exact_active = EXACT[name]
    assert billions(exact_total, td, trule) == total
    assert billions(exact_active, ad, arule) == active


def test_deepseek_v3_mtp_module_and_the_685b_checkpoint():
    # DeepSeek-V3 README_WEIGHTS.md: "685B, which includes 671B of the Main Model weights and 14B of the
    # Multi-Token Prediction (MTP) Module weights". The MTP module trains with the embedding and output head
    # shared (report sec. 2.2): its own weights are 11.61B. The checkpoint stores its own copies of both
    # (layer 61: embed_tokens, shared_head.head): 13.46B, and every fp8 weight carries one fp32 scale per
    # 128 x 128 block (weight_scale_inv; the router, norms, embeddings and head stay bf16).
    shape = preset("deepseek-v3")
    counts = param_counts(shape)
    assert counts.mtp == 11_610_067_968
    assert n_params(shape) == counts.main + counts.mtp  # model state is charged for what trains, MTP included
    copies = 2 * shape.vocab * shape.hidden
    correction_bias = (counts.moe_layers + 1) * shape.n_experts  # the gates' e_score_correction_bias buffers
    stored = counts.main + counts.mtp + copies + correction_bias
    assert stored == 684_489_845_504

    def blocks(out_features, in_features):
        return math.ceil(out_features / 128) * math.ceil(in_features / 128)

    h, H = shape.hidden, shape.n_heads
    attention = (blocks(shape.q_lora_rank, h) + blocks(H * shape.head_dim, shape.q_lora_rank)
                 + blocks(shape.kv_lora_rank + shape.qk_rope_head_dim, h)
                 + blocks(H * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank)
                 + blocks(h, H * shape.v_head_dim))  # fmt: skip
    dense = 2 * blocks(shape.ffn, h) + blocks(h, shape.ffn)
    expert = 2 * blocks(shape.expert_ffn, h) + blocks(h, shape.expert_ffn)
    moe = (shape.n_experts + shape.n_shared_experts) * expert
    scales = (3 * (attention + dense) + (counts.moe_layers + 1) * (attention + moe)
              + blocks(h, 2 * h))  # the MTP module's eh_proj  # fmt: skip
    assert round((stored + scales) / 1e9) == 685  # 684.53B
    assert 685 - round(counts.main / 1e9) == 14  # "14B" is the difference of the two rounded figures


def megatron_counts(s: ModelShape) -> tuple[int, int]:
    """Megatron-LM megatron/training/theoretical_memory_usage.py (commit d98e8a6) compute_weight_and_optimizer_memory,
    its arithmetic written out for a MoE/MLA shape: (num_total_parameters, num_active_parameters), without MTP."""
    h, norm_size, gated = s.hidden, 1, 3 / 2
    if s.is_mla:
        q_term = s.q_lora_rank * (h + s.n_heads * (s.qk_nope_head_dim + s.qk_rope_head_dim) + norm_size)
        attention = (q_term + s.kv_lora_rank * (h + s.n_heads * (s.qk_nope_head_dim + s.v_head_dim) + norm_size)
                     + h * s.qk_rope_head_dim + s.n_heads * s.v_head_dim * h)  # fmt: skip
    else:
        attention = 2 * h * h * ((1 + s.n_kv_heads / s.n_heads) * s.n_heads * s.head_dim / h)
    dense = attention + 2 * h * s.ffn * gated + 2 * h * norm_size
    shared = 2 * h * s.shared_ffn * gated
    routed, active_routed = (2 * h * s.routed_ffn * n * gated for n in (s.n_experts, s.experts_per_token))
    moe = attention + shared + routed + 2 * h * norm_size + h * s.n_experts
    moe_active = moe - routed + active_routed
    qk_norm = 2 * s.head_dim if s.qk_norm else 0  # Qwen3's per-head q/k norm weights, which Megatron leaves out
    dense, moe, moe_active = dense + qk_norm, moe + qk_norm, moe_active + qk_norm
    L_moe = moe_layer_count(s)
    embeddings = 2 * h * s.vocab  # untied
    block = dense * (s.n_layers - L_moe) + h * norm_size
    return (int(block + moe * L_moe + embeddings), int(block + moe_active * L_moe + embeddings))


@pytest.mark.parametrize("name", MOE)
def test_counts_equal_megatrons_formula(name):
    counts = param_counts(preset(name))
    assert megatron_counts(preset(name)) == (counts.main, counts.active)


@pytest.mark.parametrize("name", MOE)
def test_config_json_reads_as_the_preset(name):
    model = config_model(f"examples/configs/{name}.json")
    assert replace(model.shape, name=name) == PRESETS[name]
    assert model.n_params == n_params(PRESETS[name])


def test_layer_patterns():
    v3 = preset("deepseek-v3")
    assert [is_moe_layer(v3, i) for i in range(5)] == [False, False, False, True, True]  # first_k_dense_replace 3
    assert moe_layer_count(v3) == 58
    assert moe_layer_count(preset("qwen3-235b-a22b")) == 94 and moe_layer_count(preset("mixtral-8x7b")) == 32
    base = json.loads(Path("examples/configs/qwen3-30b-a3b.json").read_text())
    every_other = shape_from_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    # modeling_qwen3_moe.py: MoE where (layer_idx + 1) % decoder_sparse_step == 0 and not in mlp_only_layers
    assert [i for i in range(8) if is_moe_layer(every_other, i)] == [1, 3, 7]
    dense = param_counts(every_other)
    assert dense.moe_layers == 23 and dense.layers == 23 * dense.per_moe_layer + 25 * dense.per_layer
    freq = shape_from_config({**json.loads(Path("examples/configs/deepseek-v3.json").read_text()), "moe_layer_freq": 2})
    assert [i for i in range(8) if is_moe_layer(freq, i)] == [4, 6]  # DeepSeek: i >= k and i % freq == 0


def test_fewer_layers_keep_the_pattern():
    four = replace(preset("deepseek-v3"), n_layers=4)
    assert moe_layer_count(four) == 1
    assert param_counts(four).main == 3 * param_counts(four).per_layer + param_counts(four).per_moe_layer + (
        2 * four.vocab * four.hidden + four.hidden)


def test_latent_attention_params():
    # modeling_deepseek_v3.py DeepseekV3Attention: q_a, q_a_layernorm, q_b, kv_a_proj_with_mqa, kv_a_layernorm, kv_b, o
    v3 = preset("deepseek-v3")
    q = 7168 * 1536 + 1536 + 1536 * 128 * 192
    kv = 7168 * (512 + 64) + 512 + 512 * 128 * (128 + 128)
    o = 128 * 128 * 7168
    assert param_counts(v3).per_layer == q + kv + o + 3 * 7168 * 18432 + 2 * 7168
    no_q_rank = replace(v3, q_lora_rank=0)  # DeepSeek-V2-Lite: one W_q
    assert param_counts(v3).per_layer - param_counts(no_q_rank).per_layer == q - 7168 * 128 * 192


@pytest.mark.parametrize("changes,message", [
    (dict(experts_per_token=9), "experts per token (9) must be between 1 and the 8 routed experts"),
    (dict(experts_per_token=0), "must be between 1 and the 8"),
    (dict(n_experts=0), "need routed experts"),
    (dict(moe_every=0), "moe_every must be positive"),
    (dict(moe_every=2, moe_offset=2), "moe_offset (2) must be below moe_every (2)"),
    (dict(router="argmax"), "unknown router 'argmax'"),
    (dict(expert_ffn=0), "expert_ffn must be positive"),
    (dict(dense_layers=(-1,)), "a dense layer index must be positive"),
    (dict(dense_layers=[1]), "dense_layers must be a tuple"),
    (dict(q_lora_rank=64), "q_lora_rank describes latent attention (MLA), which needs kv_lora_rank > 0"),
])  # fmt: skip
def test_bad_expert_fields(changes, message):
    with pytest.raises(InputError, match=re.escape(message)):
        replace(preset("mixtral-8x7b"), **changes)


@pytest.mark.parametrize("changes,message", [
    (dict(qk_rope_head_dim=63, head_dim=191), "even qk_rope_head_dim"),
    (dict(v_head_dim=0), "needs v_head_dim > 0"),
    (dict(n_kv_heads=8), "kv heads (8) must equal heads (128)"),
    (dict(head_dim=128), "head_dim is qk_nope_head_dim + qk_rope_head_dim = 192"),
    (dict(qk_norm=True), "not modelled"),
])  # fmt: skip
def test_bad_latent_fields(changes, message):
    with pytest.raises(InputError, match=re.escape(message)):
        replace(preset("deepseek-v3"), **changes)


@pytest.mark.parametrize("edit,message", [
    ({"num_experts_per_tok": 300}, "experts per token (300) must be between 1 and the 256 routed experts"),
    ({"num_experts_per_tok": "eight"}, "'num_experts_per_tok' must be a whole number"),
    ({"norm_topk_prob": "yes"}, "must be true or false"),
    ({"qk_rope_head_dim": 63}, "even qk_rope_head_dim"),
])  # fmt: skip
def test_bad_moe_configs_are_one_line(tmp_path, edit, message):
    config = {**json.loads(Path("examples/configs/deepseek-v3.json").read_text()), **edit}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(InputError, match=re.escape(message)) as e:
        config_model(path)
    assert "\n" not in str(e.value)


def test_qwen3_moe_mlp_only_layers_must_be_indices(tmp_path):
    config = {**json.loads(Path("examples/configs/qwen3-30b-a3b.json").read_text()), "mlp_only_layers": "none"}
    with pytest.raises(InputError, match="'mlp_only_layers' must be a list of layer indices"):
        shape_from_config(config)


moe_shapes = st.builds(
    lambda layers, experts, k, ffn, shared, first, every: ModelShape(
        n_layers=layers, hidden=256, n_heads=4, ffn=512, gated_mlp=True, norm="rmsnorm", positions="rope",
        vocab=1000, n_experts=experts, experts_per_token=min(k, experts), expert_ffn=ffn, n_shared_experts=shared,
        first_dense_layers=first, moe_every=every),
    st.integers(1, 12), st.integers(1, 64), st.integers(1, 8), st.integers(16, 1024), st.integers(0, 2),
    st.integers(0, 4), st.integers(1, 3),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(moe_shapes)
def test_active_never_exceeds_total(shape):
    counts = param_counts(shape)
    assert 0 < counts.active <= counts.main <= counts.total
    idle = (shape.n_experts - shape.experts_per_token) * expert_params(shape) * counts.moe_layers
    assert counts.main - counts.active == idle  # only the routed experts a token skips are inactive


@settings(max_examples=60, deadline=None)
@given(moe_shapes)
def test_a_dense_shape_is_what_it_was(shape):
    dense = replace(shape, n_experts=0, experts_per_token=0, expert_ffn=None, n_shared_experts=0)
    counts = param_counts(dense)
    assert counts.moe_layers == counts.per_moe_layer == counts.mtp == 0
    assert counts.total == counts.main == counts.active == active_params(dense)
    assert counts.total == counts.embedding + counts.per_layer * shape.n_layers + counts.final_norm + counts.lm_head


# ---- memory: the textbook's MoE and MLA terms, the routing assumption ---------------------------------

from memcalc.memory.activations import logits_memory, textbook_activations  # noqa: E402
from memcalc.model.moe import Routing, expert_capacity, routed_tokens  # noqa: E402
from memcalc.model.tricks import Tricks, parse_tricks  # noqa: E402

S = 4096


def test_moe_layer_terms_by_hand():
    # Mixtral at seq 4096, bf16 + flash: Korthikanti's attention (11sbh) and norms (4sbh), and the MoE block
    m = preset("mixtral-8x7b")
    sb, h, E, k, f = S, 4096, 8, 2, 14336
    router = 2 * sb * h + 4 * sb * E
    topk = 8 * sb * k + 4 * sb * k
    dispatch = 2 * sb * k * h + 8 * sb * k
    experts = 8 * sb * k * f  # gate out, silu out, up out, their product: 2 bytes each per routed token
    combine = 2 * sb * k * h + 2 * sb * k + 8 * sb * k
    a = textbook_activations(m, S, 1, parse_tricks("bf16,flash"))
    assert a.per_layer_bytes == 11 * sb * h + 4 * sb * h + router + topk + dispatch + experts + combine
    assert a.total_bytes == 32 * a.per_layer_bytes
    no_flash = textbook_activations(m, S, 1, parse_tricks("bf16"))
    assert no_flash.per_layer_bytes - a.per_layer_bytes == 5 * 32 * S * S  # 5·a·s²·b, as for a dense layer


def test_latent_attention_and_deepseek_groups_by_hand():
    v3 = preset("deepseek-v3")
    sb, h, H = S, 7168, 128
    mla = 2 * sb * h + 4 * sb * 1536 + 4 * sb * 512 + 4 * sb * H * 192 + 4 * sb * H * 128 + sb * h
    moe = (2 * sb * h + 4 * sb * 256 + 4 * sb * h  # the fp32 gate keeps an fp32 copy of its input
           + 12 * sb * 8 + (2 * sb * 8 * h + 8 * sb * 8) + 8 * sb * 8 * 2048
           + (2 * sb * 8 * h + 2 * sb * 8 + 8 * sb * 8) + 8 * sb * 2048)  # fmt: skip
    a = textbook_activations(v3, S, 1, parse_tricks("bf16,flash"))
    dense, layer, mtp = a.groups
    assert (dense.count, layer.count, mtp.count) == (3, 58, 1)
    assert dense.kept_bytes == mla + 19 * sb * h + 4 * sb * h  # Korthikanti's MLP for the dense layers
    assert layer.kept_bytes == mla + 4 * sb * h + moe
    assert mtp.kept_bytes == layer.kept_bytes + 8 * sb * h  # two norms' inputs, the 2h-wide projection input
    assert a.total_bytes == 3 * dense.kept_bytes + 58 * layer.kept_bytes + mtp.kept_bytes
    ckpt = textbook_activations(v3, S, 1, parse_tricks("bf16,flash,ckpt"))
    assert ckpt.total_bytes == 62 * 2 * sb * h and ckpt.rebuilt_bytes == mtp.kept_bytes
    logits = logits_memory(v3, S, 1, "bf16").total_bytes
    assert logits == 2 * 6 * S * v3.vocab  # the MTP module's prediction is a second set of logits


def test_routed_tokens():
    q = preset("qwen3-30b-a3b")  # 128 experts, 8 per token
    assert routed_tokens(q, S) == S * 8
    assert routed_tokens(q, S, Routing(imbalance=4)) == S * 8  # one GPU holds every expert: the sum is fixed
    assert expert_capacity(q, S, Routing(capacity_factor=1.25)) == 320  # ⌈1.25 · 4096 · 8 / 128⌉
    assert routed_tokens(q, S, Routing(capacity_factor=1.25)) == 128 * 320  # padded to capacity
    assert routed_tokens(q, S, Routing(imbalance=2), ep=8) == 2 * S * 8  # 16 experts here, each at twice its share
    assert routed_tokens(q, S, Routing(imbalance=100), ep=8) == 8 * S * 8  # at most every token once per expert here
    assert routed_tokens(q, S, Routing(imbalance=100), ep=128) == 128 * S  # one expert a GPU: all 128 GPUs' tokens


@pytest.mark.parametrize("kwargs,message", [
    (dict(imbalance=0.5), "expert imbalance must be at least 1"),
    (dict(imbalance=float("nan")), "expert imbalance must be at least 1"),
    (dict(capacity_factor=0), "capacity factor must be a positive number"),
    (dict(capacity_factor=float("inf")), "capacity factor must be a positive number"),
])  # fmt: skip
def test_bad_routing(kwargs, message):
    with pytest.raises(InputError, match=message):
        Routing(**kwargs)


@settings(max_examples=80, deadline=None)
@given(moe_shapes, st.floats(1, 64), st.floats(1, 64), st.sampled_from([1, 2, 4]),
       st.sampled_from(["bf16", "bf16,flash", "bf16,flash,ckpt", "fp32"]))  # fmt: skip
def test_imbalance_never_lowers_the_peak(shape, x1, x2, ep, tricks):
    low, high = sorted((x1, x2))
    assert routed_tokens(shape, 256, Routing(imbalance=low), ep) <= routed_tokens(shape, 256, Routing(imbalance=high), ep)
    t = parse_tricks(tricks)
    calm = textbook_activations(shape, 256, 1, t, Routing(imbalance=low))
    busy = textbook_activations(shape, 256, 1, t, Routing(imbalance=high))
    assert busy.peak_bytes >= calm.peak_bytes


@settings(max_examples=40, deadline=None)
@given(moe_shapes, st.floats(1, 4))
def test_padding_to_capacity_never_lowers_the_peak_below_balanced(shape, cf):
    t = Tricks("bf16", flash=True)
    balanced = textbook_activations(shape, 256, 1, t)
    padded = textbook_activations(shape, 256, 1, t, Routing(capacity_factor=cf))
    assert padded.peak_bytes >= balanced.peak_bytes  # cf >= 1: every expert runs at least its balanced share


# ---- memcalc estimate on a MoE config ---------------------------------------------------------------

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b"])
def test_estimate_on_a_moe_config(name):
    result = run("estimate", "--config", f"examples/configs/{name}.json")
    assert result.exit_code == 0, result.output
    main, active = EXACT[name]
    total = n_params(PRESETS[name])
    assert f"{total:,} parameters" in result.stdout and f"{active:,} active per token" in result.stdout
    if total != main:
        assert f"({main:,} + {total - main:,} in 1 MTP module)" in result.stdout
    for label in ("fp32", "bf16", "bf16+flash", "bf16+flash+ckpt", "bf16+selective"):
        assert f"\n {label} " in result.stdout
    assert "Peak memory per GPU (reference stack, its step replayed op by op)" in result.stdout  # the verdict
    if name == "deepseek-v3":  # data parallel alone gathers whole MoE layers: ZeRO-3 never fits an H100 at seq 4096
        assert "nothing in the toolbox makes it fit: ZeRO-3 over 4,096 GPUs still peaks at" in result.stdout
        assert "`memcalc plan` searches tensor, pipeline and expert parallel layouts" in result.stdout
    else:
        assert "Cheapest combination that fits" in result.stdout or "Fits" in result.stdout


def test_estimate_json_carries_the_routing_and_the_verdicts_source():
    result = run("estimate", "--model", "qwen3-30b-a3b", "--format", "json", "--capacity-factor", "1.25",
                 "--tricks", "bf16,flash")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    routing = data["setup"]["routing"]
    assert (routing["capacity_factor"], routing["imbalance"], routing["balanced"]) == (1.25, 1.0, False)
    assert data["not_replayed"].startswith("the exact model replays balanced routing")  # the textbook decides
    assert data["flops"]["n_params"] == EXACT["qwen3-30b-a3b"][1]  # 6N counts the active parameters


def test_capacity_factor_moves_the_peak_and_imbalance_on_one_gpu_does_not():
    def peak(*extra):
        out = run("estimate", "--model", "qwen3-30b-a3b", "--format", "json", "--tricks", "bf16,flash", *extra)
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)["memory"][0]["activation_peak_bytes"]

    balanced = peak()
    assert peak("--expert-imbalance", "4") == balanced
    assert peak("--capacity-factor", "2") > balanced


@pytest.mark.parametrize("args,message", [
    (["--model", "qwen3-8b", "--expert-imbalance", "2"], "--expert-imbalance describes how a mixture of experts"),
    (["--model", "qwen3-30b-a3b", "--expert-imbalance", "0.5"], "expert imbalance must be at least 1"),
    (["--model", "qwen3-30b-a3b", "--capacity-factor", "0"], "capacity-factor must be a positive number"),
    (["--model", "qwen3-30b-a3b", "--capacity-factor", "lots"], "capacity-factor must be a number"),
])  # fmt: skip
def test_bad_moe_options_are_one_line(args, message):
    result = run("estimate", *args)
    assert result.exit_code == 2
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


# ---- FLOPs and the roofline -------------------------------------------------------------------------

from memcalc.model.flops import attention_flops, flops, model_per_token  # noqa: E402
from memcalc.model.gpus import gpu  # noqa: E402
from memcalc.time.calibration import calibration_for  # noqa: E402
from memcalc.time.experts import compute_bound_tokens, expert_gemms, gemm_time  # noqa: E402


def test_model_flops_count_active_parameters_and_mla_heads():
    v3 = preset("deepseek-v3")
    f = flops(v3, n_params(v3), S)
    counts = param_counts(v3)
    mtp_idle = (256 - 8) * expert_params(v3)  # the MTP module's block is MoE too
    assert f.n_params == counts.active + counts.mtp - mtp_idle  # 6N: what a token goes through, MTP included
    # Megatron-LM training.py's MLA core term, non-causal: QKᵀ over d_nope + d_rope = 192, PV over d_v = 128
    assert attention_flops(v3, S) == 6 * (61 + 1) * 128 * (192 + 128) * S
    q = preset("qwen3-235b-a22b")
    weights = 94 * (2 * 4096 * 8192 + 2 * 4096 * 512 + 4096 * 128 + 3 * 4096 * 1536 * 8)
    assert model_per_token(q, S) == 6 * weights + 12 * 94 * 8192 * S + 6 * 4096 * 151936


@pytest.mark.parametrize("name,tokens_each", [("deepseek-v3", 128), ("qwen3-30b-a3b", 256), ("qwen3-235b-a22b", 256),
                                              ("mixtral-8x7b", 1024)])  # fmt: skip
def test_expert_gemms_against_the_ridge(name, tokens_each):
    """At seq 4096 the fine-grained experts get 128-256 tokens each: DeepSeek-V3's and Qwen3-30B's (hidden 2048)
    below the H100's ridge, memory-bound; Qwen3-235B's (hidden 4096) at it; Mixtral's 8 experts get 1,024:
    compute-bound. The crossover is where the intensity meets the ridge."""
    shape, h100 = preset(name), gpu("h100-sxm")
    cal = calibration_for("h100-sxm", None, None)
    gate_up = expert_gemms(shape, S, "bf16")[0]
    assert gate_up.m == tokens_each
    t = gemm_time(gate_up, "bf16", h100, cal)
    cross = compute_bound_tokens(shape, "bf16", h100, cal)
    assert t.bound == ("compute" if tokens_each >= cross else "memory")
    assert name in ("mixtral-8x7b", "qwen3-235b-a22b") or t.bound == "memory"
    at, below = (replace(gate_up, m=m) for m in (cross, cross - 1))
    assert at.intensity >= t.ridge > below.intensity
    assert t.grouped_seconds <= gate_up.count * t.seconds  # one launch for all experts never costs more
