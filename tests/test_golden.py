"""Golden numbers from the papers, pinned to the byte (decimal GB in the comments)."""

import pytest

from memcalc.exact.kernels import step_flops
from memcalc.memory.activations import attention_detail, logits_memory, textbook_activations
from memcalc.memory.estimate import Setup, estimate
from memcalc.memory.state import StateSharding, model_state
from memcalc.model.flops import flops, korthikanti_selective_overhead
from memcalc.model.gpus import gpu
from memcalc.model.presets import canonical_model, preset
from memcalc.model.shape import override
from memcalc.model.tricks import Tricks

N_8B = 8_000_000_000
SEQ = 8192


@pytest.fixture(scope="module")
def est():
    return estimate(canonical_model(N_8B), Setup(seq_len=SEQ), gpu("h100-sxm"))


def by_label(est, label):
    return next(a for a in est.activations if a.tricks.label == label)


def test_params_8e9_is_the_lessons_shape():
    m = canonical_model(N_8B)
    assert (m.shape.n_layers, m.shape.hidden, m.shape.n_heads) == (36, 4096, 32)
    assert m.n_params == N_8B  # model state is charged for exactly N


def test_model_state_16_bytes_per_param(est):
    # Rajbhandari et al. 2019 sec. 3.1: mixed-precision Adam = 2 + 2 + 12 bytes/param -> 128 GB for 8B
    parts = {p.name: p.bytes for p in est.model_state.parts}
    assert parts == {"weights": 16e9, "grads": 16e9, "master": 32e9, "adam_m": 32e9, "adam_v": 32e9}
    assert est.model_state.total_bytes == 128_000_000_000
    assert est.model_state.bytes_per_param == 16


def test_fp32_recipe_is_4_4_8():
    # fp32 weights 4 + grads 4 + Adam m, v 8 = 16 bytes/param
    st = model_state(N_8B, "fp32", "adamw")
    assert [p.bytes_per_param for p in st.parts] == [4, 4, 4, 4]
    assert st.total_bytes == 128_000_000_000


def test_one_head_score_and_attention_part(est):
    # Korthikanti et al. 2022 sec. 4.1: one head's s×s matrix 2·s² bytes; 5·a·s²·b per layer
    d = est.attention
    assert d.score_one_head_bytes == 134_217_728
    assert d.scores_per_layer_bytes == 10_737_418_240
    assert d.layer_bytes == 11_878_268_928  # s·b·h·(34 + 5as/h) = 33,554,432 · 354


def test_bf16_activations_430_gb(est):
    # Korthikanti et al. 2022 eq. 1 × 36 layers: 427.6 GB ("430 GB")
    a = by_label(est, "bf16")
    assert a.per_layer_bytes == 11_878_268_928
    assert a.total_bytes == 427_617_681_408
    assert a.peak_bytes == a.total_bytes


def test_fp32_activations_860_gb(est):
    # every activation byte doubled: 855.2 GB ("about 860")
    assert by_label(est, "fp32").total_bytes == 855_235_362_816


def test_flash_41_gb(est):
    # FlashAttention (Dao et al. 2022) stores no s×s scores: 34·s·b·h per layer
    a = by_label(est, "bf16+flash")
    assert a.per_layer_bytes == 1_140_850_688
    assert a.total_bytes == 41_070_624_768


def test_checkpointing_2_4_gb_peak_3_6_gb(est):
    # Korthikanti et al. 2022 sec. 5: full recompute keeps 2·s·b·h per layer; backward rebuilds one layer
    a = by_label(est, "bf16+flash+ckpt")
    assert a.per_layer_bytes == 67_108_864
    assert a.total_bytes == 2_415_919_104
    assert a.peak_bytes == 3_556_769_792


def test_flops_6_to_8_per_param(est):
    # Kaplan et al. 2020: 6N per token; one more forward pass with full recompute: 8N (+1/3)
    assert est.flops.per_token == 48_000_000_000
    assert est.flops.per_token_full_recompute == 64_000_000_000
    assert est.flops.recompute_overhead == pytest.approx(1 / 3)


