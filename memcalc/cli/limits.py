"""`memcalc fit` (the longest sequence and largest micro-batch one GPU holds under a trick set) and `memcalc
mfu` (a measured throughput's MFU and HFU under every FLOPs convention), registered in commands.

No `from __future__ import annotations` here: typer reads every option's annotation.
"""

from typing import Annotated, Optional

import typer

from memcalc.errors import InputError
from memcalc.report import render

from .groups import GpuOptions, LayoutOptions, ModelOptions, StackOptions, StepOptions, seq_for
from .inputs import check_format, explained, fail, render_units, resolve_tricks, show_file, warn, with_file
from .options import (ConfigPath, DataParallelGpus, Detail, ExactBytes, ExpandableSegments, Ffn, Format, Freeze,
                      FromFile, GpuMemory, GpuOpt, GradAccum, HeadroomOpt, Heads, Hidden, HostMemory, ImplOpt, KvHeads, Layers,
                      Dora, Lora, LoraDropout, ModulesToSave, LoraTargets, LigerOpt, RlOpt, PrecomputeRef, CompletionLen, NumGenerations, CriticOpt, RolloutBatch, BetaOpt, VllmOpt, VllmUtil, VllmSleep, VllmMaxLen, GraphMemory, LossOpt, ReentrantOpt, OptimizerInBackward, MicroBatch, ModelName, NoCache, Offload, OffloadActivations, Optimizer, Params,
                      Quantize, RecipeOpt, Seq, StackOpt, Units, Vocab, Zero)  # fmt: skip

FIT_TRICKS, MFU_TRICKS = "bf16,flash", "bf16"  # without --tricks; fp16 in place of bf16 where a card lacks it

def fit(
    ctx: typer.Context, from_file: FromFile = None, params: Params = None, model: ModelName = None,
    config: ConfigPath = None,
    layers: Layers = None, hidden: Hidden = None, heads: Heads = None, kv_heads: KvHeads = None,
    ffn: Ffn = None, vocab: Vocab = None,
    seq: Seq = None, micro_batch: MicroBatch = "1", grad_accum: GradAccum = "1", tricks: Annotated[Optional[str], typer.Option("--tricks", help="The trick set to solve under.", metavar="LIST", show_default=FIT_TRICKS)] = None,
    optimizer: Optimizer = "adamw", gpus: DataParallelGpus = "1", zero: Zero = "0", offload: Offload = False,
    host_memory: HostMemory = "2T", stack: StackOpt = None, recipe: RecipeOpt = None,
    optimizer_impl: ImplOpt = None, no_cache: NoCache = False, offload_activations: OffloadActivations = False, gpu: GpuOpt = "h100-sxm", gpu_memory: GpuMemory = None,
    headroom: HeadroomOpt = None, expandable_segments: ExpandableSegments = False, detail: Detail = False,
    exact_bytes: ExactBytes = False, fmt: Format = "table",
    units: Units = "gb", lora: Lora = None, lora_targets: LoraTargets = None, lora_dropout: LoraDropout = None, dora: Dora = False, modules_to_save: ModulesToSave = None,
    quantize: Quantize = None, freeze: Freeze = None, loss: LossOpt = None, optimizer_in_backward: OptimizerInBackward = False,
    liger: LigerOpt = False, reentrant: ReentrantOpt = False, rl: RlOpt = None, precompute_ref: PrecomputeRef = False, completion_len: CompletionLen = None, num_generations: NumGenerations = None, beta: BetaOpt = None, vllm: VllmOpt = None, vllm_util: VllmUtil = None, vllm_sleep: VllmSleep = False, vllm_max_len: VllmMaxLen = None, cudagraph_memory: GraphMemory = None, critic: CriticOpt = None, rollout_batch: RolloutBatch = None,
) -> None:  # fmt: skip
    """The longest sequence and the largest micro-batch that fit one GPU under a trick set."""
    options, source = locals(), None  # every option by name, for the groups (memcalc.cli.groups)
    try:
        from memcalc.engine.fit import fit_limits
        from memcalc.engine.rollout import with_engine

        fmt, units = check_format(fmt), render_units(units)
        options, source = with_file(ctx, options, "fit")  # --from FILE's options under the typed ones
        tricks = options["tricks"]
        the_model = ModelOptions.of(options).resolve()
        the_gpu = GpuOptions.of(options).resolve()
        setup = StepOptions.of(options).resolve(the_model, StackOptions.of(options).resolve(the_gpu))
        the_gpu = with_engine(the_model, the_gpu, setup)  # --rl grpo --vllm colocate: the engine beside the step
        layout = LayoutOptions.of(options).resolve()  # data parallel (--gpus, --zero, --offload): fit solves one GPU
        (t,), said = resolve_tricks(None if tricks is None else [tricks], the_gpu, FIT_TRICKS)
        limits = fit_limits(the_model, setup, the_gpu, t, layout)
    except InputError as e:
        fail(explained(str(e), source))
    warn(said)
    read = show_file(source, fmt)
    from memcalc.report import fit as report

    rows = [[limits.gpu, "+".join(limits.tricks.names), limits.seq_len, limits.micro_batch, limits.max_seq_len,
             limits.max_micro_batch]]  # fmt: skip
    headers = ["gpu", "tricks", "seq_len", "micro_batch", "max_seq_len", "max_micro_batch"]
    render.emit(fmt, limits, report.fit_sections(limits, units, detail),
                report.fit_preamble(limits, the_model.origin, units),
                (headers, rows),
                exact=detail or exact_bytes, after=[report.fit_verdict(limits)], source=read)  # fmt: skip


