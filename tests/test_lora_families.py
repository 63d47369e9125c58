"""LoRA and QLoRA on the other families the hf stack builds (issue 40): Gemma, Gemma 2, Gemma 3 (text) and OLMo 2,
whose projections carry Llama's names, and Phi-3, GPT-NeoX and GPT-2, whose are fused (all-linear wraps Phi-3's
four; GPT-NeoX's query_key_value, dense, dense_h_to_4h, dense_4h_to_h; GPT-2's c_attn, c_proj, c_fc), replayed as
PEFT wraps them and held to PEFT (peft 0.21) on Transformers' own classes: parameters as PEFT registers them,
every allocation on meta at tiny size (frozen LayerNorms make their input's gradient alone), and the phases at
full width three blocks deep. GPT-2's Conv1D layers take LoRA as PEFT wraps them (fan_in_fan_out), QLoRA and
DoRA there refused; a named target a block does not have is one line."""

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
from tests.test_hf_gpt_neox import TINY as NEOX  # noqa: E402
from tests.test_hf_olmo2_phi3 import TINY as OLMO2_PHI3  # noqa: E402
from tests.test_lora import LORA, MASTER, PURE, QLORA, assert_meta, step_config  # noqa: E402
from tests.test_stack_hf import TINY as HF_TINY  # noqa: E402
from verify.hf import build_hf  # noqa: E402

SHAPES = {"gemma": GEMMA["gemma"], "gemma2": GEMMA["gemma2"], "gemma3_text": GEMMA["gemma3_text"],
          "olmo2": OLMO2_PHI3["olmo2"], "phi3": OLMO2_PHI3["phi3"], "gpt_neox": NEOX["pythia"],
          "gpt2": HF_TINY["gpt2-untied-no-dropout"]}  # fmt: skip


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


@pytest.mark.parametrize("name,tricks,targets", [
    ("gemma2", "bf16,ckpt", ("q_proj", "v_proj")), ("olmo2", "bf16,flash", ("q_proj", "v_proj")),
    ("phi3", "bf16,ckpt", ("qkv_proj", "down_proj")), ("gpt_neox", "bf16,ckpt", ("query_key_value", "dense_4h_to_h"))])
def test_qlora_and_dropout_allocation_by_allocation(name, tricks, targets):
    """bitsandbytes' 4-bit projections (Phi-3's fused ones too) under PEFT's bnb LoRA; lora_dropout's mask on
    two named projections alone."""
    pytest.importorskip("bitsandbytes")
    assert_meta(SHAPES[name], tricks, replace(PURE, finetune=QLORA))
    assert_meta(SHAPES[name], tricks, replace(PURE, finetune=Finetune(8, targets, 0.1)), batch=2)


@pytest.mark.parametrize("name", ["gemma2-9b", "phi3-mini"])
def test_lora_at_full_width(name):
    """LoRA r=16 on Gemma 2 9B's blocks (eager attention, its softcaps, one sliding layer) and Phi-3 mini's (its
    fused projections) at seq 1024, three deep: every phase, the saved bytes and the FLOPs equal PEFT's on meta."""
    shape = replace(PRESETS[name], n_layers=3)
    assert_equal_at_width(shape, 1024, parse_tricks("bf16,ckpt"), replace(PURE, finetune=Finetune(16)))


def test_gpt2s_conv1d_with_dropout_on_named_layers():
    """PEFT's LoRA Linear around Conv1D (fan_in_fan_out: lora_A reads the (in, out) weight's first dim), dropout on
    c_attn and c_fc alone, under ckpt, the tied head frozen with the table."""
    assert_meta(HF_TINY["gpt2"], "bf16,ckpt", replace(PURE, finetune=Finetune(8, ("c_attn", "c_fc"), 0.1)), batch=2)


def test_what_is_not_replayed_and_targets_a_block_lacks_are_refused():
    from tests.test_stack_hf import TINY as HF

    with pytest.raises(InputError, match="Conv1D"):
        exact_step(HF["gpt2"], 24, 1, parse_tricks("bf16"), stack=replace(MASTER, finetune=QLORA))
    for shape, targets, why in ((SHAPES["phi3"], ("q_proj",), "phi3's blocks have no q_proj"),
                                (HF["llama"], ("qkv_proj",), "llama's blocks have no qkv_proj")):
        with pytest.raises(InputError, match=why):
            exact_step(shape, 24, 1, parse_tricks("bf16"), stack=replace(MASTER, finetune=Finetune(4, targets)))


@pytest.mark.parametrize("name", ["gemma3_text", "olmo2"])
def test_frozen_parts(name):
    """Full training with the embedding and the first block frozen, under ckpt: the scaled embedding made a leaf
    that requires grad, no gradient or optimizer state for what is frozen."""
    ft = Finetune(freeze=("embeddings",), frozen_blocks=1)
    assert_meta(SHAPES[name], "bf16,ckpt", replace(PURE, finetune=ft))


@pytest.mark.parametrize("args", [["--model", "llama3.2-1b", "--lora-targets", "qkv", "--stack", "torchtune"],
                                  ["--model", "llama3.2-1b", "--lora-targets", "gate_up"],
                                  ["--model", "phi3-mini", "--lora-targets", "q,v"]])  # fmt: skip
def test_a_target_the_blocks_lack_is_one_line(args):
    """A fused name on Llama's blocks (torchtune's too: it raised a traceback), or Llama's on Phi-3's."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    out = CliRunner().invoke(app, ["estimate", "--seq", "1024", "--lora", "8", *args])
    assert out.exit_code == 2 and "blocks have no" in out.output and out.output.count("\n") == 1, out.output
