"""memcalc.exact without torch: the numbers the meta measurement confirms (tests/test_verify_meta.py),
their structure, the FLOP conventions, and the difference from the textbook."""

from __future__ import annotations

import copy
import math
import pickle
import subprocess
import sys
import textwrap

import pytest

from memcalc.errors import InputError
from memcalc.exact.step import Sym, exact_activations, exact_step, formula, symbols
from memcalc.memory.activations import textbook_activations
from memcalc.model.presets import PRESETS
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import parse_tricks
from tests.replay import GPT_8B

LLAMA_8B = PRESETS["qwen3-8b"]
SMALL = ModelShape(n_layers=3, hidden=256, n_heads=8, n_kv_heads=2, ffn=704, gated_mlp=True, norm="rmsnorm",
                   vocab=1000, positions="rope", qk_norm=True, tied_embeddings=False)  # fmt: skip

# Measured on the meta device (torch 2.13), seq 8192, micro-batch 1: per-layer saved, all saved,
# forward, backward and optimizer-step peaks (absolute live bytes), FlopCounterMode's FLOPs.
MEASURED = {
    ("llama", "fp32"): (11879645184, 433056940036, 536391643144, 544358690824, 133608325120, 490734373306368),
    ("llama", "bf16"): (6158614528, 226961424388, 349166917640, 351656237064, 134852984832, 490734373306368),
    ("llama", "bf16,flash"): (1764032536, 68756472676, 190894857064, 193384176488, 134785875968, 510525582606336),
    ("llama", "bf16,flash,ckpt"): (67108864, 7667220484, 129805604872, 132294924296, 134785875968, 634220640731136),
    ("llama", "bf16,selective"): (1762983936, 68718723076, 190924216328, 193413535752, 134852984832, 510525582606336),
    ("gpt", "fp32"): (21542076416, 777430138884, 869013274632, 874327703560, 120716083200, 485107093733376),
    ("gpt", "bf16"): (11878400000, 429403570180, 536788295688, 537611706376, 121127788544, 485107093733376),
    ("gpt", "bf16,flash"): (1142030360, 42894263140, 150211879784, 151035290472, 121060679680, 504898303033344),
    ("gpt", "bf16,flash,ckpt"): (67108864, 4197089284, 111514705928, 121001107488, 121060679680, 663227977433088),
    ("gpt", "bf16,selective"): (1140981760, 42856513540, 155921948672, 161132019720, 121127788544, 504898303033344),
}


def shape_of(family: str) -> ModelShape:
    return LLAMA_8B if family == "llama" else GPT_8B


@pytest.mark.parametrize("key", MEASURED)
def test_8b_numbers(key):
    e = exact_step(shape_of(key[0]), 8192, 1, parse_tricks(key[1]))
    got = (e.activations.per_layer_bytes, e.activations.total_bytes, e.phases.forward_peak_bytes,
           e.phases.backward_peak_bytes, e.phases.optimizer_peak_bytes, e.flops.counted)  # fmt: skip
    assert got == MEASURED[key]


