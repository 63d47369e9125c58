"""memcalc.serve against its formulas' sources: the KV cache per token, the weights' formats, and vLLM's
blocks, concurrency and longest context as vLLM's own code computes them (tests/vllm_kv.py, transcribed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.model.gpus import gpu
from memcalc.model.presets import preset_model
from memcalc.model.sizes import MAX_SEQ
from memcalc.serve.answer import serve
from memcalc.serve.job import ServeJob
from memcalc.serve.kv import kv_layers, token_bytes
from memcalc.serve.stages import pipeline_stages
from memcalc.serve.weights import Matrix, matrix_bytes, serving_weights
from memcalc.time.calibration import calibration_for

from tests import vllm_kv


def job(model: str, g: str = "h100-sxm", context: int = 8192, **kw) -> ServeJob:
    return ServeJob(preset_model(model), gpu(g), context, calibration_for(g), **kw)


@pytest.mark.parametrize("model, per_token", [
    ("llama3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B: 128 KiB a token, the figure vLLM's docs quote
    ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),
    ("gpt2", 2 * 12 * 12 * 64 * 2),  # multi-head: every head cached
    ("mistral-7b", 2 * 32 * 8 * 128 * 2),  # a window keeps fewer tokens, not fewer bytes per token
])  # fmt: skip
def test_kv_per_token_is_2_layers_kv_heads_head_dim_bytes(model, per_token):
    a = serve(job(model, context=1024))
    assert a.kv.bytes_per_token == per_token
    assert serve(job(model, context=1024, kv_dtype="fp8")).kv.bytes_per_token == per_token // 2


def test_mla_caches_the_latent_and_the_rope_key():
    """DeepSeek-V3: 61 layers x (512 + 64) x 2 bytes, one head whatever the 128 query heads; on every TP rank."""
    shape = preset_model("deepseek-v3").shape
    assert serve(job("deepseek-v3")).kv.bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert token_bytes(shape, 8, 2) == token_bytes(shape, 1, 2)


def test_tp_splits_kv_heads_and_replicates_past_them():
    """llama3-8b's 8 KV heads: 4 per GPU at tp 2, 1 at tp 8, still 1 at tp 16 (vLLM replicates)."""
    shape = preset_model("llama3-8b").shape
    assert [token_bytes(shape, tp, 2) // (2 * 128 * 2) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]


def test_sliding_layers_keep_the_window_less_one():
    """gemma3-4b: 29 sliding layers of 1,024 keep 1,023 tokens (DynamicSlidingWindowLayer), 5 keep all."""
    a = serve(job("gemma3-4b", context=8192))
    per_layer = 2 * 4 * 256 * 2
    assert {(k.window, k.count) for k in a.kv.layers} == {(0, 5), (1024, 29)}
    assert a.kv.request_bytes == per_layer * (5 * 8192 + 29 * 1023)
    assert serve(job("gemma3-4b", context=500)).kv.request_bytes == per_layer * 34 * 500


def test_weight_formats_by_hand():
    """One 4096 x 4096 matrix: bf16 2 B a weight; fp8 1 B + two fp32 scales, or one per 128 x 128 block (and
    under Marlin one 16-bit scale per group of 128 inputs and column); AWQ int4 0.5 B + per group of
    128 inputs and column an fp16 scale and a 4-bit zero; GPTQ int4 the same + an int32 g_idx per input."""
    m, n = Matrix("o", 4096, 4096), 4096 * 4096
    groups = 4096 // 128 * 4096
    assert matrix_bytes(m, "bf16") == 2 * n
    assert matrix_bytes(m, "fp8") == n + 8
    assert matrix_bytes(m, "fp8-block") == n + 4 * (4096 // 128) ** 2  # weight_scale_inv, a float32 per 128 x 128
    assert matrix_bytes(m, "fp8-block", fp8_cores=False) == n + 2 * groups  # Marlin: a 16-bit scale per group
    assert matrix_bytes(m, "int4-awq") == n // 2 + 2 * groups + groups // 2
    assert matrix_bytes(m, "int4-gptq") == n // 2 + 2 * groups + groups // 2 + 4 * 4096
    assert matrix_bytes(m, "int8") == n + 2 * groups + groups + 4 * 4096


def weights(j: ServeJob):
    """The weights of a job of one stage."""
    (stage,) = pipeline_stages(j.model.shape.n_layers, 1)
    return serving_weights(j, stage)


def test_bf16_weights_are_the_parameter_count_and_tp_splits_them():
    w = weights(job("llama3-8b"))
    assert w.total_bytes == 2 * 8_030_261_248 and w.params == 8_030_261_248
    halves = weights(job("llama3-8b", tp=2))
    norms = 2 * (2 * 32 + 1) * 4096  # two per block and the final one: replicated; all else halves
    assert halves.total_bytes == (w.total_bytes - norms) // 2 + norms
    moe = weights(job("qwen3-30b-a3b"))
    assert moe.params == preset_model("qwen3-30b-a3b").n_params


def test_expert_parallel_holds_whole_experts():
    ep = weights(job("qwen3-30b-a3b", tp=2, expert_parallel=True))
    assert ep.local_experts == 64
    assert weights(job("qwen3-30b-a3b", tp=2)).local_experts == 128


def test_budget_is_total_times_utilization_less_non_kv():
    a = serve(job("llama3-8b"))
    b = a.budget
    assert b.total == 81121 * 2**20  # mem_get_info's 79.22 GiB (vllm-project/vllm#10511), not the driver's 81,559 MiB
    st = b.binding
    assert b.available == int(b.total * 0.9 - st.weights - st.activations - st.non_torch)
    assert b.num_blocks == b.available // (16 * 131_072 // 32) // 32
    assert b.cache_bytes <= b.available < b.cache_bytes + b.page_bytes * b.binding.group_size


VLLM_CASES = [  # three kinds of cache: one group (GQA, MLA), all layers sliding, and the hybrid allocator
    ("llama3-8b", "h100-sxm", 8192, {}), ("qwen3-30b-a3b", "h100-sxm", 8192, {}),
    ("deepseek-v3", "h100-sxm", 8192, {"tp": 16, "weights": "int4-awq"}),
    ("gemma3-4b", "a100-40gb", 32768, {}), ("mistral-7b", "a100-40gb", 16384, {"kv_dtype": "fp8"}),
    ("llama3-8b", "a100-40gb", 4096, {"tp": 2, "block_size": 32}),
    ("llama3-70b", "h100-sxm", 32768, {"tp": 2, "pp": 3}), ("gemma3-4b", "a100-40gb", 8192, {"pp": 4}),
    ("deepseek-v3", "h200", 16384, {"tp": 8, "pp": 2, "weights": "fp8"}),
]  # fmt: skip


@pytest.mark.parametrize("model, g, context, kw", VLLM_CASES)
def test_blocks_concurrency_and_longest_context_are_vllms(model, g, context, kw):
    """memcalc's paged cache against vLLM's code on the same available memory: num_blocks, the maximum
    concurrency it logs, the KV cache size in tokens and estimate_max_model_len."""
    a = serve(job(model, g, context, **kw))
    j, b = a.job, a.budget
    specs = vllm_kv.layer_specs(j.model.shape, j.tp, j.page_tokens, j.kv_bytes)
    groups, blocks = vllm_kv.get_kv_cache_configs(specs, j.pp, [s.available for s in b.stages])
    config = vllm_kv.Config(context, j.batched_tokens)
    assert b.num_blocks == blocks > 0
    assert a.max_concurrency == vllm_kv.get_max_concurrency(config, groups, blocks)
    assert b.cache_tokens == vllm_kv.cache_tokens(groups, blocks)
    longest = vllm_kv.auto_fit_max_model_len(vllm_kv.Config(MAX_SEQ, j.batched_tokens), specs, j.pp,
                                             [s.available for s in b.stages])
    assert a.longest_context == longest


def test_hybrid_groups_as_vllm_groups_them():
    """gemma3-4b: 5 full + 29 sliding layers -> groups of 5: one full group, six sliding (one padded)."""
    b = serve(job("gemma3-4b")).budget
    assert b.binding.group_size == 5 and [len(g.layers) for g in b.groups] == [5, 5, 5, 5, 5, 4, 5]
    specs = vllm_kv.layer_specs(preset_model("gemma3-4b").shape, 1, 16, 2)
    names = [[int(n.split(".")[2]) for n in g.layer_names] for g in vllm_kv.get_kv_cache_groups(specs)]
    assert names == [list(g.layers) for g in b.groups]


@settings(max_examples=30, deadline=None)
@given(context=st.integers(1, 200_000), util=st.floats(0.5, 1.0), fp8=st.booleans())
def test_more_context_never_fits_more_requests(context, util, fp8):
    kv = "fp8" if fp8 else "auto"
    a = serve(job("gemma3-4b", "a100-40gb", context, kv_dtype=kv, gpu_memory_utilization=util), advise=False)
    longer = serve(replace(a.job, context=context + 4096), advise=False)
    assert longer.max_concurrency <= a.max_concurrency
    assert a.budget.cache_bytes <= max(0, a.budget.available)
    assert (a.requests >= 1) == (a.longest_context >= context)


def test_decode_is_memory_bound_and_prefill_compute_bound():
    t = serve(job("llama3-8b", batch=8)).time
    assert t.decode.linear.bound == "memory" and t.prefill.linear.bound == "compute"
    assert t.tokens_per_second == 8 / t.tpot_seconds
    # batch 1: the step reads every weight and one request's cache at the calibrated bandwidth
    one = serve(job("llama3-8b", batch=1))
    cal, g = calibration_for("h100-sxm"), gpu("h100-sxm")
    weights_read = one.weights.total_bytes - one.weights.table_bytes
    assert one.time.decode.linear.memory_seconds == weights_read / (g.bandwidth_gbps * 1e9 * cal.bandwidth)


def test_what_to_change_when_nothing_fits():
    a = serve(job("llama3-8b", "a100-40gb", 1_000_000))
    assert not a.fits and a.requests == 0
    assert any(c.requests >= 1 for c in a.changes) or all(c.longest_context < 1_000_000 for c in a.changes)
    assert {c.change for c in a.changes} >= {"--kv-cache-dtype fp8", "--tp 2"}


def test_pipeline_stages_split_as_vllm_splits_them():
    """get_pp_indices: 80 layers over 3 stages are 27, 27, 26 (the remainder before the last stage); 61 over 4
    are 15, 15, 16, 15; the first stage holds the embedding, the last the head."""
    assert [len(s.layers()) for s in pipeline_stages(80, 3)] == [27, 27, 26]
    assert [len(s.layers()) for s in pipeline_stages(61, 4)] == [15, 15, 16, 15]
    j = job("llama3-8b", pp=4)
    first, *_, last = pipeline_stages(32, 4)
    assert sum(k.count for k in kv_layers(j, first.layers())) == 8
    table = 128256 * 4096
    assert weights(job("llama3-8b")).params - table * 2 == sum(
        serving_weights(j, s).params for s in pipeline_stages(32, 4)) - table * 2


def run(*args: str):
    from typer.testing import CliRunner

    from memcalc.cli import app

    return CliRunner().invoke(app, ["serve", *args])


def test_the_issue_command_answers_requests_and_tokens_per_second():
    out = run("--model", "llama3-8b", "--gpu", "h100-sxm", "--context", "8192")
    assert out.exit_code == 0, out.output
    a = serve(job("llama3-8b"))
    assert f"{a.requests:,} concurrent requests of 8,192 tokens fit" in out.stdout
    assert "tokens/s" in out.stdout and "Maximum concurrency" in out.stdout


def test_json_serialises_the_answer():
    import json

    out = run("--model", "qwen3-30b-a3b", "--context", "4k", "--kv-cache-dtype", "fp8", "--format", "json")
    data = json.loads(out.stdout)
    a = serve(job("qwen3-30b-a3b", context=4096, kv_dtype="fp8"))
    assert data["requests"] == a.requests and data["budget"]["num_blocks"] == a.budget.num_blocks
    assert data["kv"]["bytes_per_token"] == 48 * 4 * 128 * 2
    assert data["time"]["tokens_per_second"] == a.time.tokens_per_second
    assert set(data) >= {"job", "weights", "kv", "activations", "budget", "max_concurrency", "longest_context",
                         "time", "changes", "fits"}  # fmt: skip


@pytest.mark.parametrize("args, message", [
    (("--model", "llama3-8b", "--weights", "int3"), "unknown weight format"),
    (("--model", "llama3-8b", "--tp", "3"), "must divide the 32 attention heads"),
    (("--model", "llama3-8b", "--expert-parallel"), "this model is dense"),
    (("--model", "llama3-8b", "--gpu-memory-utilization", "1.5"), "fraction"),
    (("--model", "llama3-8b", "--kv-cache-dtype", "int8"), "unknown KV cache dtype"),
    (("--model", "qwen3-30b-a3b", "--dp", "2"), "--dp without --expert-parallel"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = run(*args)
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert out.stderr.startswith("error: ") and message in out.stderr and len(out.stderr.splitlines()) == 1


def test_the_numbers_docs_serving_quotes():
    """docs/serving.md's prose: each number it writes by hand, computed."""
    from pathlib import Path

    text = " ".join((Path(__file__).parent.parent / "docs" / "serving.md").read_text().split())
    qwen = serve(job("qwen3-30b-a3b"))
    assert f"cache {qwen.kv.bytes_per_token // 1024} KiB" in text
    assert f"alone ({qwen.weights.total_bytes / 1e9:.0f} GB in bf16)" in text
    awq = serve(job("qwen3-30b-a3b", "rtx4090", weights="int4-awq"))
    assert f"bring it to {awq.weights.total_bytes / 1e9:.1f} GB" in text
    shape = preset_model("deepseek-v3").shape
    latent, heads = shape.kv_lora_rank + shape.qk_rope_head_dim, shape.n_heads * (shape.head_dim + shape.v_head_dim)
    assert f"would take {heads // latent} times more" in text
    assert f"{2 * 32 * 8 * 128 * 2:,} bytes for Llama-3-8B" in text
    fp8 = serve(job("qwen3-30b-a3b", kv_dtype="fp8"))
    assert fp8.requests >= 2 * qwen.requests  # "twice the requests"


def test_activation_peak_by_hand():
    """llama3-8b at vLLM's 8,192 batched tokens and 1,024 sequences on an H100: the sampler's sort over 1,024
    x 128,256 logits (16-bit logits 2, float32 copy 4, sorted values 4 and int64 indices 8, the segmented sort's
    reverse indices 8 and cub's alternate buffers 4 + 8: SortStable.cu) beside the 8,192 x 4,096 hidden states
    and the 1,024 last ones twice; the MLP's residual, input, gate_up (2 x 14,336) and SiluAndMul output
    (14,336); attention's qkv (4,096 + 2 x 1,024) and output (4,096)."""
    p = serve(job("llama3-8b")).activations
    T, h = 8192, 4096
    assert p.sampler == (T + 2 * 1024) * h * 2 + 1024 * 128256 * (2 + 4 + 4 + 8 + 8 + 4 + 8) == 5_074_583_552
    # 4.73 GiB: the issue's "4.8-5.6 GiB at its defaults" for models of 0.6B to 32B (vocabularies 128k to 152k)
    assert p.mlp == 2 * T * h * 2 + T * 3 * 14336 * 2 == 838_860_800
    assert p.attention == 2 * T * h * 2 + T * (4096 + 2 * 1024 + 4096) * 2
    assert p.peak == p.sampler and p.at == "sampler"
    small = serve(job("llama3-8b", "a100-40gb")).activations  # 2,048 tokens and 256 sequences there
    assert (small.tokens, small.requests) == (2048, 256)
    moe = serve(job("qwen3-30b-a3b")).activations  # fused_moe: cache13 M·k·max(2·768, 2048), cache2 M·k·768
    assert moe.mlp == 2 * T * 2048 * 2 + T * 8 * (2048 + 768) * 2 + T * 128 * 2


def test_kv_cache_memory_is_taken_as_given():
    a = serve(job("llama3-8b", kv_cache_memory=20 * 10**9))
    assert a.budget.available == 20 * 10**9
    assert a.budget.num_blocks == 20 * 10**9 // (16 * 4096) // 32


def test_context_past_a_learned_position_table_is_refused():
    from memcalc.errors import InputError

    with pytest.raises(InputError, match="give --context 1024 or less"):
        job("gpt2", context=2048)
    assert serve(job("gpt2", context=1024)).longest_context <= 1024


@settings(max_examples=20, deadline=None)
@given(model=st.sampled_from(["llama3-8b", "qwen3-30b-a3b", "gemma3-4b", "deepseek-v3", "gpt2"]),
       tp=st.sampled_from([1, 2, 4]))  # fmt: skip
def test_smaller_formats_hold_fewer_bytes(model, tp):
    sizes = [weights(job(model, context=512, weights=f, tp=tp)).total_bytes
             for f in ("bf16", "int8", "fp8", "int4-gptq", "int4-awq")]  # int8's group scales outweigh fp8's two
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert all(weights(job(model, context=512, weights=f, tp=tp)).params == weights(job(model, context=512, tp=tp)).params
               for f in ("fp8", "int4-awq"))  # fmt: skip


def test_a_model_too_big_shows_no_negative_cache():
    """DeepSeek-V3's weights on a 24 GB card: the KV cache is 0 bytes and the shortfall is said, never a
    negative size (vLLM raises "No available memory for the cache blocks")."""
    a = serve(job("deepseek-v3", "rtx4090"))
    b = a.budget.binding
    assert b.available == 0 and b.num_blocks == 0
    assert b.shortfall == -int(a.budget.total * 0.9 - (b.weights + b.activations + b.non_torch)) > 0
    assert not a.fits and all(c.requests >= 0 and c.longest_context >= 0 for c in a.changes)


def test_flashmla_blocks_only_where_flashmla_runs():
    """vLLM forces 64-token blocks under MLA where FlashMLA runs (Hopper, Blackwell), else keeps 16."""
    assert job("deepseek-v3", "h100-sxm").page_tokens == 64
    assert job("deepseek-v3", "a100-80gb").page_tokens == job("deepseek-v3", "rtx4090").page_tokens == 16
    assert job("llama3-8b", "h100-sxm").page_tokens == 16
