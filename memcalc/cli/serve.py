"""`memcalc serve`: options into a ServeJob, memcalc.serve's answer, memcalc.report.serve's tables.

No `from __future__ import annotations` here: typer reads every option's annotation.
"""

import sys
from typing import Annotated, Optional

import typer

from memcalc.errors import InputError
from memcalc.model.sizes import parse_fraction
from memcalc.report import render

from .inputs import check_format, render_units, roofline_calibration
from .options import (Calibration, ConfigPath, Detail, ExactBytes, Ffn, Format, GpuMemory, GpuOpt, Heads, Hidden,
                      KvHeads, Layers, ModelName, Params, Units, Vocab)  # fmt: skip

Context = Annotated[str, typer.Option("--context", help="Tokens of one request, prompt and output together (vLLM's --max-model-len); k and m are binary.", metavar="N")]  # fmt: skip
Weights = Annotated[Optional[str], typer.Option("--weights", help="The weights' serving format: bf16 (fp16 on a card without bf16, the default), fp16, fp8 (per-tensor scales), fp8-block (128 x 128 block scales: DeepSeek-V3's, Qwen3's -FP8), int8 (GPTQ), int4-awq or int4-gptq (group 128).", metavar="FMT")]  # fmt: skip
VllmVersion = Annotated[str, typer.Option("--vllm-version", help="The vLLM release whose memory budget to follow: 0.8 to 0.33 (0.8, 0.9-0.10, 0.11-0.19, 0.20, 0.21-0.26 and 0.27-0.33 differ, and within them the sampler (0.17), the model runner (0.22 on) and the batch defaults (0.28); default 0.11).", metavar="X.Y")]  # fmt: skip
Sampler = Annotated[Optional[str], typer.Option("--sampler", help="The top-k/top-p sampler of vLLM's profile run: torch (PyTorch's: a sort, a Triton kernel from 0.17) or flashinfer (0.8-0.11 where flashinfer is installed, as in vLLM's Docker image; 0.13 to 0.20 under VLLM_USE_FLASHINFER_SAMPLER=1). Default: torch up to 0.20, flashinfer from 0.21.", metavar="NAME")]  # fmt: skip
CudagraphMemory = Annotated[Optional[str], typer.Option("--cudagraph-memory", help="vLLM 0.20 on (V2's model runner: 0.29 on): the CUDA graph estimate its log prints ('Estimated CUDA graph memory: X GiB'), subtracted from the budget; 0 under VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.", metavar="SIZE")]  # fmt: skip
SGLang = Annotated[bool, typer.Option("--sglang", help="Also SGLang's KV pool on the same GPU (sglang 0.5.23: mem_fraction_static x the free memory before the weights, less the weights).")]  # fmt: skip
MemFractionStatic = Annotated[Optional[str], typer.Option("--mem-fraction-static", help="With --sglang: SGLang's --mem-fraction-static (default: its heuristic for the card, tp and model).", metavar="X")]  # fmt: skip
ModelRunner = Annotated[Optional[str], typer.Option("--model-runner", help="vLLM's model runner: v1 or v2 (VLLM_USE_V2_MODEL_RUNNER=0 or 1). Default: the release's for the model (V2 for Qwen3 from 0.22, Llama and Mistral from 0.23, every dense model from 0.25, every model from 0.29).", metavar="NAME")]  # fmt: skip
KvDtype = Annotated[str, typer.Option("--kv-cache-dtype", help="auto (the activations' 16 bits) or fp8, as vLLM's --kv-cache-dtype.", metavar="DTYPE")]  # fmt: skip
Batch = Annotated[Optional[str], typer.Option("--batch", help="Requests decoded together, for the time (default: the most that fit).", metavar="N")]  # fmt: skip
Utilization = Annotated[Optional[str], typer.Option("--gpu-memory-utilization", help="vLLM's share of the GPU's memory for weights, activations and the KV cache (default: the release's, 0.9; 0.92 from 0.20).", metavar="X")]  # fmt: skip
BlockSize = Annotated[Optional[str], typer.Option("--block-size", help="Tokens per KV block (default: vLLM's, 16; 64 under MLA).", metavar="N")]  # fmt: skip
BatchedTokens = Annotated[Optional[str], typer.Option("--max-num-batched-tokens", help="Tokens one step schedules, the profile run's size (default: vLLM serve's, 8192 on a GPU of 70 GiB or more that is no A100, else 2048).", metavar="N")]  # fmt: skip
MaxSeqs = Annotated[Optional[str], typer.Option("--max-num-seqs", help="Requests one step runs at most (default: vLLM serve's, 1024 or 256 as above).", metavar="N")]  # fmt: skip
ServeTp = Annotated[str, typer.Option("--tp", help="Tensor-parallel GPUs (vLLM --tensor-parallel-size).", metavar="N")]  # fmt: skip
ServePp = Annotated[str, typer.Option("--pp", help="Pipeline stages (vLLM --pipeline-parallel-size).", metavar="N")]
ServeDp = Annotated[str, typer.Option("--dp", help="With --expert-parallel: data-parallel attention replicas the experts are split over too.", metavar="N")]  # fmt: skip
KvCacheMemory = Annotated[Optional[str], typer.Option("--kv-cache-memory", help="The KV cache's bytes per GPU (20e9, 20G), as vLLM's --kv-cache-memory: no profiling, gpu-memory-utilization not applied.", metavar="BYTES")]  # fmt: skip
ExpertParallel = Annotated[bool, typer.Option("--expert-parallel", help="Split the experts whole over tp x dp GPUs (vLLM --enable-expert-parallel).")]  # fmt: skip