def test_no_torch_needed():
    code = textwrap.dedent("""
        import sys
        from memcalc.exact.step import exact_step
        from memcalc.model.presets import PRESETS
        from memcalc.model.tricks import parse_tricks
        import memcalc.verification.results
        exact_step(PRESETS["qwen3-0.6b"], 2048, 1, parse_tricks("bf16,flash,ckpt"))
        assert "torch" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("tricks", ["fp32", "bf16", "fp16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective"])
def test_structure(tricks):
    t = parse_tricks(tricks)
    e = exact_step(SMALL, 512, 2, t)
    a = e.activations
    assert a.total_bytes == a.outside_bytes + SMALL.n_layers * a.per_layer_bytes
    assert e.phases.retained_bytes == a.total_bytes + 4  # and the loss, an fp32 scalar
    assert (a.rebuilt_bytes > 0) == (t.recompute != "none")
    p = e.phases
    assert e.peak_bytes == max(p.forward_peak_bytes, p.backward_peak_bytes, p.optimizer_peak_bytes)


@pytest.mark.parametrize("precision,per_param", [("fp32", 12), ("bf16", 14), ("fp16", 14)])
def test_model_state(precision, per_param):
    """Between steps: weights (+ fp32 master) + AdamW m, v; fp16 adds GradScaler's 8 bytes."""
    e = exact_step(SMALL, 512, 1, parse_tricks(precision))
    scaler = 8 if precision == "fp16" else 0
    mask = 512 * 512  # eager attention's causal mask buffer, (T, T) bool
    assert e.phases.state_bytes == per_param * e.n_params + scaler + mask


def test_causal_mask_buffer():
    eager = exact_step(SMALL, 512, 1, parse_tricks("bf16"))
    flash = exact_step(SMALL, 512, 1, parse_tricks("bf16,flash"))
    assert eager.phases.weights_bytes - flash.phases.weights_bytes == 512 * 512  # (T, T) bool


def test_terms_name_their_op_and_evaluate():
    e = exact_step(SMALL, 512, 2, parse_tricks("bf16,flash"))
    values = symbols(SMALL, 512, 2)
    for term in e.activations.terms + e.activations.outside:
        assert term.source.startswith(("aten.", "torch.utils.checkpoint"))
        assert evaluate(term.formula, values) == term.value, term
    names = " ".join(t.name for t in e.activations.terms)
    assert "logsumexp" in names and "philox_seed" in names and "silu saves self" in names


def evaluate(form: str, values: dict[str, int]) -> int:
    total = 1
    for part in form.split("·"):
        power = 2 if part.endswith("²") else 1
        part = part.rstrip("²")
        if "^" in part:
            part, power = part.split("^")[0], int(part.split("^")[1])
        total *= (values[part.strip("{}")] if part.startswith("{") else int(part)) ** power
    return total


def test_llama_is_not_the_textbook_layer():
    """A Llama/Qwen layer saves what GQA, SwiGLU, fp32 RMSNorm and RoPE save, not sbh(34 + 5as/h)."""
    s, b = 8192, 1
    for tricks, low, high in (("bf16", 0.5, 0.55), ("bf16,flash", 1.5, 1.6)):
        t = parse_tricks(tricks)
        exact = exact_activations(LLAMA_8B, s, b, t).per_layer_bytes
        ratio = exact / textbook_activations(LLAMA_8B, s, b, t).per_layer_bytes
        assert low < ratio < high, (tricks, ratio)


def test_flop_conventions():
    shape, s = GPT_8B, 8192
    eager = exact_step(shape, s, 1, parse_tricks("bf16")).flops
    flash = exact_step(shape, s, 1, parse_tricks("bf16,flash")).flops
    attention = 12 * shape.n_layers * shape.q_dim * s * s  # PaLM: 12·L·H·Q·T per token, T tokens
    assert eager.counted == eager.model  # no recompute: FlopCounterMode counts the model FLOPs
    assert eager.model - eager.model_causal == attention // 2
    assert flash.counted - flash.model == attention // 6  # flash's backward recomputes QKᵀ
    assert flash.counted - flash.counted_causal == 14 * attention // 12 // 2


def test_recompute_early_stop_skips_the_last_kernel():
    """Checkpoint recompute stops at the last saved tensor: a Llama block's down projection saves
    only its inputs, packed before its kernel, so that matmul is never rerun (FlopCounterMode agrees)."""
    t = parse_tricks("bf16,flash,ckpt")
    e = exact_step(LLAMA_8B, 8192, 1, t)
    base = exact_step(LLAMA_8B, 8192, 1, parse_tricks("bf16,flash"))
    h, f, L, tokens = LLAMA_8B.hidden, LLAMA_8B.ffn, LLAMA_8B.n_layers, 8192
    layer = 2 * h * LLAMA_8B.q_dim + 2 * h * LLAMA_8B.kv_dim + 3 * h * f
    flash_fwd = 4 * LLAMA_8B.n_heads * 8192 * 8192 * LLAMA_8B.head_dim
    assert e.flops.counted - base.flops.counted == L * (2 * tokens * (layer - h * f) + flash_fwd)


def test_symbols_and_formulas():
    b, s, h = Sym(2, "b"), Sym(8, "s"), Sym(4, "h")
    assert formula((b, s, h), 2) == "2·{b}·{s}·{h}"
    assert formula((b * s, s, 1), 4) == "4·{b}·{s}²"
    assert formula((2,), 8) == "16"
    assert pickle.loads(pickle.dumps(b * s)) == 16 and copy.deepcopy(b).name == "b"
    assert math.prod((b, s)) == 16 and math.prod((b, s)).name == "b·s"


def test_bad_input():
    with pytest.raises(InputError):
        exact_step(SMALL, 0, 1, parse_tricks("bf16"))
    with pytest.raises(InputError):
        exact_step(PRESETS["gpt2"], 2048, 1, parse_tricks("bf16"))  # 1024 learned positions
