"""Transformers' OLMo 2 and Phi-3 on the hf stack: memcalc.exact.hf.olmo2's and hf_phi3's replays equal the
measurement of Transformers' own Olmo2ForCausalLM and Phi3ForCausalLM (verify/hf.py) to the byte: tiny
models allocation by allocation for every trick set, on meta and on real CPU tensors; olmo2-7b and
phi3-mini three blocks deep at full width; and what each adds to Llama's step (OLMo 2's fp32 q/k norms over
whole projections, Phi-3's fused projections whose outputs live on through their slices).
Measured with Transformers 5.24.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.hfconfig import ARCHITECTURES  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.test_stack_hf import ALL_TRICKS, HF, assert_parameters, assert_replayed, assert_same_phases  # noqa: E402
from verify.meta import measure_step  # noqa: E402

BASE = dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, vocab=200, tied_embeddings=False)
OLMO2 = ModelShape(arch="olmo2", **{**ARCHITECTURES["olmo2"], **BASE})
PHI3 = ModelShape(arch="phi3", **{**ARCHITECTURES["phi3"], **BASE})
TINY = {
    "olmo2": OLMO2,
    "olmo2-mha-dropout": replace(OLMO2, n_kv_heads=4, dropout=0.1),
    "phi3": PHI3,
    "phi3-partial-rotary-dropout": replace(PHI3, rotary_fraction=0.5, dropout=0.1),  # Phi-3-small's layout
    "phi3-mqa-tied": replace(PHI3, n_kv_heads=1, tied_embeddings=True),
}


@pytest.mark.parametrize("name", TINY)
def test_parameters_as_transformers_registers_them(name):
    """named_parameters(), names, shapes and order (Phi-3's qkv_proj and gate_up_proj one matrix each)."""
    assert_parameters(TINY[name])


@pytest.mark.parametrize("name,batch", [(n, 1) for n in TINY] + [("olmo2", 2), ("phi3-partial-rotary-dropout", 2)])
def test_tiny_models_allocation_by_allocation(name, batch):
    """Every trick set, every allocation of forward, backward and the optimizer step, in order."""
    for tricks in ALL_TRICKS:
        assert_replayed(TINY[name], 24, batch, parse_tricks(tricks))


def test_olmo2_norms_over_whole_projections():
    """Olmo2Attention's q_norm and k_norm run on (B, T, n*d) before the view: their fp32 products are saved
    (the RMSNorm's input upcast and its normalised output), over all heads at once, where Qwen 3 normalises
    each head's d. The step's saved bytes are what Transformers saves."""
    shape, t = TINY["olmo2"], parse_tricks("bf16")
    step, _ = measure_step(shape, 24, 2, t, stack=HF, count_flops=False)
    assert step.saved_bytes == exact_step(shape, 24, 2, t, stack=HF).activations.total_bytes
    widths = shape.qk_norm_widths
    assert widths == (shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim)


def test_phi3_gate_saved_as_the_whole_gate_up_output():
    """Phi3MLP chunks one gate_up_proj output into gate and up, views of it: silu saves the gate, and with it
    the storage of the whole (B, T, 2·ffn) output, where Llama's silu saves its gate_proj's (B, T, ffn). The
    step's saved bytes are what Transformers saves."""
    shape, B, T, t = TINY["phi3"], 2, 24, parse_tricks("bf16")
    step, _ = measure_step(shape, T, B, t, stack=HF, count_flops=False)
    saved = exact_step(shape, T, B, t, stack=HF).activations
    assert step.saved_bytes == saved.total_bytes
    silu = [term.value for term in saved.terms if term.name == "mlp: silu saves self (bf16)"]
    assert silu == [B * T * 2 * shape.ffn * 2]  # one layer's terms


# Three blocks at full width. Phi-3-mini's window is 2047: below it no mask differs from the causal one, and
# sdpa skips the mask only while the keys are fewer than the window (2046 for flash).
FULL_SIZE = [("olmo2-7b", 2048, "fp32"), ("olmo2-7b", 2048, "bf16"), ("olmo2-7b", 4096, "bf16,flash"),
             ("phi3-mini", 2047, "fp32"), ("phi3-mini", 2047, "bf16"), ("phi3-mini", 2046, "bf16,flash")]


@pytest.mark.parametrize("name,seq,tricks", FULL_SIZE)
def test_full_size_three_blocks(name, seq, tricks):
    """Every phase's bytes as measured on meta, and FlopCounterMode's count."""
    assert_same_phases(replace(PRESETS[name], n_layers=3), seq, tricks)


@pytest.mark.parametrize("name", ["olmo2", "phi3-partial-rotary-dropout"])
def test_real_cpu_tensors(name):
    """On real CPU tensors: eager, and sdpa on SDPA's CPU flash kernel (which has no dropout)."""
    for tricks in ("fp32", "bf16", "bf16,flash"):
        assert_replayed(replace(TINY[name], dropout=0.0), 24, 2, parse_tricks(tricks), device="cpu")
