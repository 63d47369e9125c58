"""memcalc serve held to vLLM's own numbers (issue 41): the releases' budgets, the profile run's sampler,
mem_get_info's total, every card and input `estimate` takes, and the published startup logs' corpus."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli.commands import app
from memcalc.errors import InputError
from memcalc.model.gpu_table import CUDA_RESERVE_MIB, GPUS
from memcalc.model.gpus import find_gpu, gpu
from memcalc.model.presets import preset_model
from memcalc.serve.answer import serve
from memcalc.serve.job import ServeJob
from memcalc.serve.profile import sort_buffer_bytes
from memcalc.serve.releases import NCCL_BYTES, NON_TORCH_BYTES, release_for
from memcalc.time.calibration import calibration_for

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def job(model: str = "llama3-8b", g: str = "h100-sxm", context: int = 8192, **kw) -> ServeJob:
    card = gpu(g)
    kw.setdefault("weights", "bf16" if card.bf16_tflops else "fp16")
    return ServeJob(preset_model(model), card, context, calibration_for(g), **kw)


@pytest.mark.parametrize("key", list(GPUS))
def test_every_card_answers_serve(key):
    """Every card of `memcalc gpus`, V100 and T4 (fp16, no bf16) included: no ZeroDivisionError (the defect
    of serve/timing.py taking the bf16 peak, 0 there), a budget that is never negative."""
    a = serve(job("llama3.2-1b", key, 4096))
    assert a.time.tokens_per_second > 0 and a.budget.available >= 0 and a.budget.binding.shortfall >= 0


def test_pre_ampere_cli_defaults_to_fp16_and_refuses_bf16():
    runner = CliRunner()
    out = runner.invoke(app, ["serve", "--model", "llama3-8b", "--gpu", "v100-32gb", "--context", "4096"])
    assert out.exit_code == 0 and "weights fp16" in out.output
    out = runner.invoke(app, ["serve", "--model", "llama3-8b", "--gpu", "t4", "--weights", "bf16"])
    assert out.exit_code == 2 and "bf16 weights need bf16 tensor cores" in out.output


def test_mem_get_info_total_published_and_derived():
    """H100 79.22 GiB (vllm-project/vllm#10511), RTX 3090 23.58 (#10517), A100 40GB 39.38 (#16570), A100 80GB
    79.25 (PyTorch's OOM message, levihsu/OOTDiffusion#235); a card with no published figure: the driver's total
    less the median reserve (438 MiB)."""
    assert [gpu(k).cuda_total_bytes for k in ("h100-sxm", "rtx3090", "a100-40gb", "a100-80gb")] == \
        [81121 << 20, 24146 << 20, 40325 << 20, 81152 << 20]  # fmt: skip
    assert CUDA_RESERVE_MIB == statistics.median_low([81559 - 81121, 24576 - 24146, 40960 - 40325, 81920 - 81152])
    assert gpu("l4").cuda_total_bytes == (23034 - 438) << 20
    assert find_gpu("h100-sxm", "40GiB").cuda_total_bytes == 40 * GIB


def test_gpu_file_and_gpu_memory_answer(tmp_path):
    card = tmp_path / "a6000.json"
    card.write_text('{"name": "RTX A6000", "memory_mib": 49140, "bf16_tflops": 154.8, "bandwidth_gbps": 768, '
                    '"cuda_total_mib": 48676}')  # fmt: skip
    runner = CliRunner()
    out = runner.invoke(app, ["serve", "--model", "llama3-8b", "--gpu", str(card), "--context", "4096"])
    assert out.exit_code == 0, out.output
    small = runner.invoke(app, ["serve", "--model", "llama3-8b", "--gpu-memory", "40GiB", "--format", "json"])
    assert small.exit_code == 0 and '"total": 42949672960' in small.output


def test_sort_buffers_by_rows():
    """SortStable.cu: >= 128 rows segmented_sort_pairs, 2-127 by full sort, one row large segments."""
    assert [sort_buffer_bytes(r) for r in (1, 2, 127, 128, 1024)] == [20, 32, 32, 20, 20]


def test_flashinfer_sampler_holds_masked_logits_and_softmax():
    """flashinfer.sampling.top_k_top_p_sampling_from_logits (0.2.11, top_k_first): beside the 16-bit logits,
    the float32 logits, top_k_mask_logits' output and its softmax, 12 bytes an element where PyTorch's sort
    holds 36 (>= 128 rows). Llama-3-8B on an H100: 1,024 rows of 128,256."""
    torch_, fi = (serve(job(sampler=s)).activations for s in ("torch", "flashinfer"))
    assert torch_.sampler - fi.sampler == 1024 * 128256 * (4 + 4 + 8 + 20 - 12)
    assert fi.at == "sampler" and fi.sampler < torch_.sampler
    with pytest.raises(InputError, match="unknown sampler"):
        job(sampler="triton")
    with pytest.raises(InputError, match="--kv-cache-memory skips"):
        job(sampler="flashinfer", kv_cache_memory=20 * 10**9)


def test_0_21_to_0_26_subtract_their_cuda_graph_estimate():
    """vllm 0.21.0 and 0.26.0 determine_available_memory: 0.11's budget less profile_cudagraph_memory's estimate,
    taken as the log prints it; FlashInfer's sampler by default (VLLM_USE_FLASHINFER_SAMPLER: bool = True), with
    flashinfer 0.6's 1 MiB row-states buffer, then PyTorch's path again (_dummy_sampler_run's second call), whose
    Triton kernel keeps a buffer of 132 rows (an H100's SMs) of the vocabulary in float32."""
    graphs = round(0.36 * 2**30)
    old = serve(job(vllm="0.11", sampler="flashinfer")).budget
    new = serve(job(vllm="0.21", cudagraph_memory=graphs, gpu_memory_utilization=0.9))
    assert new.budget.binding.cudagraphs == graphs and new.job.profile_sampler == "flashinfer"
    triton = 132 * 128256 * 4
    assert new.activations.sampler == serve(job(vllm="0.11", sampler="flashinfer")).activations.sampler + \
        (1 << 20) + triton  # fmt: skip
    assert new.budget.available == old.available - graphs - (1 << 20) - triton
    assert serve(job(vllm="0.21", cudagraph_memory=0, gpu_memory_utilization=0.9)).budget.available == \
        old.available - (1 << 20) - triton  # fmt: skip
    with pytest.raises(InputError, match="give --cudagraph-memory"):
        job(vllm="0.21")
    with pytest.raises(InputError, match="--vllm-version 0.20 or later"):
        job(cudagraph_memory=graphs)
    with pytest.raises(InputError, match="extensible KV cache"):
        job(vllm="0.34", cudagraph_memory=graphs)
    assert serve(job(vllm="0.21", kv_cache_memory=20 * 10**9)).budget.available == 20 * 10**9  # no profiling
    out = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.23", "--cudagraph-memory",
                                   "0.36GiB", "--model-runner", "v1", "--format", "json"])  # fmt: skip
    assert out.exit_code == 0 and '"cudagraphs": 386547057' in out.output
    out = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--sampler", "flashinfer"])
    assert out.exit_code == 0 and "sampled by FlashInfer" in out.output


def test_0_20_subtracts_the_estimate_and_takes_0_92():
    """vllm 0.20.0 envs.py VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "1" (0.18 and 0.19: "0", the estimate
    computed and not subtracted) and config/cache.py gpu_memory_utilization to 0.92 (0.19: 0.9); its sampler stays
    PyTorch's (VLLM_USE_FLASHINFER_SAMPLER unset: opt-in)."""
    graphs = round(0.36 * 2**30)
    old, new = serve(job(vllm="0.19")), serve(job(vllm="0.20", cudagraph_memory=graphs))
    assert old.job.utilization == 0.9 and new.job.utilization == 0.92 and new.job.profile_sampler == "torch"
    total = new.budget.total
    assert new.budget.available == old.budget.available + int(total * 0.92) - int(total * 0.9) - graphs
    assert serve(job(vllm="0.21", cudagraph_memory=0)).job.utilization == 0.92
    assert serve(job(vllm="0.20", cudagraph_memory=0, gpu_memory_utilization=0.5)).budget.requested == int(total / 2)
    with pytest.raises(InputError, match="give --cudagraph-memory"):
        job(vllm="0.20")
    table = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--vllm-version", "0.20.1", "--cudagraph-memory",
                                     "0"])  # fmt: skip
    assert table.exit_code == 0 and "gpu_memory_utilization 0.92" in table.output and "vLLM 0.20's rule" in table.output