GRAPH_UNITS = {"gib": 1 << 30, "mib": 1 << 20, "gb": 10**9, "mb": 10**6, "": 1 << 30}  # a bare number: GiB, as logged


def graph_bytes(text: str | None) -> int | None:
    """--cudagraph-memory as vLLM logs it, GiB to two decimals (0.36, 0.36GiB; GB, MiB, MB too), in whole bytes; 0
    where its estimate is off."""
    if text is None:
        return None
    raw = text.strip().lower().replace(" ", "")
    unit = next(u for u in GRAPH_UNITS if raw.endswith(u))
    try:
        value = float(raw[: len(raw) - len(unit)] if unit else raw)
    except ValueError:
        raise InputError(f"--cudagraph-memory takes a size as vLLM logs it (0.36 or 0.36GiB), got {text!r}") from None
    if not 0 <= value < 1 << 20:
        raise InputError(f"--cudagraph-memory must be 0 or more, got {text!r}")
    return round(value * GRAPH_UNITS[unit])


def serve_calibration(card, spec: str | None):
    """--calibration as the roofline reads it; a --gpu file without fp32_tflops (which serve's time does not
    use: its matmuls are 16-bit or fp8) takes the default efficiencies rather than estimate's end-to-end MFU."""
    from memcalc.model.gpus import roofline_gaps
    from memcalc.time.calibration import calibration_for

    if spec is None and roofline_gaps(card) == ["fp32_tflops"]:
        return calibration_for(card.key)
    return roofline_calibration(card, spec)


def serve(
    params: Params = None, model: ModelName = None, config: ConfigPath = None,
    layers: Layers = None, hidden: Hidden = None, heads: Heads = None, kv_heads: KvHeads = None,
    ffn: Ffn = None, vocab: Vocab = None, context: Context = "8192", weights: Weights = None,
    kv_cache_dtype: KvDtype = "auto", batch: Batch = None, gpu: GpuOpt = "h100-sxm", gpu_memory: GpuMemory = None,
    vllm_version: VllmVersion = "0.11", sampler: Sampler = None, cudagraph_memory: CudagraphMemory = None,
    model_runner: ModelRunner = None, sglang: SGLang = False, mem_fraction_static: MemFractionStatic = None,
    gpu_memory_utilization: Utilization = None, block_size: BlockSize = None,
    max_num_batched_tokens: BatchedTokens = None, max_num_seqs: MaxSeqs = None, kv_cache_memory: KvCacheMemory = None,
    tp: ServeTp = "1", pp: ServePp = "1", dp: ServeDp = "1", expert_parallel: ExpertParallel = False,
    calibration: Calibration = None, detail: Detail = False, exact_bytes: ExactBytes = False, fmt: Format = "table",
    units: Units = "gb",
) -> None:  # fmt: skip
    """Serving with vLLM: weights, KV cache, the requests and context that fit one GPU, and decode speed."""
    options = locals()  # every option by name, for the groups (memcalc.cli.groups)
    try:
        from memcalc.model.gpus import find_gpu
        from memcalc.model.shape import MAX_BATCH, parse_count, parse_seq
        from memcalc.serve.answer import serve as answer
        from memcalc.serve.job import ServeJob

        from .groups import ModelOptions, optional_count

        fmt, units = check_format(fmt), render_units(units)
        the_model = ModelOptions.of(options).resolve()
        from memcalc.serve.releases import release_line

        the_gpu = find_gpu(gpu, gpu_memory)
        fmt_weights = weights.strip().lower() if weights is not None else "bf16" if the_gpu.bf16_tflops else "fp16"
        job = ServeJob(
            the_model, the_gpu, parse_seq(context, "context"), serve_calibration(the_gpu, calibration),
            fmt_weights, kv_cache_dtype.strip().lower(), optional_count(batch, "batch", MAX_BATCH),
            parse_count(tp, "tp", 4096), parse_count(pp, "pp", 4096), parse_count(dp, "dp", 4096), expert_parallel,
            None if gpu_memory_utilization is None else parse_fraction(gpu_memory_utilization, "gpu-memory-utilization"),
            optional_count(block_size, "block-size", 1 << 16),
            None if max_num_batched_tokens is None else parse_seq(max_num_batched_tokens, "max-num-batched-tokens"),
            optional_count(max_num_seqs, "max-num-seqs", MAX_BATCH), optional_count(kv_cache_memory, "kv-cache-memory", 1 << 50),
            release_line(vllm_version), (sampler or "").strip().lower(), graph_bytes(cudagraph_memory),
            (model_runner or "").strip().lower(), sglang,
            None if mem_fraction_static is None else parse_fraction(mem_fraction_static, "mem-fraction-static"),
        )  # fmt: skip
        result = answer(job)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2)
    from memcalc.report import serve as report

    render.emit(fmt, result, report.serve_sections(result, units, detail), report.serve_preamble(result, units),
                exact=detail or exact_bytes, after=[report.serve_verdict(result)])  # fmt: skip
