"""Stacks: whose code trains, and what that changes in model state (the exact model learns each stack
in tests/test_stack_*.py)."""

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.memory.state import model_state
from memcalc.model.stacks import STACKS, stack_for

N = 8_000_000_000


@pytest.mark.parametrize("precision, recipe, optimizer, parts", [
    # Micikevicius et al. 2018 / Rajbhandari et al. 2019: the lesson's 16 bytes/param
    ("bf16", "master", "adamw", {"weights": 2, "grads": 2, "master": 4, "adam_m": 4, "adam_v": 4}),
    # torch.autocast: the fp32 weights are the master, their grads fp32 (torch/amp/autocast_mode.py)
    ("bf16", "autocast", "adamw", {"weights": 4, "grads": 4, "adam_m": 4, "adam_v": 4}),
    # a model loaded in bf16: torch.optim's zeros_like(param) makes m and v bf16 (torch/optim/adam.py)
    ("bf16", "pure", "adamw", {"weights": 2, "grads": 2, "adam_m": 2, "adam_v": 2}),
    ("bf16", "pure", "sgd", {"weights": 2, "grads": 2, "momentum": 2}),
    ("fp16", "autocast", "sgd", {"weights": 4, "grads": 4, "momentum": 4, "loss_scale": 0}),
    ("fp32", "pure", "adamw", {"weights": 4, "grads": 4, "adam_m": 4, "adam_v": 4}),  # fp32 is fp32 whatever the recipe
])  # fmt: skip
def test_model_state_follows_the_recipe(precision, recipe, optimizer, parts):
    state = model_state(N, precision, optimizer, recipe=recipe)
    assert {p.name: p.bytes_per_param for p in state.parts} == parts
    assert state.total_bytes == sum(parts.values()) * N + (8 if precision == "fp16" else 0)


def test_stacks_and_their_overrides():
    assert (STACKS["torch"].recipe, STACKS["torch"].impl) == ("autocast", "foreach")
    assert (STACKS["hf"].model, STACKS["hf"].impl) == ("hf", "fused")
    assert stack_for("torch", recipe="pure").label == "torch (pure)"
    assert stack_for("reference").label == "reference"
    for bad in (("nope", None, None), ("torch", "amp", None), ("torch", None, "apex")):
        with pytest.raises(InputError):
            stack_for(*bad)


def test_estimate_takes_the_stack():
    run = CliRunner().invoke
    out = run(app, ["estimate", "--params", "8e9", "--seq", "8192", "--stack", "reference", "--recipe", "pure",
                    "--tricks", "bf16,flash,ckpt"], env={"COLUMNS": "200"})  # fmt: skip
    assert out.exit_code == 0 and "8 bytes/param (pure bf16 (no fp32 master), adamw)" in out.stdout
    bad = run(app, ["estimate", "--params", "8e9", "--stack", "tensorflow"])
    assert bad.exit_code == 2 and "unknown stack 'tensorflow'; known: reference, torch, hf" in bad.stderr


def test_autocast_saves_fp32_activations_and_the_weight_casts():
    # docs/stack-torch.md: per layer, autocast (CUDA's lists) saves 10·s·b·h bytes more than the master
    # recipe (fp32 norm outputs and projection inputs) and 2 bytes per matmul weight (the cached casts)
    from memcalc.exact.step import exact_step
    from memcalc.model.presets import PRESETS
    from memcalc.model.stacks import stack_for
    from memcalc.model.tricks import parse_tricks

    shape, t, s = PRESETS["llama3-8b"], parse_tricks("bf16,flash"), 8192
    torch_stack = exact_step(shape, s, 1, t, stack=stack_for("torch", impl="reference")).activations
    reference = exact_step(shape, s, 1, t).activations
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn
    matmul_weights = 2 * h * h + 2 * h * kv + 3 * h * f  # wq, wo; wk, wv; gate, up, down
    assert torch_stack.per_layer_bytes - reference.per_layer_bytes == 10 * s * h + 2 * matmul_weights