@pytest.mark.parametrize("g, nccl", [("h100-sxm", True), ("h200", True), ("b200", True), ("a100-80gb", False),
                                     ("rtx4090", False), ("h100-pcie", False)])  # fmt: skip
def test_nccl_buffers_only_where_nvls(g, nccl):
    """0.9-0.10 count NCCL's buffers; they are large only where NCCL sets up NVLink SHARP (multicast behind
    NVSwitch, Hopper and Blackwell): #13061 (2 x RTX 4090) and #16570 (4 x A100 40GB) show none above tp 1."""
    a = serve(job("llama3-8b", g=g, tp=2, vllm="0.9"))
    assert a.budget.binding.non_torch == NON_TORCH_BYTES + (NCCL_BYTES if nccl else 0)
    assert serve(job("llama3-8b", g=g, tp=1, vllm="0.9")).budget.binding.non_torch == NON_TORCH_BYTES


@pytest.mark.parametrize("text, key", [("0.8.5", "0.8"), ("0.9.2", "0.9"), ("0.10.1.1", "0.9"), ("v0.11.0", "0.11"),
                                       ("0.13", "0.11"), ("0.19.1", "0.11"), ("0.20.2", "0.20"),
                                       ("0.21.0", "0.21"), ("0.26", "0.21"), ("0.27.0", "0.27"),
                                       ("0.33.1", "0.27")])  # fmt: skip
