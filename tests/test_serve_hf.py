"""memcalc.serve.kv against Transformers 5.24's own caches, measured on meta at full width (verify/serve.py):
DynamicCache and StaticCache after a prefill and a decode step, for a multi-head (gpt2), a GQA (llama3-8b), a
sliding-window (mistral-7b, every layer; gemma3-4b, 5 of 6 layers here) and a latent-attention model
(deepseek-v3: its attention at full width, 8 routed experts in its one MoE layer), a few layers deep."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from memcalc.model.gpus import gpu  # noqa: E402
from memcalc.model.presets import preset  # noqa: E402
from memcalc.model.shape import Model  # noqa: E402
from memcalc.serve.job import ServeJob  # noqa: E402
from memcalc.serve.kv import KVCache, kv_layers  # noqa: E402
from memcalc.time.calibration import calibration_for  # noqa: E402
from verify.serve import measure, shallow  # noqa: E402

CASES = [("gpt2", 3, 700), ("llama3-8b", 3, 2000), ("mistral-7b", 2, 5000), ("gemma3-4b", 6, 3000),
         ("deepseek-v3", 2, 1500)]  # fmt: skip


def memcalc_kv(shape, context: int) -> KVCache:
    job = ServeJob(Model(shape, 1, shape.name), gpu("h100-sxm"), context, calibration_for("h100-sxm"))
    return KVCache(kv_layers(job, range(shape.n_layers)), context, job.kv_bytes)


def per_layer(shape) -> list[tuple[int, int]]:
    """(window, bytes per token) of each layer, in order."""
    kinds = {k.window: k for k in memcalc_kv(shape, 1).layers}
    return [(shape.window_at(i), kinds[shape.window_at(i)].bytes_per_token) for i in range(shape.n_layers)]


@pytest.mark.parametrize("name, layers, prompt", CASES)
def test_dynamic_cache_holds_what_memcalc_says(name, layers, prompt):
    """After the prompt and one decoded token: every full layer holds all prompt + 1 tokens, a sliding one
    the last window - 1 (its storage the window: the view of the last concatenation); memcalc's request
    bytes are their sum."""
    shape = shallow(preset(name), layers)
    measured = measure(shape, prompt, decode_steps=1)
    context = prompt + 1
    for (window, per_token), (held, storage) in zip(per_layer(shape), measured):
        kept = min(context, window - 1) if window else context
        assert held == per_token * kept, (name, window)
        assert storage == per_token * (min(context, window) if window else context)
    assert memcalc_kv(shape, context).request_bytes == sum(held for held, _ in measured)


@pytest.mark.parametrize("name, layers, prompt", [CASES[1], CASES[3], CASES[4]])
def test_static_cache_allocates_max_cache_len_or_the_window(name, layers, prompt):
    shape = shallow(preset(name), layers)
    length = prompt + 500
    measured = measure(shape, prompt, decode_steps=1, cache="static", max_cache_len=length)
    for (window, per_token), (held, _) in zip(per_layer(shape), measured):
        assert held == per_token * (min(length, window) if window else length), (name, window)


def test_mla_per_token_is_the_latent_not_the_heads():
    """DeepSeek-V3 caches 512 + 64 numbers a token and layer, where per-head keys and values would be
    128 heads x (192 + 128): 71x more."""
    shape = shallow(preset("deepseek-v3"), 2)
    (held, _), _ = measure(shape, 100, decode_steps=0)
    assert held == 100 * (512 + 64) * 2
    assert 128 * (192 + 128) // (512 + 64) == 71
