"""vLLM 0.17 to 0.33 as their wheels' source has them (issue 41): PyTorch's sampler masking with Triton from 0.17,
the second sampler call of 0.21, V2's model runner (its default per release, its greedy profile run, its kept
tensors) and 0.27's budget of total_consumed, which counts what each runner keeps."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from memcalc.cli.commands import app
from memcalc.errors import InputError
from memcalc.model.gpu_table import GPUS
from memcalc.model.gpus import gpu
from memcalc.model.presets import preset_model
from memcalc.serve.answer import serve
from memcalc.serve.job import ServeJob
from memcalc.serve.releases import release_line
from memcalc.serve.runners import block_table_width, default_runner
from memcalc.time.calibration import calibration_for

GRAPHS = round(0.36 * 2**30)  # "Estimated CUDA graph memory: 0.36 GiB total"
V, PADDED, R, T, H = 128256, 128256, 1024, 8192, 4096  # Llama-3-8B on an H100 at `vllm serve`'s defaults
ELEMENTS = R * V


def job(model: str = "llama3-8b", g: str = "h100-sxm", context: int = 8192, **kw) -> ServeJob:
    return ServeJob(preset_model(model), gpu(g), context, calibration_for(g), **kw)


def sampler(**kw) -> int:
    return serve(job(**kw)).activations.sampler


def test_pytorch_sampler_masks_with_triton_from_0_17():
    """vllm 0.17.0 topk_topp_sampler.py apply_top_k_top_p: 8 rows or more go to apply_top_k_top_p_triton, which
    masks the float32 logits in place with a cached buffer of min(next_power_of_2(min(SMs, R)), SMs) rows; then
    softmax and random_sample's exponential draws: 12 bytes an element where 0.16's sort holds 36."""
    hidden = (T + 2 * R) * H * 2 + R * PADDED * 2
    assert sampler(vllm="0.16") == hidden + ELEMENTS * (4 + 4 + 8 + 20)
    assert sampler(vllm="0.17") == hidden + ELEMENTS * 12 + 132 * V * 4  # 132 SMs: min(256, 132) rows
    small = serve(job(vllm="0.17", max_num_seqs=100)).activations.sampler  # 100 rows: min(128, 132)
    assert small == (T + 200) * H * 2 + 100 * PADDED * 2 + 100 * V * 12 + 128 * V * 4
    few = serve(job(vllm="0.17", max_num_seqs=4)).activations.sampler  # under 8 rows: the sort
    assert few == (T + 8) * H * 2 + 4 * PADDED * 2 + 4 * V * (4 + 4 + 8 + 8 + 8 + 4 + 4 + 8)


def test_0_21_samples_again_through_pytorch():
    """vllm 0.21.0 _dummy_sampler_run calls the sampler a second time with a generator, which forward_cuda sends
    to forward_native: with 8 rows or more the Triton path, whose buffer adds to FlashInfer's 1 MiB."""
    first = sampler(vllm="0.20", sampler="flashinfer", cudagraph_memory=0)
    assert sampler(vllm="0.21", cudagraph_memory=0) == first + (1 << 20) + 132 * V * 4
    assert sampler(vllm="0.21", cudagraph_memory=0, sampler="torch") == first + 132 * V * 4


@pytest.mark.parametrize("minor, arch, weights, runner", [
    (21, "llama3-8b", "bf16", "v1"), (22, "llama3-8b", "bf16", "v1"), (22, "qwen3-8b", "bf16", "v2"),
    (22, "qwen3-8b", "fp8", "v1"), (23, "llama3-8b", "bf16", "v2"), (23, "mistral-7b", "bf16", "v2"),
    (23, "llama3-8b", "int4-awq", "v1"), (23, "qwen3-30b-a3b", "bf16", "v1"), (24, "llama3-8b", "fp8", "v2"),
    (24, "gemma2-9b", "bf16", "v1"), (25, "gemma2-9b", "bf16", "v2"), (25, "phi3-mini", "bf16", "v2"),
    (28, "mixtral-8x7b", "bf16", "v1"), (28, "qwen3-30b-a3b", "bf16", "v1"), (29, "mixtral-8x7b", "bf16", "v2"),
    (33, "deepseek-v3", "fp8-block", "v2")])  # fmt: skip
def test_v2_model_runner_by_default_as_config_vllm_py_has_it(minor, arch, weights, runner):
    """config/vllm.py use_v2_model_runner per release (0.22 Qwen3; 0.23 Llama, Mistral, Qwen3, unquantised and
    dense; 0.24 those and DeepseekV2/Qwen2Moe/GraniteMoe, quantised too; 0.25 every dense model; 0.29 every one)."""
    assert default_runner(minor, preset_model(arch).shape, weights) == runner