def mfu(
    params: Params = None, model: ModelName = None, config: ConfigPath = None,
    layers: Layers = None, hidden: Hidden = None, heads: Heads = None, kv_heads: KvHeads = None,
    ffn: Ffn = None, vocab: Vocab = None, seq: Seq = None,
    tokens_per_sec: Annotated[Optional[str], typer.Option("--tokens-per-sec", help="Measured tokens per second per GPU.", metavar="X")] = None,
    step_time: Annotated[Optional[str], typer.Option("--step-time", help="Measured seconds per optimizer step (with --global-batch).", metavar="S")] = None,
    global_batch: Annotated[Optional[str], typer.Option("--global-batch", help="Sequences per step, all GPUs together.", metavar="N")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="GPUs the step ran on (with --step-time; --tokens-per-sec is per GPU).", metavar="N", show_default="1")] = None,
    tricks: Annotated[Optional[str], typer.Option("--tricks", help="Precision (the peak it is held against) and recompute (for HFU).", metavar="LIST", show_default=MFU_TRICKS)] = None,
    gpu: GpuOpt = "h100-sxm", fmt: Format = "table",
) -> None:  # fmt: skip
    """MFU and HFU of a measured throughput under every FLOPs convention in use, side by side."""
    options = locals()  # every option by name, for the groups (memcalc.cli.groups)
    try:
        from memcalc.memory.state import MAX_GPUS
        from memcalc.model.shape import MAX_BATCH, parse_count, parse_seq
        from memcalc.model.sizes import parse_positive
        from memcalc.time.mfu import mfu_report, tokens_per_gpu_second

        fmt = check_format(fmt)
        the_model = ModelOptions.of(options).resolve()
        seq = seq_for(seq, the_model)  # 4096, or the model's position table if shorter
        the_gpu = GpuOptions.of(options).resolve()
        (t,), said = resolve_tricks(None if tricks is None else [tricks], the_gpu, MFU_TRICKS)
        seq_len = parse_seq(seq)
        rate = tokens_per_gpu_second(
            None if tokens_per_sec is None else parse_positive(tokens_per_sec, "tokens-per-sec"),
            None if step_time is None else parse_positive(step_time, "step-time"),
            None if global_batch is None else parse_count(global_batch, "global-batch", MAX_BATCH),
            seq_len, None if gpus is None else parse_count(gpus, "gpus", MAX_GPUS),
        )  # fmt: skip
        result = mfu_report(the_model, the_gpu, t, seq_len, rate)
    except InputError as e:
        fail(str(e))
    from memcalc.report import mfu as report

    warn(said + report.mfu_warnings(result))
    csv_table = (report.MFU_CSV_HEADERS, report.mfu_csv_rows(result))
    render.emit(fmt, result, report.mfu_sections(result), report.mfu_preamble(result), csv_table)
