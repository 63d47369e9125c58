"""Sliding windows shorter than the sequence on the hf stack, as Transformers 5.24 runs them: Mistral's and
Phi-3's create_sliding_window_causal_mask on every layer (Gemma 2's and 3's alternating layers are in
tests/test_hf_gemma.py). Eager attention takes the additive (B, 1, T, T) mask, as without a window; sdpa
takes the bool mask from seq >= the window, skips GQA-in-SDPA (repeat_kv copies k and v to every head)
and runs on CUDA's memory-efficient kernel with the mask made an additive bias
(memcalc.exact.hf.attention sdpa_masked_forward, verify/hf.py's). Held to the byte against Transformers'
own classes on meta (tiny shapes allocation by allocation; Mistral 7B at seq 8192 with its window of 4096
and Phi-3-mini at 4096, three blocks deep at full width, with FlopCounterMode's count) and on real CPU
tensors (SDPA's CPU flash kernel, which takes the mask). Where CUDA differs from the meta device: its
efficient kernel lays the gradients of q, k and v out as its inputs, where the meta function lays them
out (B, T, n, d) (named in memcalc.exact.hf.attention grad_copies), and it adds an fp32 (B, n, T)
scratch in backward.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.hfconfig import ARCHITECTURES  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.test_stack_hf import ALL_TRICKS, HF, assert_replayed, assert_same_phases  # noqa: E402

BASE = dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, vocab=200, tied_embeddings=False,
            sliding_window=16)  # fmt: skip
MISTRAL = ModelShape(arch="mistral", **{**ARCHITECTURES["mistral"], **BASE})
PHI3 = ModelShape(arch="phi3", **{**ARCHITECTURES["phi3"], **BASE})
TINY = {
    "mistral": MISTRAL,
    "mistral-mha-dropout": replace(MISTRAL, n_kv_heads=4, dropout=0.1),
    "mistral-mqa": replace(MISTRAL, n_kv_heads=1),
    "phi3-partial-rotary": replace(PHI3, rotary_fraction=0.5),
}


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny_windows_allocation_by_allocation(name, batch):
    """Window 16 at seq 24: every trick set, every allocation of forward, backward and the optimizer step."""
    for tricks in ALL_TRICKS:
        assert_replayed(TINY[name], 24, batch, parse_tricks(tricks))


def test_unaligned_keys_pad_the_bias():
    """preprocess_mask pads the expanded (B, n, T, T) bias to a multiple of 16 keys (constant_pad_nd), and the
    bool mask's additive copy dies with the padding: seq 23."""
    for tricks in ("bf16,flash", "bf16,flash,selective"):
        assert_replayed(MISTRAL, 23, 2, parse_tricks(tricks))
    e = exact_step(MISTRAL, 23, 2, parse_tricks("bf16,flash"), stack=HF)
    padded = [t for t in e.activations.terms if t.name.startswith("attention core: _scaled_dot_product_efficient")
              and "attn_bias" in t.name]  # fmt: skip
    assert [t.value for t in padded] == [2 * MISTRAL.n_heads * 23 * 32 * 2]


def test_the_window_costs_the_mask_and_repeated_heads():
    """The efficient kernel saves the bias (B, n, T, T), a view of the (B, 1, T, T) additive mask, and the
    repeated k and v: what Mistral's window adds to its step's saved tensors at seq >= the window, where
    without one sdpa runs the flash kernel on the unrepeated heads."""
    B, T, t = 2, 32, parse_tricks("bf16,flash")
    windowed = exact_step(MISTRAL, T, B, t, stack=HF).activations
    full = exact_step(replace(MISTRAL, sliding_window=0), T, B, t, stack=HF).activations
    s = MISTRAL
    kv = 2 * B * s.n_heads * T * s.head_dim * 2  # k and v repeated to every head, bf16
    mask = B * T * T * 2  # the additive mask, bf16
    lse = B * s.n_heads * 32 * 4 - B * s.n_heads * T * 4  # the efficient kernel's logsumexp rounds T up to 32
    unrepeated = 2 * B * s.n_kv_heads * T * s.head_dim * 2  # what flash saved of the cache's k and v
    rng = 8 + 8 - (16 + 8)  # the efficient kernel's int64 seed and offset, flash's uint64 (2,) seed and offset
    assert windowed.total_bytes - full.total_bytes == s.n_layers * (kv + mask + lse - unrepeated + rng)


@pytest.mark.parametrize("name,seq,tricks", [("mistral-7b", 8192, "fp32"), ("mistral-7b", 8192, "bf16"),
                                             ("mistral-7b", 8192, "bf16,flash"), ("phi3-mini", 4096, "bf16,flash")])
def test_full_size_three_blocks(name, seq, tricks):
    """Every phase's bytes as measured on meta, and FlopCounterMode's count (the efficient kernel: every
    score, as counted)."""
    assert PRESETS[name].sliding_window < seq
    assert_same_phases(replace(PRESETS[name], n_layers=3), seq, tricks)


@pytest.mark.parametrize("name", ["mistral", "phi3-partial-rotary"])
def test_real_cpu_tensors(name):
    """On real CPU tensors SDPA's CPU flash kernel takes the additive mask (saved for its backward), its
    output laid out as q."""
    for tricks in ("fp32", "bf16,flash", "bf16,flash,selective", "bf16,flash,ckpt"):
        assert_replayed(TINY[name], 24, 2, parse_tricks(tricks), device="cpu")


def test_qwen2_sliding_layers_refused():
    shape = replace(MISTRAL, arch="qwen2", qkv_bias=True)
    with pytest.raises(InputError, match="Qwen2's use_sliding_window"):
        exact_step(shape, 24, 1, parse_tricks("bf16"), stack=HF)
