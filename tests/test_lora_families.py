"""LoRA and QLoRA on the other families the hf stack builds whose projections PEFT finds by Llama's names
(issue 40): Gemma, Gemma 2, Gemma 3 (text) and OLMo 2, replayed as PEFT wraps them, held to PEFT (peft 0.21) on
Transformers' own classes: parameters as PEFT registers them, every allocation on meta at tiny size, and the
phases at Gemma 2 9B's width three blocks deep. Phi-3 (qkv_proj, gate_up_proj), GPT-NeoX and GPT-2 name their
projections otherwise and stay refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.hf.model import build as hf_build  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.finetune import Finetune, adapter_params  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.replay import assert_equal_at_width  # noqa: E402
from tests.test_hf_gemma import TINY as GEMMA  # noqa: E402
from tests.test_hf_olmo2_phi3 import TINY as OLMO2_PHI3  # noqa: E402
from tests.test_lora import LORA, MASTER, PURE, QLORA, assert_meta, step_config  # noqa: E402
from verify.hf import build_hf  # noqa: E402

SHAPES = {"gemma": GEMMA["gemma"], "gemma2": GEMMA["gemma2"], "gemma3_text": GEMMA["gemma3_text"],
          "olmo2": OLMO2_PHI3["olmo2"]}  # fmt: skip


@pytest.mark.parametrize("name", list(SHAPES))
def test_peft_parameters_as_peft_registers_them(name):
    """named_parameters() of get_peft_model's model (names less PEFT's prefixes, shapes, which train) as the
    replay builds them, and the adapters' count the textbook takes."""
    shape = SHAPES[name]
    model = build_hf(shape, parse_tricks("bf16"), 24, finetune=LORA).model
    real = [(n.removeprefix("base_model.model.").replace(".base_layer", "").replace(".default", ""),
             tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]  # fmt: skip
    sim = hf_build(Graph(LiveBytes()), step_config(shape, 24, 1, "bf16", replace(MASTER, finetune=LORA)))
    assert real == [(p.name, p.shape, p.requires_grad) for p in sim.p.values()]
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapter_params(shape, LORA)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tricks", ["bf16", "bf16,ckpt"])
def test_lora_allocation_by_allocation(name, tricks):
    """Without ckpt the first block's input needs no gradient; with it enable_input_require_grads' hook makes the
    embedding module's output a leaf that requires one: Gemma's is the scaled embedding (its module multiplies)."""
    assert_meta(SHAPES[name], tricks, replace(MASTER, finetune=LORA))


@pytest.mark.parametrize("name,tricks", [("gemma2", "bf16,ckpt"), ("olmo2", "bf16,flash")])
def test_qlora_and_dropout_allocation_by_allocation(name, tricks):
    """bitsandbytes' 4-bit projections under PEFT's bnb LoRA; lora_dropout's mask on q and v alone."""
    pytest.importorskip("bitsandbytes")
    assert_meta(SHAPES[name], tricks, replace(PURE, finetune=QLORA))
    assert_meta(SHAPES[name], tricks, replace(PURE, finetune=Finetune(8, ("q_proj", "v_proj"), 0.1)), batch=2)


def test_lora_at_gemma2_9b_width():
    """LoRA r=16 on Gemma 2 9B's blocks at seq 1024, three deep (eager attention, its softcaps, one sliding
    layer): every phase, the saved bytes and the FLOPs equal PEFT's on meta."""
    shape = replace(PRESETS["gemma2-9b"], n_layers=3)
    assert_equal_at_width(shape, 1024, parse_tricks("bf16,ckpt"), replace(PURE, finetune=Finetune(16)))


def test_the_families_peft_cannot_wrap_by_llamas_names_stay_refused():
    with pytest.raises(InputError, match="not phi3"):
        exact_step(OLMO2_PHI3["phi3"], 24, 1, parse_tricks("bf16"), stack=replace(MASTER, finetune=LORA))


@pytest.mark.parametrize("name", ["gemma3_text", "olmo2"])
def test_frozen_parts(name):
    """Full training with the embedding and the first block frozen, under ckpt: the scaled embedding made a leaf
    that requires grad, no gradient or optimizer state for what is frozen."""
    ft = Finetune(freeze=("embeddings",), frozen_blocks=1)
    assert_meta(SHAPES[name], "bf16,ckpt", replace(PURE, finetune=ft))
