"""Transformers' GPT-NeoX (Pythia) on the hf stack: memcalc.exact.hf.gpt_neox's replay equals the measurement
of Transformers' own GPTNeoXForCausalLM (verify/hf.py) to the byte: tiny models allocation by allocation for
every trick set, on meta and on real CPU tensors; pythia-6.9b three blocks deep at full width; and what its
parallel residual changes (one LayerNorm input saved for both branches). Measured with Transformers 5.24.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.hf.model import param_shapes  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.hfconfig import ARCHITECTURES  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.test_stack_hf import ALL_TRICKS, HF, assert_parameters, assert_replayed, assert_same_phases  # noqa: E402
from verify.meta import measure_step  # noqa: E402

NEOX = ModelShape(arch="gpt_neox", n_layers=2, hidden=64, n_heads=4, n_kv_heads=4, ffn=160, vocab=200,
                  tied_embeddings=False, rotary_fraction=0.25, parallel_residual=True,
                  **ARCHITECTURES["gpt_neox"])  # fmt: skip
TINY = {
    "pythia": NEOX,  # Pythia's wiring: a quarter of each head rotated, the parallel residual
    "sequential-full-rotary-dropout": replace(NEOX, parallel_residual=False, rotary_fraction=1.0, dropout=0.1),
    "tied": replace(NEOX, tied_embeddings=True),
}


@pytest.mark.parametrize("name", TINY)
def test_parameters_as_transformers_registers_them(name):
    """named_parameters(), names, shapes and order (one query_key_value per layer, every bias)."""
    assert_parameters(TINY[name])


@pytest.mark.parametrize("name,batch", [(n, 1) for n in TINY] + [("pythia", 2), ("sequential-full-rotary-dropout", 2)])
def test_tiny_models_allocation_by_allocation(name, batch):
    """Every trick set, every allocation of forward, backward and the optimizer step, in order."""
    for tricks in ALL_TRICKS:
        assert_replayed(TINY[name], 24, batch, parse_tricks(tricks))


def test_parallel_residual_saves_one_norm_input():
    """GPTNeoXLayer with use_parallel_residual: both LayerNorms read the layer's input, so the second saves
    nothing new, where the sequential layer's post_attention_layernorm saves attn_output + x: one (B, T, h)
    tensor a layer more, as Transformers saves it."""
    B, T, t = 2, 24, parse_tricks("bf16")
    saved = {}
    for parallel in (True, False):
        shape = replace(NEOX, parallel_residual=parallel)
        step, _ = measure_step(shape, T, B, t, stack=HF, count_flops=False)
        saved[parallel] = exact_step(shape, T, B, t, stack=HF).activations
        assert step.saved_bytes == saved[parallel].total_bytes
    assert saved[False].per_layer_bytes - saved[True].per_layer_bytes == B * T * NEOX.hidden * 2


def test_grouped_heads_refused():
    """modeling_gpt_neox.py has one head count for q, k and v: a GQA shape is refused, saying why."""
    with pytest.raises(InputError, match="gpt_neox builds"):
        param_shapes(replace(NEOX, n_kv_heads=2), "gpt_neox")


@pytest.mark.parametrize("tricks", ["fp32", "bf16", "bf16,flash"])
def test_full_size_three_blocks(tricks):
    """Pythia-6.9B at seq 2048 (its max_position_embeddings): every phase's bytes as measured on meta, and
    FlopCounterMode's count."""
    assert_same_phases(replace(PRESETS["pythia-6.9b"], n_layers=3), 2048, tricks)


def test_real_cpu_tensors():
    """On real CPU tensors: eager, and sdpa on SDPA's CPU flash kernel (which has no dropout)."""
    for name in ("pythia", "sequential-full-rotary-dropout"):
        for tricks in ("fp32", "bf16", "bf16,flash"):
            assert_replayed(replace(TINY[name], dropout=0.0), 24, 2, parse_tricks(tricks), device="cpu")
