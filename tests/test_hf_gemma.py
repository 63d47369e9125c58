"""Transformers' Gemma, Gemma 2 and Gemma 3 (text) on the hf stack: memcalc.exact.hf.gemma's replay equals the
measurement of Transformers' own GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (verify/hf.py) to
the byte: tiny models allocation by allocation for every trick set each runs, on meta and on real CPU tensors;
the published shapes (gemma-7b, gemma2-9b, gemma3-4b) three blocks deep at full width; what each adds to
Llama's step (the embedding's scale, fp32 norm products, both causal masks, softcapping); and Gemma 2's
flash trick sets refused as Transformers refuses them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.hf.model import FAMILIES, arch_for, param_shapes  # noqa: E402
from memcalc.exact.hf.model import build as hf_build  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.test_stack_hf import ALL_TRICKS, HF, assert_same_phases, config  # noqa: E402
from tests.test_stack_hf import assert_replayed as replayed  # noqa: E402
from verify.hf import build_hf  # noqa: E402
from verify.meta import measure_step  # noqa: E402

GEMMA = ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=160, gated_mlp=True,
                   activation="gelu", norm="rmsnorm", vocab=200, positions="rope", arch="gemma")  # fmt: skip
TINY = {  # seq 24: each window (32) is longer than the sequence
    "gemma": GEMMA,
    "gemma-mha-inferred": replace(GEMMA, n_kv_heads=4, arch=""),  # arch_for reads gemma from the fields
    "gemma2": replace(GEMMA, arch="gemma2", norm_layout="sandwich", attn_softcap=50.0, logit_softcap=30.0,
                      sliding_window=32, global_layers=(1,)),  # fmt: skip
    "gemma2-attention-dropout": replace(GEMMA, arch="gemma2", norm_layout="sandwich", attn_softcap=50.0,
                                        logit_softcap=30.0, sliding_window=32, global_layers=(1,), dropout=0.1),
    "gemma3_text": replace(GEMMA, arch="gemma3_text", norm_layout="sandwich", qk_norm=True, sliding_window=32,
                           global_layers=(1,)),  # fmt: skip
    "gemma3-mqa-untied-softcapped": replace(GEMMA, arch="gemma3_text", norm_layout="sandwich", qk_norm=True,
                                            n_kv_heads=1, head_dim=32, tied_embeddings=False, logit_softcap=30.0,
                                            sliding_window=32, global_layers=(0,)),  # fmt: skip
}
ARCH = {"gemma": "gemma", "gemma-mha-inferred": "gemma", "gemma2": "gemma2", "gemma2-attention-dropout": "gemma2",
        "gemma3_text": "gemma3_text", "gemma3-mqa-untied-softcapped": "gemma3_text"}  # fmt: skip
FLASH = tuple(t for t in ALL_TRICKS if "flash" in t)


def tricks_of(name: str) -> tuple[str, ...]:
    """What Transformers trains each on: Gemma 2 has no sdpa, so none of the flash sets."""
    return tuple(t for t in ALL_TRICKS if not (ARCH[name] == "gemma2" and t in FLASH))


def assert_replayed(shape: ModelShape, seq: int, batch: int, tricks: str, device: str = "meta") -> None:
    replayed(shape, seq, batch, parse_tricks(tricks), device)


def test_shapes_build_as_their_architecture():
    for name, arch in ARCH.items():
        assert arch_for(TINY[name]) == arch
    assert [arch_for(PRESETS[p]) for p in ("gemma-7b", "gemma2-9b", "gemma3-4b")] == ["gemma", "gemma2", "gemma3_text"]
    with pytest.raises(InputError, match="Transformers' gemma2 builds"):
        param_shapes(replace(TINY["gemma2"], qk_norm=True), "gemma2")  # Gemma2Attention has no q/k norms
    with pytest.raises(InputError, match="no softcap on the scores"):
        param_shapes(replace(TINY["gemma3_text"], attn_softcap=50.0), "gemma3_text")  # Gemma3Attention passes none


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tricks", ["bf16", "fp32"])
def test_parameters_and_buffers_as_transformers_registers_them(name, tricks):
    """named_parameters() and named_buffers(), names, shapes and order; embed_scale (0-d) in the model's
    dtype, the rotary inv_freq and original_inv_freq in fp32 (Gemma 3: one pair per layer type)."""
    shape, t = TINY[name], parse_tricks(tricks)
    model = build_hf(shape, t, 24).model
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_shapes(shape, ARCH[name])
    sim = hf_build(Graph(LiveBytes()), config(shape, 24, 1, t))
    assert [p.name for p in sim.params] == [n for n, _ in model.named_parameters()]
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    measured = [(n, tuple(b.shape), dtype[b.dtype]) for n, b in model.named_buffers()]
    listed = FAMILIES[ARCH[name]].buffers(shape)
    assert [(n, s) for n, s, _ in measured] == [(b[0], b[1]) for b in listed]
    assert [d for _, _, d in measured] == [b.dtype for b in sim.rope]
    assert measured[0] == ("model.embed_tokens.embed_scale", (), t.precision)
    assert sum(p.numel() for p in model.parameters()) == n_params(shape)


@pytest.mark.parametrize("name,batch", [(n, 1) for n in TINY] + [(n, 2) for n in ("gemma", "gemma2", "gemma3_text")])
def test_tiny_models_allocation_by_allocation(name, batch):
    """Every trick set each runs, every allocation of forward, backward and the optimizer step, in order."""
    for tricks in tricks_of(name):
        assert_replayed(TINY[name], 24, batch, tricks)


@pytest.mark.parametrize("tricks", FLASH)
def test_gemma2_flash_refused_as_transformers_refuses_it(tricks):
    """Gemma2PreTrainedModel._supports_sdpa = False (softcapping): Transformers will not build it with sdpa,
    so there is no flash kernel to run; memcalc's replay and verify refuse it with the same line."""
    shape, t = TINY["gemma2"], parse_tricks(tricks)
    with pytest.raises(InputError) as replayed:
        exact_step(shape, 24, 1, t, stack=HF)
    with pytest.raises(InputError) as measured:
        build_hf(shape, t, 24)
    assert str(replayed.value) == str(measured.value)
    assert "modeling_gemma2.py" in str(replayed.value) and "_supports_sdpa = False" in str(replayed.value)
    assert "\n" not in str(replayed.value)


