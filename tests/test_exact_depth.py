"""exact_step's shortcut: a whole step grown from two- and three-block simulations (without the warm-up
step) equals the full-depth replay, byte for byte: phases, saved bytes and FLOPs."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.exact.base.config import StepConfig
from memcalc.exact.replay.meta import simulate
from memcalc.exact.step import config, exact_step
from memcalc.model.presets import PRESETS
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import PROGRESSION, parse_tricks
from tests.replay import GPT_8B

TRICKS = [*PROGRESSION, parse_tricks("fp16,flash,ckpt"), parse_tricks("fp16"), parse_tricks("fp32,ckpt")]


SHAPES = {**PRESETS, "gpt-8b-width": GPT_8B}


@pytest.mark.parametrize("name, seq", [("qwen3-8b", 8192), ("llama3-8b", 8192), ("gpt2", 1024), ("qwen3-0.6b", 512),
                                       ("gpt-8b-width", 8192)])  # fmt: skip
@pytest.mark.parametrize("tricks", TRICKS, ids=lambda t: t.label)
def test_grown_phases_equal_the_full_depth_replay(name, seq, tricks):
    """At 8B the backward peak moves, with depth, from the loss into the last block's recompute (the
    gradients of the blocks done outgrow the activations they freed): growing each segment finds it."""
    assert_grown_equals_replay(SHAPES[name], seq, 1, tricks, 1)


def assert_grown_equals_replay(shape, seq, mb, tricks, ga):
    phases, g, _ = simulate(config(shape, seq, mb, tricks, ga))  # every block, after a warm-up step
    e = exact_step(shape, seq, mb, tricks, ga)
    assert e.phases == phases
    assert e.activations.per_layer_bytes * shape.n_layers + e.activations.outside_bytes == sum(
        t.nbytes for t in g.saved_terms)  # fmt: skip
    assert e.flops.counted == sum(g.flops.values())


shapes = st.builds(
    lambda layers, heads, kv, dim, gated, ffn, tied: ModelShape(
        n_layers=layers, hidden=heads * dim, n_heads=heads, n_kv_heads=kv, ffn=ffn, gated_mlp=gated,
        norm="rmsnorm" if gated else "layernorm", positions="rope" if gated else "none", vocab=97,
        tied_embeddings=tied, dropout=0.0 if gated else 0.1),
    layers=st.integers(3, 9), heads=st.sampled_from([2, 4]), kv=st.sampled_from([1, 2]), dim=st.sampled_from([8, 16]),
    gated=st.booleans(), ffn=st.sampled_from([24, 64, 200]), tied=st.booleans(),
)  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(shape=shapes, seq=st.sampled_from([8, 32, 96]), mb=st.sampled_from([1, 3]), ga=st.sampled_from([1, 2, 4]),
       tricks=st.sampled_from(TRICKS))  # fmt: skip
def test_grown_phases_for_any_shape(shape, seq, mb, ga, tricks):
    assert_grown_equals_replay(shape, seq, mb, tricks, ga)


@pytest.mark.parametrize("tricks", TRICKS, ids=lambda t: t.label)
def test_the_first_steps_state_stands_for_the_warm_up(tricks):
    cfg = StepConfig(replace(PRESETS["qwen3-0.6b"], n_layers=2), 256, 2, tricks)
    assert simulate(cfg, warm_up=False)[0] == simulate(cfg)[0]


# the libraries' optimizers (memcalc.exact.train.optimizers) make their state inside their first step, so the
# shortcut runs the warm-up for them; their foreach and fused kernels span every block at once. Every
# optimizer and recipe tests/test_stack_optimizers.py measures at 8B width on three blocks is here.
LIBRARY = [("fp32", "torch", "loop", "adamw"), ("fp32", "torch", "foreach", "adamw"), ("fp32", "torch", "fused", "adamw"),
           ("fp32", "torch", "loop", "sgd"), ("fp32", "torch", "foreach", "adam8bit"),
           ("bf16,flash,ckpt", "pure", "loop", "adamw"), ("bf16,flash,ckpt", "pure", "foreach", "adamw"),
           ("bf16,flash,ckpt", "pure", "fused", "adamw"), ("bf16,flash", "pure", "foreach", "sgd"),
           ("bf16,flash,ckpt", "pure", "loop", "adam8bit"), ("bf16,flash,ckpt", "pure", "fused", "adam8bit"),
           ("bf16,flash,ckpt", "pure", "loop", "sgd"), ("fp16,flash,ckpt", "pure", "foreach", "adamw"),
           ("fp32,ckpt", "pure", "fused", "adamw"),
           # torch.autocast over fp32 weights (memcalc.exact.aten.cast_policy), GradScaler for fp16
           # (memcalc.exact.train.amp)
           ("bf16", "autocast", "reference", "adamw"), ("bf16,flash,ckpt", "autocast", "reference", "adamw"),
           ("fp16,flash", "autocast", "reference", "adamw"), ("bf16,selective", "autocast", "reference", "adamw"),
           # the stock loop's defaults: autocast driving torch.optim (GradScaler for fp16; fused AdamW its own path)
           ("bf16,flash", "autocast", "foreach", "adamw"), ("bf16,flash,ckpt", "autocast", "foreach", "adamw"),
           ("fp16,flash", "autocast", "foreach", "adamw"), ("fp16,flash,ckpt", "autocast", "fused", "adamw"),
           ("bf16", "autocast", "loop", "adamw"), ("fp16,flash", "autocast", "loop", "sgd"),
           ("bf16,flash,ckpt", "autocast", "foreach", "adam8bit")]  # fmt: skip
HF = [("bf16", "master", "reference"), ("bf16,selective", "master", "reference"), ("bf16,flash,ckpt", "master", "reference"),
      ("fp16,flash", "master", "reference"), ("bf16,flash", "master", "reference"), ("bf16,flash", "pure", "fused"), ("fp32,ckpt", "master", "foreach"),
      # the hf stack's default: Transformers' model under autocast as Accelerate prepares it, fused AdamW
      ("bf16,flash", "autocast", "fused"), ("bf16,flash,ckpt", "autocast", "fused"), ("fp16,flash", "autocast", "fused"),
      ("bf16", "autocast", "foreach"), ("bf16,selective", "autocast", "fused")]  # fmt: skip


@pytest.mark.parametrize("name, seq", [("qwen3-8b", 8192), ("llama3-8b", 4096), ("gpt2", 1024)])
@pytest.mark.parametrize("tricks, recipe, impl", HF)
def test_grown_phases_with_transformers_model(name, seq, tricks, recipe, impl):
    # Transformers' first block does what later ones do not (its masks): grown from two and three blocks
    stack, t, shape = stack_for("hf", recipe=recipe, impl=impl), parse_tricks(tricks), PRESETS[name]
    phases, g, _ = simulate(config(shape, seq, 1, t, 1, stack))
    e = exact_step(shape, seq, 1, t, 1, stack)
    assert e.phases == phases
    assert e.flops.counted == sum(g.flops.values())


@pytest.mark.parametrize("name, seq", [("qwen3-8b", 8192), ("gpt2", 1024)])
@pytest.mark.parametrize("tricks, recipe, impl, optimizer", LIBRARY)
def test_grown_phases_with_the_libraries_optimizers(name, seq, tricks, recipe, impl, optimizer):
    stack = stack_for("torch", recipe=None if recipe == "torch" else recipe, impl=impl)
    t, shape = parse_tricks(tricks), PRESETS[name]
    phases, g, _ = simulate(config(shape, seq, 1, t, 1, stack, optimizer))
    e = exact_step(shape, seq, 1, t, 1, stack, optimizer)
    assert e.phases == phases
    assert e.flops.counted == sum(g.flops.values())