def test_v2_profiles_a_greedy_batch():
    """gpu/sample/sampler.py apply_sampling_params on the greedy dummy: a float32 copy up to 0.25 (0.23, 0.25),
    nothing beyond the logits from 0.26; its hidden states without V1's rand_like copy; no CUDA graph estimate
    up to 0.28 (gpu/model_runner.py profile_cudagraph_memory returns 0)."""
    base = (T + R) * H * 2 + R * PADDED * 2
    assert sampler(vllm="0.23") == sampler(vllm="0.25") == base + ELEMENTS * 4
    assert sampler(vllm="0.26") == sampler(vllm="0.28") == base
    assert serve(job(vllm="0.23")).budget.binding.cudagraphs == 0
    with pytest.raises(InputError, match="--cudagraph-memory is vLLM's own estimate"):
        job(vllm="0.23", cudagraph_memory=GRAPHS)
    with pytest.raises(InputError, match="give --cudagraph-memory"):
        job(vllm="0.29")
    with pytest.raises(InputError, match="profiles a greedy batch"):
        job(vllm="0.25", sampler="flashinfer")
    with pytest.raises(InputError, match="modelled from 0.22"):
        job(vllm="0.21", model_runner="v2", cudagraph_memory=0)


def test_0_33_warms_the_sampler_up_in_the_profile():
    """vllm 0.33.0 gpu/model_runner.py _dummy_sampler_run: a second pass with SamplingParams.for_sampler_warmup()
    (top-k 50, top-p 0.9, penalties, logprobs): the float32 copy, masked and softmaxed by FlashInfer (its 1 MiB
    buffer kept), or masked in place by the Triton kernel (VLLM_USE_FLASHINFER_SAMPLER=0)."""
    base = (T + R) * H * 2 + R * PADDED * 2
    assert sampler(vllm="0.33", cudagraph_memory=0) == base + ELEMENTS * 12 + (1 << 20)
    assert sampler(vllm="0.33", cudagraph_memory=0, sampler="torch") == base + ELEMENTS * 4 + 132 * V * 4


def test_0_27_counts_what_the_runner_keeps():
    """vllm 0.27.0 memory_profiling: total_consumed + transient_peak_headroom, which is 0.26's budget plus the
    tensors the runner allocated before the profile run. V1's (gpu_model_runner.py __init__): inputs_embeds
    [T, h] bf16, the block table [R, W] int32, and small per-token and per-request buffers; V2's: the penalties'
    output_bin_counts [R, vocab] int32 above all."""
    v1_26, v1_27 = (serve(job(vllm=v, model_runner="v1", cudagraph_memory=GRAPHS)).budget for v in ("0.26", "0.27"))
    kept = T * H * 2 + R * 512 * 4 + T * 29 + 8 * T + R * 69 + 8
    assert v1_27.binding.kept == kept and v1_26.binding.kept == 0
    assert v1_27.available == v1_26.available - kept
    words = math.ceil(V / 32)
    v2 = R * (V * 4 + 2 * words * 4 + (3 * 1024 + 128 + 1024 + 129 + 128) * 4) + T * 13 + R * 32 + 4
    v2_27, v2_26 = serve(job(vllm="0.27")).budget, serve(job(vllm="0.26")).budget
    assert v2_27.binding.kept == v2 and v2_27.available == v2_26.available - v2
    assert block_table_width(131072, 16) == 8192 and block_table_width(100, 16) == 8 and block_table_width(10, 64) == 2


def test_0_28_gives_the_largest_cards_16k_tokens():
    """vllm 0.28.0 arg_utils.py: 16,384 batched tokens and 1,024 sequences on a card of 160 GiB or more (B200)."""
    assert job(g="b200", vllm="0.27").batched_tokens == 8192
    assert job(g="b200", vllm="0.28").batched_tokens == 16384 and job(g="b200", vllm="0.28").seqs == 1024
    assert job(g="h200", vllm="0.28").batched_tokens == 8192


@pytest.mark.parametrize("text, line", [("0.23.1", "0.23"), ("v0.33.0", "0.33"), ("0.9", "0.9")])
def test_release_lines(text, line):
    assert release_line(text) == line


def test_0_34_refused_with_its_reason():
    out = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.34.0"])
    assert out.exit_code == 2 and "extensible KV cache" in out.output


@pytest.mark.parametrize("key", list(GPUS))
def test_every_card_answers_the_newest_release(key):
    """Every card of the table at 0.33 (its SM count known: the Triton buffer needs it)."""
    a = serve(job("llama3.2-1b", key, 4096, vllm="0.33", cudagraph_memory=0,
                  weights="bf16" if GPUS[key].bf16_tflops else "fp16"))  # fmt: skip
    assert a.budget.available >= 0 and a.budget.binding.kept > 0