def test_release_spans(text, key):
    assert release_for(text).key == key


@pytest.mark.parametrize("text", ["0.7.3", "0.34.0", "0.34", "1.0", "latest", "0"])
def test_release_refusals(text):
    with pytest.raises(InputError):
        release_for(text)


def test_releases_differ_as_their_source_does():
    """0.8 counts the CUDA context, 0.8 to 0.10 NCCL's buffers under tp > 1, 0.11 neither; 0.8 gives an A100
    80GB the 8,192 / 1,024 defaults, 0.9 on 2,048 / 256."""
    from memcalc.model.headroom import CONTEXT_BYTES

    tp2 = {r: serve(job("llama3-8b", tp=2, vllm=r)).budget.binding.non_torch for r in ("0.8", "0.9", "0.11")}
    assert tp2 == {"0.8": NON_TORCH_BYTES + CONTEXT_BYTES + NCCL_BYTES, "0.9": NON_TORCH_BYTES + NCCL_BYTES,
                   "0.11": NON_TORCH_BYTES}  # fmt: skip
    assert job(g="a100-80gb", vllm="0.8").batched_tokens == 8192 and job(g="a100-80gb").batched_tokens == 2048


def test_deepseek_v2_lite_config_serves():
    out = CliRunner().invoke(app, ["serve", "--config", "examples/configs/deepseek-v2-lite.json", "--gpu", "a100-80gb",
                                   "--format", "json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    a = serve(ServeJob(__import__("memcalc.model.hfconfig", fromlist=["x"]).config_model(
        str(ROOT / "examples/configs/deepseek-v2-lite.json")), gpu("a100-80gb"), 8192, calibration_for("a100-80gb")))
    assert a.kv.bytes_per_token == 27 * (512 + 64) * 2  # MLA: the latent and the rope key, one head


