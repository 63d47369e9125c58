"""Reentrant activation checkpointing (Transformers' gradient_checkpointing_kwargs={"use_reentrant": True}, axolotl's
default, Answer.AI's and PEFT's QLoRA scripts'): memcalc.exact.sim.checkpoint's checkpoint_reentrant replays torch
2.13's CheckpointFunction (the layer run under no_grad, its input saved; in backward the whole layer again, then a
nested run of the engine from its output) and is held to Transformers' and PEFT's models checkpointed so on meta,
allocation by allocation, on CPU tensors under the Trainer's autocast, and at 8B width.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from memcalc.errors import InputError
from memcalc.model.stacks import check_tricks, stack_for
from memcalc.model.tricks import parse_tricks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from tests.replay import assert_equal_at_width, assert_same_step  # noqa: E402
from tests.test_lora import LORA, MASTER, PURE, QLORA, TRAINER, step_config  # noqa: E402
from tests.test_lora_families import SHAPES  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.autocast import measure_cpu  # noqa: E402
from verify.meta import measure_step  # noqa: E402

SHAPES = TINY | SHAPES


def reentrant(stack, finetune=None):
    stack = replace(stack, reentrant=True)
    return stack if finetune is None else replace(stack, finetune=finetune)


@pytest.mark.parametrize("name,tricks,stack", [
    ("llama", "bf16,flash,ckpt", reentrant(MASTER, LORA)),  # the embedding's output a leaf (enable_input_require_grads)
    ("llama", "bf16,ckpt", reentrant(MASTER, LORA)),
    ("llama", "bf16,flash,ckpt", reentrant(PURE)),
    ("llama", "fp32,ckpt", reentrant(PURE)),
    ("llama", "bf16,flash,ckpt", reentrant(MASTER, QLORA)),  # Answer.AI's and PEFT's QLoRA scripts
    ("qwen3", "bf16,flash,ckpt", reentrant(MASTER, LORA)),
    ("gemma2", "bf16,ckpt", reentrant(MASTER, LORA)),
    ("gpt2", "bf16,flash,ckpt", reentrant(PURE)),  # a None mask among the checkpoint's arguments
    ("gpt_neox", "bf16,flash,ckpt", reentrant(MASTER, LORA)),
])  # fmt: skip
def test_reentrant_allocation_by_allocation(name, tricks, stack):
    phases, g, mem = simulate(step_config(SHAPES[name], 24, 2, tricks, stack), timeline=True)
    step, live = measure_step(SHAPES[name], 24, 2, parse_tricks(tricks), timeline=True, stack=stack,
                              count_flops=False)  # fmt: skip
    assert_same_step(phases, g, mem, step, live, tricks)


def test_reentrant_under_the_trainers_autocast():
    """The recompute runs in the autocast its forward ran in (CheckpointFunction's _get_autocast_kwargs)."""
    stack, shape = reentrant(TRAINER, LORA), TINY["llama"]
    phases, g, mem = simulate(step_config(shape, 24, 2, "bf16,ckpt", stack, device="cpu"), timeline=True)
    step, live, _ = measure_cpu(shape, 24, 2, parse_tricks("bf16,ckpt"), 1, True, stack)
    assert_same_step(phases, g, mem, step, live, "bf16,ckpt")


def test_reentrant_at_8b_width():
    """Llama-3-8B two blocks deep at seq 256, LoRA: the phases, the saved bytes and the FLOPs (the whole layer
    recomputed: more than the non-reentrant recompute, which stops at the last tensor its backward needs)."""
    shape, tricks = replace(PRESETS["llama3-8b"], n_layers=2), parse_tricks("bf16,flash,ckpt")
    assert_equal_at_width(shape, 256, tricks, reentrant(PURE, LORA))
    whole = simulate(step_config(shape, 256, 1, "bf16,flash,ckpt", reentrant(PURE, LORA)))[1].flops
    early = simulate(step_config(shape, 256, 1, "bf16,flash,ckpt", replace(PURE, finetune=LORA)))[1].flops
    assert whole[("recompute", "linear")] > early[("recompute", "linear")]


def test_what_it_does_not_apply_to_is_refused():
    with pytest.raises(InputError, match="not --stack torchtune"):
        stack_for("torchtune", reentrant=True)
    with pytest.raises(InputError, match="without ckpt"):
        check_tricks(stack_for("hf", reentrant=True), parse_tricks("bf16,flash"))
    with pytest.raises(InputError, match="--offload-activations"):
        stack_for("hf", offload=True, reentrant=True)
    assert "reentrant checkpointing" in stack_for("hf", reentrant=True).label
