"""torchtune's recipes (issue 40, --stack torchtune): memcalc.exact.torchtune's replay equals torchtune 0.6.1's own
model and train() step (verify/torchtune.py: its builders, set_activation_checkpointing, CEWithChunkedOutputLoss,
register_optim_in_bwd_hooks, torchao's NF4Tensor) on meta, allocation by allocation; and the refusals.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.presets import PRESETS
from memcalc.model.stacks import STACKS, check_tricks, with_loop
from memcalc.model.tricks import parse_tricks

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
pytest.importorskip("verify.torchtune").torchtune()  # torchtune 0.6.1, with torchao 0.18's NF4Tensor where it looks

from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from tests.replay import assert_same_step  # noqa: E402
from verify.meta import measure_step  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(name: str, quantized: bool = False):
    """The preset at a width the meta step runs in a second, its builder (and so its RoPE and tying) kept; torchao's
    NF4 needs each weight a multiple of 64 x 256 elements (its blocks and its scalers' blocks), and at two scaler
    blocks or more, as every real weight has (with one, torchao's quantization_factor is a view of a larger buffer)."""
    if quantized:
        return replace(PRESETS[name], n_layers=2, hidden=256, n_heads=4, n_kv_heads=4, head_dim=64, ffn=512, vocab=256)
    return replace(PRESETS[name], n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, vocab=256)


CASES = [  # (preset, tricks, fine-tuning, loss, optimizer in backward, micro-batch, optimizer)
    ("llama3.1-8b", "bf16,flash", Finetune(), "full", False, 1, "adamw"),
    ("llama3.1-8b", "bf16,flash,ckpt", Finetune(), "chunked", False, 2, "adamw"),
    ("llama3.2-3b", "bf16,flash,ckpt", Finetune(), "chunked", True, 2, "adamw"),
    ("llama3.1-8b", "bf16,flash,ckpt", Finetune(8, ("q_proj", "v_proj")), "chunked", False, 2, "adamw"),
    ("llama2-7b", "bf16,flash", Finetune(8, ALL), "chunked", False, 1, "adamw"),
    ("llama3.1-8b", "bf16,flash,ckpt", Finetune(8, ALL, quantize="nf4"), "chunked", False, 2, "adamw"),
    ("llama3.2-3b", "bf16,flash", Finetune(16, ("q_proj", "v_proj"), quantize="nf4"), "full", False, 1, "adamw"),
    ("llama3.1-8b", "bf16,flash,ckpt", Finetune(), "chunked", True, 2, "paged-adam8bit"),
    # apply_lora_to_output: LoRALinear as the head, on each strided chunk (batch 2), with dropout, and whole
    ("llama3.1-8b", "bf16,flash,ckpt", Finetune(8, ("q_proj", "v_proj", "lm_head")), "chunked", False, 2, "adamw"),
    ("llama2-7b", "bf16,flash", Finetune(8, ("v_proj", "lm_head"), 0.1), "chunked", False, 2, "adamw"),
    ("llama3.1-8b", "bf16,flash", Finetune(8, ("q_proj", "lm_head")), "full", False, 1, "adamw"),
]


@pytest.mark.parametrize("name,tricks,ft,loss,in_bwd,batch,optimizer", CASES)
def test_replay_equals_torchtune_on_meta(name, tricks, ft, loss, in_bwd, batch, optimizer):
    """Every phase, the saved bytes and each allocation of forward, backward and the optimizer, in order."""
    shape, t = tiny(name, bool(ft.quantize)), parse_tricks(tricks)
    stack = replace(STACKS["torchtune"], finetune=ft, loss=loss, in_backward=in_bwd)
    phases, g, mem = simulate(StepConfig(shape, 32, batch, t, stack, optimizer=optimizer), timeline=True)
    step, live = measure_step(shape, 32, batch, t, optimizer=optimizer, stack=stack, timeline=True, count_flops=False)
    assert_same_step(phases, g, mem, step, live, (name, tricks, ft.label, loss, in_bwd))


def test_chunked_loss_holds_less_than_the_full_logits():
    """CEWithChunkedOutputLoss upcasts one chunk of the logits at a time: the forward's peak falls below the full
    loss's, which holds the whole bf16 head output and its fp32 copy."""
    shape, t = replace(PRESETS["llama3.2-1b"], n_layers=1), parse_tricks("bf16,flash,ckpt")
    full, _, _ = simulate(StepConfig(shape, 512, 1, t, replace(STACKS["torchtune"], loss="full")))
    chunked, _, _ = simulate(StepConfig(shape, 512, 1, t, STACKS["torchtune"]))
    assert chunked.forward_peak_bytes < full.forward_peak_bytes


def test_the_loop_options_are_refused_where_they_do_not_apply():
    with pytest.raises(InputError, match="CEWithChunkedOutputLoss"):
        with_loop(STACKS["hf"], "chunked")
    with pytest.raises(InputError, match="optimizer_in_bwd"):
        with_loop(STACKS["reference"], None, True)
    with pytest.raises(InputError, match="no optimizer_in_bwd"):
        with_loop(replace(STACKS["torchtune"], finetune=Finetune(8)), None, True)
    with pytest.raises(InputError, match="unknown --loss"):
        with_loop(STACKS["torchtune"], "sliced")
    for tricks in ("fp32", "bf16", "bf16,flash,selective", "bf16,flash,compile"):
        with pytest.raises(InputError):
            check_tricks(STACKS["torchtune"], parse_tricks(tricks))


def test_the_textbook_keeps_torchtunes_adapters_in_the_models_dtype():
    """torchtune builds LoRA's adapters under set_default_dtype (bf16, no master), where PEFT upcasts them to
    fp32: the textbook's state follows the stack, and says so."""
    from memcalc.memory.state import finetune_state

    peft = finetune_state(10**9, 10**9 - 10**6, 10**6, "bf16", "bf16", "adamw", "pure", True)
    tune = finetune_state(10**9, 10**9 - 10**6, 10**6, "bf16", "bf16", "adamw", "pure", True, upcast=False)
    assert peft.total_bytes - tune.total_bytes == (4 + 4 + 4 + 4 - 2 * 4) * 10**6  # fp32 w, g, m, v vs bf16 ones
    assert tune.recipe == "lora:dtype" and peft.recipe == "lora"


@pytest.mark.parametrize("extra", [["--lora", "8"], ["--optimizer-in-backward", "--optimizer-impl", "fused"]])
def test_verify_measures_torchtunes_model_with_changed_sizes(extra):
    """`memcalc verify --stack torchtune` builds torchtune's own model (--layers changes the preset's sizes, its
    builder kept), fused AdamW stepped on meta too (in backward's hooks as well), and every judged row passes."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    args = ["verify", "--model", "llama3.2-1b", "--layers", "2", "--seq", "64", "--micro-batch", "2", "--stack",
            "torchtune", "--tricks", "bf16,flash,ckpt", *extra]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "Pass: all" in r.output