@settings(max_examples=25)
@given(st.floats(0.5, 0.94), st.floats(0.001, 0.05))
def test_kv_tokens_monotone_in_utilization(util, step):
    low = serve(job(gpu_memory_utilization=util), advise=False).budget.cache_tokens
    assert serve(job(gpu_memory_utilization=util + step), advise=False).budget.cache_tokens >= low


def test_corpus_loads_and_report_summarises():
    sys.path.insert(0, str(ROOT))
    from benchmarks.serving.corpus import load
    from benchmarks.serving.report import rows, summary

    logs = load()
    assert len({lg.id for lg in logs}) == len(logs) and all(lg.url.startswith("https://github.com/") for lg in logs)
    lines = summary(rows(logs))
    assert any(line.startswith("fit      all available_gib") for line in lines)
    out = subprocess.run([sys.executable, "benchmarks/serving/report.py", "--summary"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "median |error|" in out.stdout


def test_the_corpus_numbers_the_docs_quote():
    """docs/serving.md and benchmarks/serving/README.md: the counts and the medians they write by hand, computed."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.serving.corpus import load
    from benchmarks.serving.report import rows, stats

    logs = load()
    results = rows(logs)
    predicted = [lg for lg, p in results if isinstance(p, dict)]
    stated = sum(lg.settings_stated for lg in predicted)
    models = len({lg.hf_id for lg in logs if lg.hf_id != "unstated"})
    cards = len({lg.gpu for lg in logs if lg.gpu})
    v0, v1 = (sum(lg.engine == e for lg in logs) for e in ("v0", "v1"))
    fit, held = stats(results, "fit", "available_gib"), stats(results, "held-out", "available_gib")
    v1_held = stats(results, "held-out", "available_gib", "v1")
    docs = " ".join((ROOT / "docs" / "serving.md").read_text().split())
    quotes = (f"holds {len(logs)} startup logs",
              f"over {models} models, {cards} cards and both engines ({v0} V0, {v1} V1)",
              f"predicts {len(predicted)} (", f"{stated} of them with every setting stated",
              f"within {fit[1]:.1%} median ({fit[2]:.1%} worst) on the {fit[0]} logs",
              f"{held[1]:.1%} median ({held[2]:.1%} worst) on the {held[0]} held out")  # fmt: skip
    for quote in quotes:
        assert quote in docs, quote
    readme = " ".join((ROOT / "benchmarks" / "serving" / "README.md").read_text().split())
    quotes = (f"The corpus: {len(logs)} logs", f"{models} models, {cards} cards", f"{v0} V0 and {v1} V1 logs",
              f"memcalc predicts {len(predicted)}, {stated} of them",
              f"within {fit[1]:.1%} median and {fit[2]:.1%} worst on the {fit[0]} fit logs",
              f"{held[1]:.1%} median, {held[2]:.1%} worst on the {held[0]} held out",
              f"V1: {v1_held[0]} logs, {v1_held[1]:.1%} median, {v1_held[2]:.1%} worst")  # fmt: skip
    for quote in quotes:
        assert quote in readme, quote


def test_corpus_config_must_be_a_file_beside_it(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.serving.corpus import CorpusError, load

    record = (ROOT / "benchmarks" / "serving" / "github_repos.toml").read_text().split("[[log]]")[1]
    assert 'config = "configs/qwen2-7b-instruct.json"' in record
    (tmp_path / "one.toml").write_text("[[log]]" + record)
    with pytest.raises(CorpusError, match="config"):
        load(tmp_path)  # no configs/ beside it
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "qwen2-7b-instruct.json").write_text("{}")
    assert load(tmp_path)[0].config == "configs/qwen2-7b-instruct.json"
