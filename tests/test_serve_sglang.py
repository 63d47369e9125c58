"""SGLang's KV pool beside vLLM's (issue 41, item 2): sglang 0.5.23's _profile_available_bytes, its cell size and
its mem_fraction_static heuristic, held to a published SGLang start-up log where one gives the numbers."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memcalc.cli.commands import app
from memcalc.errors import InputError
from memcalc.model.gpus import gpu
from memcalc.model.presets import preset_model
from memcalc.serve.answer import serve
from memcalc.serve.job import ServeJob
from memcalc.serve.sglang import default_fraction, pool_bytes, prefill_buckets
from memcalc.time.calibration import calibration_for

GIB = 1 << 30


def job(model: str = "llama3-8b", g: str = "h100-sxm", context: int = 8192, **kw) -> ServeJob:
    kw.setdefault("sglang", True)
    return ServeJob(preset_model(model), gpu(g), context, calibration_for(g), **kw)


def test_the_pool_as_published_logs_have_it():
    """sgl-project/sglang#485 (4 x H100 80GB): "Init torch begin. Avail mem=78.81 GB" before the parallel groups,
    which memcalc's free memory before the weights on an H100 at tp 1 (mem_get_info's total less the CUDA context)
    comes within 0.05% of. A QwQ-32B server on 4 x L4 (g6.12xlarge), SGLang of 2025-03, mem_fraction_static=0.85, as
    a README on GitHub prints it (found through the code index, its repository not named there): "Load weight
    begin. avail mem=21.63 GB", "Load weight end. ... avail mem=6.09 GB", "KV Cache is allocated. #tokens: 46611"
    (a token: 64 layers x 2 KV heads a rank x 128 x 2 x 2 B = 65,536 B); its GiB are rounded to two decimals, so
    the pool comes within 0.05%, and memcalc's free memory before the weights on an L4 within 0.1% of 21.63
    (there NCCL over PCIe adds nothing: its "Init torch distributed ends. mem usage=0.13 GB")."""
    h100 = serve(job()).sglang.pre_load
    assert abs(h100 / GIB - 78.81) / 78.81 < 5e-4
    tokens = pool_bytes(round(21.63 * GIB), round(6.09 * GIB), 0.85) // 65536
    assert abs(tokens - 46611) / 46611 < 5e-4
    pre = serve(job("llama3-8b", "l4", tp=4, weights="bf16")).sglang.pre_load
    assert abs(pre / GIB - 21.63) / 21.63 < 1e-3


@pytest.mark.parametrize("g, tp, model, fraction", [("h100-sxm", 1, "llama3-8b", 0.83),
                                                    ("h100-sxm", 2, "llama3-8b", 0.828),
                                                    ("b200", 1, "llama3-8b", 0.854), ("rtx4090", 1, "llama3-8b", 0.704),
                                                    ("h200", 8, "deepseek-v3", 0.886)])  # fmt: skip
def test_the_default_fraction(g, tp, model, fraction):
    """arg_groups/memory_hook.py: reserved = 512 + 1.5 x chunked prefill + tp / 8 GiB + 2 x decode graph batch +
    8 x prefill buckets (MLA: 1536), at least 10 GiB above 60 GiB; e.g. an H100 (81,559 MiB): 512 + 12,288 + 128
    + 512 + 8 x 58 = 13,904 MiB, 0.830; an RTX 4090 (24,564 MiB, no floor): 512 + 6,144 + 128 + 96 + 8 x 50 =
    7,280, 0.704; DeepSeek-V3 on 8 x H200: 512 + 12,288 + 1,024 + 1,024 + 1,536 = 16,384 of 143,771, 0.886."""
    assert default_fraction(job(model, g, tp=tp))[0] == fraction
    assert prefill_buckets(8192) == 58 and prefill_buckets(2048) == 42


def test_sglang_beside_vllm():
    a = serve(job())
    p = a.sglang
    assert p.available == int(0.83 * p.pre_load) - a.weights.total_bytes and p.tokens == p.available // 131072
    assert p.max_running_requests == 4096 and p.cell == 131072
    mla = serve(job("deepseek-v3", "h200", tp=8, weights="fp8-block")).sglang
    assert mla.cell == (512 + 64) * 61 * 2  # the latent on every rank
    assert serve(job(mem_fraction_static=0.9)).sglang.mem_fraction_static == 0.9
    with pytest.raises(InputError, match="give it with --sglang"):
        job(sglang=False, mem_fraction_static=0.9)
    with pytest.raises(InputError, match="SWA pool"):
        serve(job("mistral-7b"))
    with pytest.raises(InputError, match="one tensor-parallel group"):
        serve(job(pp=2))
    out = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--sglang", "--format", "json"])
    assert out.exit_code == 0 and '"mem_fraction_static": 0.83' in out.output
    table = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--sglang", "--mem-fraction-static", "0.8"])
    assert table.exit_code == 0 and "SGLang 0.5.23 on the same GPU" in table.output
    bad = CliRunner().invoke(app, ["serve", "--model", "llama3-8b", "--mem-fraction-static", "0.8"])
    assert bad.exit_code == 2 and "give it with --sglang" in bad.output
