"""Transformers' DynamicCache in training (memcalc.exact.hf.dynamic_cache): what the hf stack keeps when the model
is called with use_cache (every config's default), held to the byte against Transformers 5.24 on meta.

Each attention layer's keys and values are cat-copied into the cache after RoPE and attention runs on the
copies; the cache lives until compute_loss has taken the loss from the model's output. A model that
checkpoints its layers turns the cache off itself (utils/generic.py merge_with_config_defaults).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.stacks import stack_for  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.replay import FIELDS, assert_same_step  # noqa: E402
from tests.test_stack_hf import ALL_TRICKS, GPT_8B, HF, TINY, config  # noqa: E402
from verify.hf import build_hf  # noqa: E402
from verify.meta import measure_step  # noqa: E402

CACHED, UNCACHED = replace(HF, use_cache=True), replace(HF, use_cache=False)


def assert_step(name: str, batch: int, tricks: str, stack, device: str = "meta") -> None:
    """Every allocation of forward, backward and the optimizer step, the cache kept or not as the stack says."""
    shape, t = TINY[name], parse_tricks(tricks)
    cfg = config(shape, 24, batch, t)
    phases, g, mem = simulate(replace(cfg, stack=replace(cfg.stack, use_cache=stack.use_cache)), timeline=True)
    model = build_hf(shape, t, 24, device=device, use_cache=stack.use_cache) if device != "meta" else None
    step, live = measure_step(shape, 24, batch, t, device=device, model=model, timeline=True, stack=stack,
                              count_flops=False)  # fmt: skip
    assert_same_step(phases, g, mem, step, live, t.label)


@pytest.mark.parametrize("name", ["llama", "llama-mha-tied", "qwen3-mqa-wide-heads", "gpt2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny_models_without_the_cache(name, batch):
    """--no-cache: use_cache=False, as the stack ran before Transformers' default was modelled (the cached
    step, the stack's default, is tests/test_stack_hf.py's): GQA, MHA, MQA and GPT-2. Checkpointed layers keep no
    cache either way (test_checkpointed_layers_keep_no_cache): their step is test_stack_hf.py's, not run twice."""
    for tricks in ALL_TRICKS:
        if parse_tricks(tricks).recompute != "full":
            assert_step(name, batch, tricks, UNCACHED)


def test_real_cpu_tensors_keep_the_cache():
    for tricks in ("fp32", "bf16", "bf16,selective"):
        assert_step("llama", 2, tricks, CACHED, device="cpu")


def test_gpt2_with_flash_saves_the_copies_beside_c_attn():
    """GPT-2's q, k and v are views of c_attn's output; flash saved them, so that output. With the cache,
    flash saves the copies of k and v instead, and q's view still keeps c_attn's output: 2 (B, T, h) more
    per layer (GPT-2's blocks at 8B width, bf16 + flash, seq 8192)."""
    shape, t, s = GPT_8B, parse_tricks("bf16,flash"), 8192
    off, on = (exact_step(shape, s, 1, t, stack=stack).activations for stack in (UNCACHED, CACHED))
    assert on.per_layer_bytes - off.per_layer_bytes == 2 * s * shape.hidden * 2


def test_llama3_8b_full_width_with_the_cache():
    """Three blocks at full width, fp32 eager at seq 2048 (the issue's case): every phase as measured."""
    shape, t = replace(PRESETS["llama3-8b"], n_layers=3), parse_tricks("fp32")
    step, _ = measure_step(shape, 2048, 1, t, stack=CACHED, count_flops=False)
    e = exact_step(shape, 2048, 1, t, stack=CACHED)
    for f in FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f


def test_the_cache_holds_every_layer_at_the_forward_peak():
    """Llama-3-8B, fp32 eager, seq 2048: the forward peaks at the loss, where the cache holds every layer's
    K and V copies: 32 x 2 x 2048 x 1024 x 4 bytes = 537 MB more, +0.38%. The step's peak, in backward
    after the output (and its cache) died, is unchanged."""
    shape, t, s = PRESETS["llama3-8b"], parse_tricks("fp32"), 2048
    off, on = (exact_step(shape, s, 1, t, stack=stack).phases for stack in (UNCACHED, CACHED))
    assert on.forward_peak_bytes - off.forward_peak_bytes == shape.n_layers * 2 * s * shape.kv_dim * 4
    assert round(on.forward_peak_bytes / off.forward_peak_bytes - 1, 4) == 0.0038
    assert on.step_peak_bytes == off.step_peak_bytes


def test_checkpointed_layers_keep_no_cache():
    """With gradient checkpointing Transformers turns use_cache off: the same step as without one."""
    shape, t = PRESETS["llama3-8b"], parse_tricks("bf16,flash,ckpt")
    assert exact_step(shape, 4096, 1, t, stack=CACHED).phases == exact_step(shape, 4096, 1, t, stack=UNCACHED).phases


def test_no_cache_is_the_hf_stacks_option():
    assert stack_for("hf").use_cache and not stack_for("hf", no_cache=True).use_cache
    assert stack_for("hf", no_cache=True).label == "hf (no cache)"
    with pytest.raises(InputError, match="--no-cache turns off Transformers' DynamicCache"):
        stack_for("torch", no_cache=True)
    out = CliRunner().invoke(app, ["estimate", "--model", "llama3-8b", "--no-cache"])
    assert out.exit_code == 2 and "--stack reference keeps none" in out.stderr