def test_windows_shorter_than_the_sequence():
    """Eager attention builds the same (B, 1, T, T) masks whatever the window (their values differ), and
    Transformers' DynamicSlidingWindowLayer keeps views of its copies: the step's bytes do not change. sdpa
    at seq >= the window gives the sliding layers a mask, and SDPA runs them on the memory-efficient kernel
    (memcalc.exact.hf.attention sdpa_masked_forward); the global layers stay on flash."""
    for name in ("gemma2", "gemma3_text"):
        for tricks in ("fp32", "bf16,selective"):
            assert_replayed(replace(TINY[name], sliding_window=16), 24, 2, tricks)
    for tricks in FLASH:
        assert_replayed(replace(TINY["gemma3_text"], sliding_window=16), 24, 2, tricks)
    assert_replayed(replace(TINY["gemma3_text"], sliding_window=16, global_layers=(0, 1)), 24, 2, "bf16,flash")


def test_shapes_without_a_window():
    """Gemma2Model and Gemma3TextModel build the sliding mask whatever the layer types; a shape without a window
    is built with one longer than the sequence, every layer full_attention (Gemma 3: one rotary pair)."""
    for name, tricks in (("gemma2", "bf16"), ("gemma3_text", "bf16,flash")):
        assert_replayed(replace(TINY[name], sliding_window=0, global_layers=()), 24, 2, tricks)


def test_both_masks_live_through_forward():
    """Gemma 2's eager forward builds create_causal_mask's and create_sliding_window_causal_mask's additive
    (B, 1, T, T) masks (torch.where) once each, and they live until its end: two of them where Gemma's one."""
    B, T = 2, 24
    for name, masks in (("gemma", 1), ("gemma2", 2)):
        _, live = measure_step(TINY[name], T, B, parse_tricks("bf16"), timeline=True, stack=HF, count_flops=False)
        made = [d for p, op, d, _ in live.timeline if p == "forward" and op == "where"]
        assert made == [2 * B * T * T] * masks


def test_softcapping_saves_the_tanh():
    """Gemma 2's softcaps: scores / 50, tanh, * 50 before the mask; logits / 30, tanh, * 30 before the loss.
    torch.tanh saves its result: one (B, n, T, T) per layer and one (B, T, V) outside, in the model's dtype."""
    shape, B, T, t = TINY["gemma2"], 2, 24, parse_tricks("bf16")
    capped = exact_step(shape, T, B, t, stack=HF).activations
    plain = exact_step(replace(shape, attn_softcap=0.0, logit_softcap=0.0), T, B, t, stack=HF).activations
    scores, logits = B * shape.n_heads * T * T, B * T * shape.vocab
    assert capped.total_bytes - plain.total_bytes == 2 * (shape.n_layers * scores + logits)
    step, _ = measure_step(shape, T, B, t, stack=HF, count_flops=False)
    assert step.saved_bytes == capped.total_bytes


# Three blocks at full width: Gemma 2 9B at its window, 4096 (its layer 1 global); Gemma 3 4B at its window,
# 1024 (its three first layers sliding), one less for flash (no mask), and twice it (masked sliding layers).
FULL_SIZE = [("gemma-7b", 8192, "fp32"), ("gemma-7b", 8192, "bf16"), ("gemma-7b", 8192, "bf16,flash"),
             ("gemma2-9b", 4096, "fp32"), ("gemma2-9b", 4096, "bf16"),
             ("gemma3-4b", 1024, "fp32"), ("gemma3-4b", 1024, "bf16"), ("gemma3-4b", 1023, "bf16,flash"),
             ("gemma3-4b", 2048, "bf16,flash")]


@pytest.mark.parametrize("name,seq,tricks", FULL_SIZE)
def test_full_size_three_blocks(name, seq, tricks):
    """Every phase's bytes as measured on meta, and FlopCounterMode's count."""
    assert_same_phases(replace(PRESETS[name], n_layers=3), seq, tricks)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3_text"])
def test_real_cpu_tensors(name):
    """On real CPU tensors (eager, and Gemma 3's sdpa on SDPA's CPU flash kernel): Transformers'
    DynamicCache makes each sliding layer's torch.tensor(sliding_window) there (8 bytes: lift_fresh), where on
    meta and CUDA its lazy_initialization copies it to the device at the layer's first update."""
    for tricks in ("fp32", "bf16") + (("bf16,flash",) if name != "gemma2" else ()):
        assert_replayed(TINY[name], 24, 2, tricks, device="cpu")