def test_gpt3_selective_saves_70_percent_for_2_7_percent_flops():
    # Korthikanti et al. 2022 sec. 5 and 6.3: GPT-3 175B (s 2048, v 51200): 70% of activations, +2.7% FLOPs
    shape = override(preset("gpt3-175b"), vocab=51200)
    full = textbook_activations(shape, 2048, 1, Tricks("bf16")).total_bytes
    selective = textbook_activations(shape, 2048, 1, Tricks("bf16", recompute="selective")).total_bytes
    assert 1 - selective / full == pytest.approx(0.702, abs=5e-4)
    assert korthikanti_selective_overhead(shape, 2048) == pytest.approx(0.027, abs=5e-4)
    # what PyTorch's recompute executes is QKᵀ again, a sixth of that: non-reentrant checkpointing stops
    # once the tensors backward needs are rebuilt, so attention over V is not rerun (FlopCounterMode on meta)
    sel = step_flops(shape, 2048, Tricks("bf16", recompute="selective"))
    assert sel.hardware_per_token - sel.model_per_token == 2 * shape.n_layers * shape.q_dim * 2048


def test_korthikanti_model_flops_formula_for_gpt3():
    # Korthikanti et al. 2022 sec. 6.3: model FLOPs per iteration 72·B·L·s·h²·(1 + s/6h + v/12hL)
    shape = override(preset("gpt3-175b"), vocab=51200)
    L, s, h, v = 96, 2048, 12288, 51200
    paper = 72 * L * s * h**2 * (1 + s / (6 * h) + v / (12 * h * L))
    ours = step_flops(shape, s, Tricks("bf16")).model_per_token * s
    # ours counts the shape's 12h² + 13h layer parameters (biases, LayerNorms); the paper only 12h²
    assert ours == pytest.approx(paper, rel=2e-4)


def test_h100_bf16_over_fp32_is_14_8():
    # NVIDIA H100 datasheet: 989 dense BF16 TFLOP/s against 67 FP32
    g = gpu("h100-sxm")
    assert g.bf16_tflops / g.fp32_tflops == pytest.approx(14.76, abs=0.01)
    assert f"{g.bf16_tflops / g.fp32_tflops:.1f}" == "14.8"


def test_zero_per_device_formulas():
    # Rajbhandari et al. 2019, Fig. 1 (Ψ = 7.5B, N_d = 64, K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    psi, nd = 7_500_000_000, 64
    expected = {0: (4 + 12) * psi, 1: 4 * psi + 12 * psi / nd, 2: 2 * psi + 14 * psi / nd, 3: 16 * psi / nd}
    for stage, paper in expected.items():
        got = model_state(psi, "bf16", "adamw", StateSharding(gpus=nd, zero=stage)).total_bytes
        assert got == pytest.approx(paper, abs=nd)  # ceil-division per part
    assert model_state(psi, "bf16", "adamw", StateSharding(nd, 1)).total_bytes / 1e9 == pytest.approx(31.4, abs=0.05)
    assert model_state(psi, "bf16", "adamw", StateSharding(nd, 2)).total_bytes / 1e9 == pytest.approx(16.6, abs=0.05)
    assert model_state(psi, "bf16", "adamw", StateSharding(nd, 3)).total_bytes / 1e9 == pytest.approx(1.88, abs=0.01)


def test_offload_moves_optimizer_state_to_host():
    # ZeRO-Offload (Ren et al. 2021): fp32 master + moments on the CPU, 16-bit weights and grads stay
    st = model_state(N_8B, "bf16", "adamw", StateSharding(offload=True))
    assert st.total_bytes == 32_000_000_000
    assert st.host_bytes == 96_000_000_000


def test_adam8bit_block_scales():
    # Dettmers et al. 2022: 1 byte per state element + an fp32 absmax per 256-element block (bitsandbytes)
    st = model_state(1024, "fp32", "adam8bit")
    assert [p.bytes for p in st.parts] == [4096, 4096, 1024 + 16, 1024 + 16]


def test_logits_rows():
    # lm_head output b·s·v in bf16, and its fp32 copy for cross-entropy
    shape = canonical_model(N_8B).shape
    logits = logits_memory(shape, SEQ, 1, "bf16")
    assert [t.value for t in logits.terms] == [2 * SEQ * 151936, 4 * SEQ * 151936]


def test_palm_attention_flops():
    # Chowdhery et al. 2022, App. B: 12·L·H·Q·T attention FLOPs per token (non-causal)
    f = flops(canonical_model(N_8B).shape, N_8B, SEQ)
    assert f.attention_per_token == 12 * 36 * 32 * 128 * 8192
    assert f.attention_per_token_causal * 2 == f.attention_per_token


def test_attention_share(est):
    assert est.attention.scores_share == pytest.approx(320 / 354)
    assert attention_detail(canonical_model(N_8B).shape, SEQ, 1).attention_share == pytest.approx(331 / 354)