def test_the_runner_on_screen_and_in_json(tmp_path):
    runner = CliRunner()
    table = runner.invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.23.0"])
    words = " ".join(table.output.split())  # the table wraps to the terminal's width
    assert table.exit_code == 0 and "on its V2 model runner" in words and "greedy dummy" in words
    v1 = runner.invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.27", "--model-runner", "v1",
                             "--cudagraph-memory", "0.36", "--format", "json"])  # fmt: skip
    assert v1.exit_code == 0 and '"model_runner": "v1"' in v1.output and '"kept": ' in v1.output
    default = json.loads(runner.invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.23", "--format",
                                             "json"]).output)  # fmt: skip
    assert (default["model_runner"], default["sampler"], default["release"]) == ("v2", "greedy", "vLLM 0.21 to 0.26")
    bad = runner.invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.27", "--model-runner", "v3"])
    assert bad.exit_code == 2 and "unknown model runner" in bad.output
    card = tmp_path / "card.json"
    card.write_text('{"name": "X", "memory_mib": 49140, "bf16_tflops": 150, "bandwidth_gbps": 768}')
    out = runner.invoke(app, ["serve", "--model", "llama3-8b", "--gpu", str(card), "--vllm-version", "0.19"])
    assert out.exit_code == 2 and "give sms in a --gpu file" in out.output
    card.write_text('{"name": "X", "memory_mib": 49140, "bf16_tflops": 150, "bandwidth_gbps": 768, "sms": 84}')
    out = runner.invoke(app, ["serve", "--model", "llama3-8b", "--gpu", str(card), "--vllm-version", "0.19"])
    assert out.exit_code == 0, out.output


def test_flashinfer_falls_back_where_vllm_cannot_run_it():
    """topk_topp_sampler.py TopKTopPSampler.__init__ (0.21 on): the default-on FlashInfer sampler needs CUDA and
    FlashInferBackend.supports_compute_capability, 7.5 to 12.1 up to 0.25 and 8.0 to 12.1 from 0.26; elsewhere
    PyTorch's path runs. Asked for explicitly (VLLM_USE_FLASHINFER_SAMPLER=1) it is refused there."""
    samplers = {(g, v): job("llama3.2-1b", g, weights="fp16", vllm=v, model_runner="v1", cudagraph_memory=0)
                .profile_sampler for g in ("v100-32gb", "t4", "a10", "mi300x") for v in ("0.25", "0.26")}  # fmt: skip
    assert samplers == {("v100-32gb", "0.25"): "torch", ("v100-32gb", "0.26"): "torch", ("t4", "0.25"): "flashinfer",
                        ("t4", "0.26"): "torch", ("a10", "0.25"): "flashinfer", ("a10", "0.26"): "flashinfer",
                        ("mi300x", "0.25"): "torch", ("mi300x", "0.26"): "torch"}  # fmt: skip
    with pytest.raises(InputError, match="refuses FlashInfer's sampler"):
        job("llama3.2-1b", "v100-32gb", weights="fp16", vllm="0.21", sampler="flashinfer", cudagraph_memory=0)
    odd = replace(gpu("h100-sxm"), arch="sm_90")  # a --gpu file's arch that names no capability: no FlashInfer
    assert ServeJob(preset_model("llama3-8b"), odd, 8192, calibration_for("h100-sxm"), vllm="0.21",
                    cudagraph_memory=0).profile_sampler == "torch"  # fmt: skip


@pytest.mark.parametrize("minor", range(8, 34))
def test_every_release_line_answers_or_says_why(minor):
    """Every modelled release line, for a dense, a mixture-of-experts and an MLA model, each runner it has, with
    and without the CUDA graph estimate it asks for: an answer with no negative size, or one InputError line."""
    for model, weights in (("qwen3-8b", "bf16"), ("qwen3-30b-a3b", "fp8"), ("deepseek-v3", "fp8-block")):
        for runner in ("", "v1", "v2"):
            for graphs in (None, GRAPHS):
                try:
                    j = job(model, "h200", vllm=f"0.{minor}", weights=weights, model_runner=runner,
                            cudagraph_memory=graphs, tp=8 if model == "deepseek-v3" else 1)  # fmt: skip
                except InputError as e:
                    assert "\n" not in str(e)
                    continue
                b = serve(j, advise=False).budget.binding
                assert min(b.weights, b.activations, b.non_torch, b.cudagraphs, b.kept, b.available) >= 0
