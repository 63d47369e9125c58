"""Transformers' sdpa at fp32 (fp32,flash on --stack hf), as CUDA runs it: SDPA's flash kernel takes 16 bits
only, so one key head per query head runs the memory-efficient kernel (causal, no bias) and grouped heads
the math path (repeat_interleave, the (B, nh, T, T) scores, _safe_softmax), which the meta device runs
itself. The replay equals Transformers 5.24's step on meta allocation by allocation (tiny shapes) and phase
by phase at full width; other stacks refuse fp32,flash in one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.hfconfig import ARCHITECTURES  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from memcalc.model.stacks import STACKS  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.test_stack_hf import assert_replayed, assert_same_phases  # noqa: E402

BASE = dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, vocab=200, tied_embeddings=False)
LLAMA = ModelShape(arch="llama", **{**ARCHITECTURES["llama"], **BASE})
TINY = {
    "llama-gqa": LLAMA,  # the math path
    "llama-mqa": replace(LLAMA, n_kv_heads=1),  # repeat_interleave copies even one key head
    "llama-mha": replace(LLAMA, n_kv_heads=4),  # the memory-efficient kernel
    "phi3-gqa": ModelShape(arch="phi3", **{**ARCHITECTURES["phi3"], **BASE}),  # q contiguous from its RoPE cat
    "gpt-neox": ModelShape(arch="gpt_neox", **{**ARCHITECTURES["gpt_neox"], **BASE, "n_kv_heads": 4},
                           rotary_fraction=0.25, parallel_residual=True),  # fmt: skip
    "mistral-window": replace(LLAMA, arch="mistral", sliding_window=16),  # seq 24: the masked call, at fp32
}
TRICKS = ("fp32,flash", "fp32,flash,ckpt", "fp32,flash,selective")


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_allocation_by_allocation(name):
    """Every allocation of forward, backward and the optimizer step, in order, micro-batch 1 and 2."""
    for tricks in TRICKS:
        for batch in (1, 2):
            assert_replayed(TINY[name], 24, batch, parse_tricks(tricks))


@pytest.mark.parametrize("name,seq", [("llama3-8b", 1024), ("pythia-6.9b", 2048)])
def test_full_size_three_blocks(name, seq):
    """Llama-3-8B (grouped heads: the math path) and Pythia-6.9B (the memory-efficient kernel): every
    phase's bytes as measured on meta, and FlopCounterMode's count."""
    assert_same_phases(replace(PRESETS[name], n_layers=3), seq, "fp32,flash")


def test_what_sdpa_saves_at_fp32():
    """Against eager attention at fp32, per layer: the math path keeps what eager keeps (q and kᵀ scaled, the
    fp32 probabilities, the repeated v: Llama-3-8B saves the same bytes), where the memory-efficient kernel
    keeps its logsumexp (nh x T rounded up to 32, fp32) and its seed and offset (int64) in place of the
    (nh, T, T) probabilities (Pythia-6.9B)."""
    hf = STACKS["hf"]
    for name, seq in (("llama3-8b", 1024), ("pythia-6.9b", 2048)):
        shape = replace(PRESETS[name], n_layers=3)
        eager = exact_step(shape, seq, 1, parse_tricks("fp32"), stack=hf).activations.per_layer_bytes
        sdpa = exact_step(shape, seq, 1, parse_tricks("fp32,flash"), stack=hf).activations.per_layer_bytes
        probabilities, logsumexp = shape.n_heads * seq * seq * 4, shape.n_heads * -(-seq // 32) * 32 * 4
        assert eager - sdpa == (0 if shape.n_kv_heads < shape.n_heads else probabilities - logsumexp - 2 * 8)


def test_real_cpu_tensors():
    """On CPU tensors SDPA's CPU flash kernel takes fp32 (and grouped heads) itself."""
    for name in ("llama-gqa", "gpt-neox"):
        assert_replayed(TINY[name], 24, 2, parse_tricks("fp32,flash"), device="cpu")


@pytest.mark.parametrize("stack", ["reference", "torch", "fsdp2"])
def test_other_stacks_refuse(stack):
    """FlashAttention itself needs 16 bits: fp32,flash is Transformers' sdpa, on --stack hf alone."""
    with pytest.raises(InputError, match="fp32,flash is Transformers' sdpa"):
        exact_step(PRESETS["llama3-8b"], 1024, 1, parse_tricks("fp32,flash"), stack=STACKS[stack])


def test_shapes_the_hf_stack_does_not_build_refused():
    """No other stack runs SDPA at fp32: a mixture of experts on --stack hf (whose verdict is the textbook's)
    gets one line saying so, not another stack's step."""
    r = CliRunner().invoke(app, ["estimate", "--model", "mixtral-8x7b", "--stack", "hf", "--tricks", "fp32,flash"])
    assert r.exit_code == 2 and "fp32,flash (Transformers' sdpa at fp32) is replayed where" in r.output
