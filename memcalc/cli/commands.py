"""The `memcalc` command line: parse, call the engine, render. No arithmetic lives here.

No `from __future__ import annotations` here: typer reads every option's annotation, and string
annotations cost it an eval each, 10 ms at every start for the ~100 options of the commands.
"""

import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from memcalc.errors import InputError, subject
from memcalc.exact.base import collection
from memcalc.report import render

from . import views
from .groups import GpuOptions, LayoutOptions, ModelOptions, StackOptions, StepOptions
from .inputs import (check_format, explained, fail, parse_run, render_units, resolve_tricks, roofline_calibration,
                     show_file, warn, with_file)
from .limits import fit, mfu
from .options import (Calibration, CapacityFactor, ConfigPath, Cp, Detail, Dp, Ep, EstimateMfu, Etp, ExactBytes,
                      ExpandableSegments, ExpertImbalance, Ffn, Format, FromFile, Freeze, GpuMemory, GpuOpt, Gpus,
                      GpusPerNode, GradAccum, HeadroomOpt, Heads, Hidden, HostMemory, Hybrid, ImplOpt, KvHeads,
                      Layers, Dora, Lora, LoraDropout, ModulesToSave, LoraTargets, LigerOpt, RlOpt, PrecomputeRef, CompletionLen, NumGenerations, CriticOpt, RolloutBatch, BetaOpt, VllmOpt, VllmUtil, VllmSleep, VllmMaxLen, GraphMemory, LossOpt, ReentrantOpt, OptimizerInBackward, MicroBatch, ModelName, NoCache, NoOffload, Offload, OffloadActivations,
                      OffloadParams, Optimizer, Params, Pp, PpLayers, Quantize, RecipeOpt, Reshard, Seq, Sp, StackOpt,
                      Tp, TricksOpt, Units, Vocab, Vpp, Without, Zero)  # fmt: skip
from .serve import serve
from .web import web

HELP = "Memory and compute of training a transformer, with the formulas shown and checked."


class OneLineErrors(TyperGroup):
    """Usage errors (unknown option, missing value) as one line on stderr and exit code 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)  # fmt: skip
        except Exception as e:  # click's UsageError; typer vendors click in some releases
            if not (hasattr(e, "exit_code") and hasattr(e, "format_message")):
                raise
            message = e.format_message()
            if not message:  # bare `memcalc`: click printed the help, which is what was asked for
                sys.exit(0)
            print(f"error: {message}", file=sys.stderr)
            sys.exit(e.exit_code)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


APP = {"cls": OneLineErrors, "help": HELP, "add_completion": False, "no_args_is_help": True}
SNAPSHOT_HELP = "With --timeline: also write the step as PyTorch's memory snapshot (pytorch.org/memory_viz)."
TRACE_HELP = "With --timeline: also write the step as a trace (JSON) for ui.perfetto.dev or chrome://tracing."
app = typer.Typer(**APP)
PLAN_TRICKS = "bf16,flash"  # plan without --tricks; fp16 in place of bf16 where a card lacks it


def show_version(value: bool) -> None:
    if value:
        from memcalc import __version__

        print(f"memcalc {__version__}")
        raise typer.Exit()


@app.callback()
def options(
    version: Annotated[bool, typer.Option("--version", help="Print memcalc's version and exit.", callback=show_version, is_eager=True)] = False,
) -> None:  # fmt: skip
    """Memory and compute of training a transformer, with the formulas shown and checked."""

@app.command()
def estimate(
    ctx: typer.Context, from_file: FromFile = None, params: Params = None, model: ModelName = None, config: ConfigPath = None,
    layers: Layers = None, hidden: Hidden = None, heads: Heads = None, kv_heads: KvHeads = None,
    ffn: Ffn = None, vocab: Vocab = None,
    seq: Seq = None, micro_batch: MicroBatch = "1", grad_accum: GradAccum = "1", tricks: TricksOpt = None,
    optimizer: Optimizer = "adamw", gpus: Gpus = None, zero: Zero = "0", offload: Offload = False,
    host_memory: HostMemory = "2T", stack: StackOpt = None, recipe: RecipeOpt = None,
    optimizer_impl: ImplOpt = None, no_cache: NoCache = False, offload_activations: OffloadActivations = False, tp: Tp = None, pp: Pp = None, cp: Cp = None, dp: Dp = None, sp: Sp = False, vpp: Vpp = None,
    ep: Ep = None, etp: Etp = None,
    lora: Lora = None, lora_targets: LoraTargets = None, lora_dropout: LoraDropout = None, dora: Dora = False, modules_to_save: ModulesToSave = None, quantize: Quantize = None,
    freeze: Freeze = None, loss: LossOpt = None, optimizer_in_backward: OptimizerInBackward = False, liger: LigerOpt = False, reentrant: ReentrantOpt = False, rl: RlOpt = None, precompute_ref: PrecomputeRef = False, completion_len: CompletionLen = None, num_generations: NumGenerations = None, beta: BetaOpt = None, vllm: VllmOpt = None, vllm_util: VllmUtil = None, vllm_sleep: VllmSleep = False, vllm_max_len: VllmMaxLen = None, cudagraph_memory: GraphMemory = None, critic: CriticOpt = None, rollout_batch: RolloutBatch = None,
    hybrid: Hybrid = False, offload_params: OffloadParams = False, gpus_per_node: GpusPerNode = None,
    pp_layers: PpLayers = None, reshard: Reshard = None,
    gpu: GpuOpt = "h100-sxm", gpu_memory: GpuMemory = None, headroom: HeadroomOpt = None,
    expandable_segments: ExpandableSegments = False, mfu: EstimateMfu = None, calibration: Calibration = None,
    capacity_factor: CapacityFactor = None, expert_imbalance: ExpertImbalance = None,
    tokens: Annotated[Optional[str], typer.Option("--tokens", help="Tokens the whole run trains on (15e12): days, GPU-hours.", metavar="N")] = None,
    price: Annotated[Optional[str], typer.Option("--price-per-gpu-hour", help="Dollars per GPU-hour, for the run's cost.", metavar="X")] = None,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="seq=1k:64k or micro-batch=1:64 (doubling), seq=1k:8k:1k (a step) or seq=1k,4k,6k (a list): memory and step time against it.", metavar="SPEC")] = None,
    png: Annotated[Optional[str], typer.Option("--png", help="With --sweep or --timeline: also draw it to this PNG (needs matplotlib).", metavar="PATH")] = None,
    svg: Annotated[Optional[str], typer.Option("--svg", help="With --timeline: also draw it to this SVG (needs matplotlib).", metavar="PATH")] = None,
    snapshot: Annotated[str | None, typer.Option("--snapshot", help=SNAPSHOT_HELP, metavar="PATH")] = None,
    trace: Annotated[str | None, typer.Option("--trace", help=TRACE_HELP, metavar="PATH")] = None,
    timeline: Annotated[bool, typer.Option("--timeline", help="Live memory over the step, allocation by allocation, from the replay: the phases, the peak and its op, what is live there (costs what --exact costs).")] = False,
    exact: Annotated[bool, typer.Option("--exact", help="Beside the textbook: what PyTorch saves for this architecture, simulated op by op (0.1-0.4 s per trick set).")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Show each formula with this config's numbers.")] = False,
    detail: Detail = False, exact_bytes: ExactBytes = False, fmt: Format = "table", units: Units = "gb",
) -> None:  # fmt: skip
    """Memory per GPU and step time for each trick set, whether it fits, and the cheapest way to fit.

    Step time comes from a roofline over every kernel of the step (--mfu X: from an assumed MFU).
    With --tp, --pp, --cp, --dp (or --sp, --vpp, --hybrid, --offload-params, --gpus-per-node) it
    estimates one GPU of that layout: per-stage memory, traffic per collective, step time and MFU.
    """
    options, source = locals(), None  # every option by name, for the groups (memcalc.cli.groups)
    try:
        from memcalc.engine.job import Job
        from memcalc.engine.rollout import with_engine

        fmt, units = check_format(fmt), render_units(units)
        options, source = with_file(ctx, options, "estimate", listed=("tricks",))  # --from FILE's under the typed
        tricks = options["tricks"]
        the_model = ModelOptions.of(options).resolve()
        the_gpu = GpuOptions.of(options).resolve()
        trick_sets, said = resolve_tricks(tricks, the_gpu)
        setup = StepOptions.of(options).resolve(the_model, StackOptions.of(options).resolve(the_gpu))
        the_gpu = with_engine(the_model, the_gpu, setup)  # --rl grpo --vllm colocate: the engine beside the step
        run = parse_run(tokens, price)
        if png is not None and sweep is None and not timeline:
            raise InputError("--png draws a sweep or a timeline: add --sweep seq=A:B (or micro-batch=A:B) or "
                             "--timeline")  # fmt: skip
        if timeline and (exact or explain):
            raise InputError(f"--timeline draws the replayed step; {'--exact' if exact else '--explain'} is another "
                             "view of it: drop one")  # fmt: skip
        if svg is not None and not timeline:
            raise InputError("--svg draws a timeline: add --timeline")
        exports = views.export_paths(timeline, snapshot, trace)
        if (exact or timeline) and sweep is not None:
            raise InputError(f"{'--exact' if exact else '--timeline'} simulates single steps: drop --sweep")
        if sweep is not None and tokens is not None:
            raise InputError("--tokens times a run at one setting: drop --sweep or --tokens")
        if explain and fmt in ("json", "csv"):
            raise InputError(f"--explain prints the formulas as text; --format {fmt} already carries each term's "
                             "formula and source: drop --explain")  # fmt: skip
        if mfu is not None and calibration is not None:
            raise InputError("--mfu replaces the roofline: drop --calibration or --mfu")
        layout = LayoutOptions.of(options).resolve()
        if tricks is None and layout.cp > 1:  # the progression drops the sets context parallel cannot run
            trick_sets = tuple(t for t in trick_sets if t.flash)
        if tricks is None and setup.stack.rl == "ppo":  # and those PPOTrainer cannot: it never checkpoints
            trick_sets = tuple(t for t in trick_sets if t.recompute == "none")
        timing = setup.mfu if mfu is not None else roofline_calibration(the_gpu, calibration)
        tokens_n, price_x = run or (None, None)
        job = Job(model=the_model, setup=setup, gpu=the_gpu, layout=layout, trick_sets=trick_sets, timing=timing,
                  tokens=tokens_n, price=price_x, exact=exact, timeline=timeline)  # fmt: skip
        if sweep is not None:
            show = views.sweep_view(job, sweep, png)
        else:
            show = views.timeline_view(job, png, svg, exports) if timeline else views.answer_view(job)
        warn(said)  # the input was good and the answer is computed: what to know of the trick sets, then the answer
        read = show_file(source, fmt)
        show(render.Display(fmt, units, detail, detail or exact_bytes, explain, read))  # may write a PNG
    except InputError as e:
        fail(explained(str(e), source))


@app.command()
def plan(
    params: Params = None, model: ModelName = None, config: ConfigPath = None,
    layers: Layers = None, hidden: Hidden = None, heads: Heads = None, kv_heads: KvHeads = None,
    ffn: Ffn = None, vocab: Vocab = None,
    gpus: Annotated[str, typer.Option("--gpus", help="GPUs in the job (the world size).", metavar="N")] = ...,
    global_batch: Annotated[str, typer.Option("--global-batch", help="Sequences per optimizer step, all GPUs together.", metavar="N")] = ...,
    seq: Seq = None, gpus_per_node: GpusPerNode = None,
    tricks: Annotated[Optional[str], typer.Option("--tricks", help="Precision and flash; name ckpt or selective to fix the recompute mode, else all are searched.", metavar="LIST", show_default=PLAN_TRICKS)] = None,
    optimizer: Optimizer = "adamw", gpu: GpuOpt = "h100-sxm", gpu_memory: GpuMemory = None, headroom: HeadroomOpt = None,
    expandable_segments: ExpandableSegments = False, mfu: EstimateMfu = None, calibration: Calibration = None,
    top: Annotated[str, typer.Option("--top", help="How many kinds of layout to show, the fastest of each.", metavar="N")] = "5",
    no_offload: NoOffload = False, without: Without = None,
    host_memory: HostMemory = "2T", stack: StackOpt = None, no_cache: NoCache = False, detail: Detail = False,
    exact_bytes: ExactBytes = False, fmt: Format = "table", units: Units = "gb", lora: Lora = None,
    lora_targets: LoraTargets = None, lora_dropout: LoraDropout = None, dora: Dora = False, modules_to_save: ModulesToSave = None, quantize: Quantize = None,
    freeze: Freeze = None,
) -> None:  # fmt: skip
    """Search every layout (TP, PP, CP, DP, ZeRO, micro-batch, recompute, offload) that fits; rank by tokens/s."""
    options = locals()  # every option by name, for the groups (memcalc.cli.groups)
    try:
        from memcalc.memory.estimate import MAX_HOST_BYTES
        from memcalc.memory.state import MAX_GPUS
        from memcalc.model.shape import MAX_BATCH, parse_count, parse_seq
        from memcalc.model.sizes import parse_fraction
        from memcalc.model.tricks import check_layer_uniform, layout_counts
        from memcalc.parallel.plan import plan as run_plan

        from .groups import seq_for

        fmt, units = check_format(fmt), render_units(units)
        the_model = ModelOptions.of(options).resolve()
        seq = seq_for(seq, the_model)  # 4096, or the model's position table if shorter
        the_gpu = GpuOptions.of(options).resolve()
        (t,), said = resolve_tricks(None if tricks is None else [tricks], the_gpu, PLAN_TRICKS)
        if not layout_counts(t, the_model.shape.is_moe):
            check_layer_uniform(t, "the planner's layouts")
        named = t.recompute != "none"  # ckpt or selective named: the recompute mode is fixed
        if mfu is not None and calibration is not None:
            raise InputError("--mfu replaces the roofline: drop --calibration or --mfu")
        timing = parse_fraction(mfu, "mfu") if mfu is not None else roofline_calibration(the_gpu, calibration)
        stack = StackOptions.of(options, recipe=None, optimizer_impl=None).resolve()  # the planner picks no recipe
        result = run_plan(
            the_model, the_gpu, parse_count(gpus, "gpus", MAX_GPUS), parse_seq(seq),
            parse_count(global_batch, "global-batch", MAX_BATCH),
            gpus_per_node=8 if gpus_per_node is None else parse_count(gpus_per_node, "gpus-per-node", MAX_GPUS),
            tricks=t, optimizer=optimizer.strip().lower(), timing=timing,
            top=parse_count(top, "top", 1000), offload=not no_offload,
            recomputes=(t.recompute,) if named else ("none", "selective", "full"),
            host_memory=parse_count(host_memory, "host-memory", MAX_HOST_BYTES),
            stack=stack,
            without=tuple(w.strip().lower() for w in (without or "").split(",") if w.strip()),
        )  # fmt: skip
    except InputError as e:
        fail(str(e))
    warn(said)
    from memcalc.report import plan as pr

    csv_table = (pr.PLAN_CSV_HEADERS, pr.plan_csv_rows(result))
    render.emit(fmt, result, pr.plan_sections(result, units, detail), pr.plan_preamble(result, units), csv_table,
                exact=detail or exact_bytes, after=[pr.plan_verdict(result, units)])  # fmt: skip


app.command()(fit)  # memcalc/cli/limits.py: fit and mfu, what one GPU holds and what a run reached
app.command()(mfu)


@app.command()
def verify(
    params: Params = None, model: ModelName = None, config: ConfigPath = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Depth to build (overrides the model's layers).", metavar="N")] = None,
    hidden: Hidden = None, heads: Heads = None, kv_heads: KvHeads = None, ffn: Ffn = None, vocab: Vocab = None,
    seq: Seq = None, micro_batch: MicroBatch = "1",
    tricks: Annotated[str, typer.Option("--tricks", help="The trick set to build and measure.", metavar="LIST")] = "bf16",
    stack: StackOpt = None, recipe: RecipeOpt = None, optimizer_impl: ImplOpt = None, no_cache: NoCache = False,
    lora: Lora = None, lora_targets: LoraTargets = None, lora_dropout: LoraDropout = None, dora: Dora = False, modules_to_save: ModulesToSave = None, quantize: Quantize = None,
    freeze: Freeze = None, loss: LossOpt = None, optimizer_in_backward: OptimizerInBackward = False, liger: LigerOpt = False, reentrant: ReentrantOpt = False, rl: RlOpt = None, precompute_ref: PrecomputeRef = False, completion_len: CompletionLen = None, num_generations: NumGenerations = None, beta: BetaOpt = None, vllm: VllmOpt = None, vllm_util: VllmUtil = None, vllm_sleep: VllmSleep = False, vllm_max_len: VllmMaxLen = None, cudagraph_memory: GraphMemory = None, critic: CriticOpt = None, rollout_batch: RolloutBatch = None,
    optimizer: Optimizer = "adamw", matrix: Annotated[bool, typer.Option("--matrix", help="Every trick set in one run, and one summary table.")] = False,
    steps: Annotated[str, typer.Option("--steps", help="Timed steps after warm-up (CUDA).", metavar="N")] = "3",
    device: Annotated[Optional[str], typer.Option("--device", help="cuda or meta.", metavar="DEV", show_default="cuda when present, else meta")] = None,
    tol: Annotated[Optional[str], typer.Option("--tol", help="Relative tolerance per row.", metavar="X", show_default="0.03 on cuda, 0.001 on meta")] = None,
    fsdp: Annotated[Optional[str], typer.Option("--fsdp", "--dp", help="Check one rank of FSDP2 (ZeRO-3) over N GPUs, on PyTorch's own engine.", metavar="N")] = None,
    tp: Annotated[Optional[str], typer.Option("--tp", help="Check one rank of DTensor tensor parallelism over N GPUs.", metavar="N")] = None,
    sp: Sp = False, reshard: Reshard = None,
    pp: Annotated[Optional[str], typer.Option("--pp", help="With --fsdp N --stack fsdp2: check one rank of a pipeline stage (torchtitan's FSDP + PP, 1F1B).", metavar="P")] = None,
    stage: Annotated[Optional[str], typer.Option("--stage", help="With --pp: the stage to check (default: the one estimate reports as the layout's peak).", metavar="K")] = None,
    grad_accum: Annotated[Optional[str], typer.Option("--grad-accum", help="With --pp: micro-batches per step.", metavar="N", show_default="P")] = None,
    dist_device: Annotated[Optional[str], typer.Option("--dist-device", help="With --fsdp/--tp: meta (fake process group), cpu-gloo or cuda.", metavar="DEV", show_default="meta")] = None,
    save: Annotated[Optional[str], typer.Option("--save", help="With --matrix: write each run's JSON into this folder as soon as it ends.", metavar="DIR")] = None,
    step: Annotated[Optional[str], typer.Option("--step", help="Measure your own model and step: FILE.py:FUNCTION or MODULE:FUNCTION (docs/verify.md).", metavar="FN")] = None,
    no_linearity: Annotated[bool, typer.Option("--no-linearity", help="Skip the second, shallower build that checks saved bytes are linear in depth.")] = False,
    timeline: Annotated[bool, typer.Option("--timeline", help="Lay the live bytes measured at each allocation (meta; CPU tensors for an autocast stack) over the predicted ones, and judge that each coincides.")] = False,
    png: Annotated[Optional[str], typer.Option("--png", help="With --timeline: also draw it to this PNG (needs matplotlib).", metavar="PATH")] = None,
    svg: Annotated[Optional[str], typer.Option("--svg", help="With --timeline: also draw it to this SVG (needs matplotlib).", metavar="PATH")] = None,
    snapshot: Annotated[str | None, typer.Option("--snapshot", help=SNAPSHOT_HELP + " The predicted step.", metavar="PATH")] = None,
    trace: Annotated[str | None, typer.Option("--trace", help=TRACE_HELP + " The predicted step.", metavar="PATH")] = None,
    detail: Detail = False, exact_bytes: ExactBytes = False, fmt: Format = "table", units: Units = "gb",
) -> None:  # fmt: skip
    """Build the real model in PyTorch, train a few steps, and hold every prediction against the measurement."""
    options = locals()  # every option by name, for the groups (memcalc.cli.groups)
    collection.FREEZE = False  # torch's objects in cycles must be collected: a leaked storage would be measured
    try:
        from memcalc.model.shape import parse_count
        from memcalc.model.sizes import parse_fraction
        from memcalc.model.tricks import check_measurable

        from . import verify_runs

        fmt, units = check_format(fmt), render_units(units)
        models = ModelOptions.of(options)
        the_model = models.resolve() if models.given or step is None else None  # --step measures its own
        # its --grad-accum is a pipeline's micro-batches (with --pp): the step itself is one micro-batch
        setup = StepOptions.of(options, grad_accum="1").resolve(the_model, StackOptions.of(options).resolve())
        if setup.stack.rl == "ppo":  # its loop is PPOTrainer.train() itself, not a step the harness can call
            raise InputError("--rl ppo: verify does not run PPOTrainer's loop; tests/test_ppo.py holds the replay to "
                             "TRL's PPOTrainer.train() on CPU tensors, allocation by allocation (verify/trl_ppo.py)")
        (the_tricks,), said = resolve_tricks([tricks], None)
        check_measurable(the_tricks)
        n_steps = parse_count(steps, "steps", 1000)
        tolerance = None if tol is None else parse_fraction(tol, "tol")
        if step is None and device is not None and device.strip().lower() not in ("cuda", "meta"):
            raise InputError(f"unknown device {device!r}; choose cuda or meta")
        images = verify_runs.timeline_images(timeline, png, svg, matrix, step is not None or fsdp is not None
                                             or tp is not None or sp, device)  # fmt: skip
        exports = views.export_paths(timeline, snapshot, trace)
        verify_runs.needs_torch()
        if step is not None:
            given = [flag for flag, on in (("--matrix", matrix), ("--save", save is not None), ("--tol", tol is not None),
                                           ("--fsdp/--tp/--sp", fsdp is not None or tp is not None or sp),
                                           ("--dist-device", dist_device is not None),
                                           ("--reshard", reshard is not None),
                                           ("--pp/--stage/--grad-accum", pp is not None or stage is not None or grad_accum is not None)) if on]  # fmt: skip
            if given:
                raise InputError(f"{subject(given, 'does not apply', 'do not apply')} to --step, which measures your "
                                 "step once")  # fmt: skip
            run = verify_runs.custom_run(the_model, setup, the_tricks, step, device)
        elif fsdp is not None or tp is not None or sp:
            given = [flag for flag, on in (("--device", device is not None), ("--tol", tol is not None)) if on]
            if given:
                raise InputError(f"{subject(given, 'applies', 'apply')} to one GPU's verify; --fsdp/--tp check one rank "
                                 "on --dist-device (meta, cpu-gloo or cuda) and compare bytes exactly")  # fmt: skip
            if save is not None and not matrix:
                raise InputError("--save writes the runs of --matrix: add --matrix")
            if pp is not None or stage is not None or grad_accum is not None:
                run = verify_runs.pipeline_run(the_model, setup, the_tricks, fsdp, tp, sp, pp, stage, grad_accum,
                                               dist_device or "meta", matrix, reshard)  # fmt: skip
            else:
                run = verify_runs.dist_run(the_model, setup, the_tricks, fsdp, tp, sp, dist_device or "meta", matrix, save,
                                           reshard)  # fmt: skip
        else:
            if pp is not None or stage is not None or grad_accum is not None:
                raise InputError("--pp/--stage/--grad-accum check a pipeline stage's rank: add --fsdp N --stack fsdp2")
            if reshard is not None:
                raise InputError("--reshard/--no-reshard apply to the FSDP2 check: add --fsdp N --stack fsdp2")
            if dist_device is not None:
                raise InputError("--dist-device applies to --fsdp and --tp, where their ranks run (meta, cpu-gloo or "
                                 "cuda): add --fsdp N or --tp N, or drop it (one GPU's check runs on --device)")  # fmt: skip
            if save is not None and not matrix:
                raise InputError("--save writes the runs of --matrix: add --matrix")
            run = verify_runs.single_run(the_model, setup, the_tricks, matrix, n_steps, device, tolerance, fmt, save,
                                         not no_linearity, units, timeline)  # fmt: skip
        results = run()
        verify_runs.draw_timeline(results, images, units)
        verify_runs.export_timeline(results, exports)
    except InputError as e:
        fail(str(e))
    warn([] if matrix else said)  # --matrix measures every trick set but the one named
    if not verify_runs.show_verify(results, render.Display(fmt, units, detail, detail or exact_bytes)):
        raise typer.Exit(1)


app.command()(serve)  # `memcalc serve` (memcalc/cli/serve.py)
app.command()(web)  # `memcalc web` (memcalc/cli/web.py)


@app.command()
def presets(fmt: Format = "table") -> None:
    """The model presets and the canonical shapes behind --params."""
    show_reference("presets", fmt)


@app.command()
def gpus(fmt: Format = "table") -> None:
    """The GPU table: dense peak rates, memory and bandwidth, with sources."""
    show_reference("gpus", fmt)


@app.command()
def formats(fmt: Format = "table") -> None:
    """FP32 / FP16 / BF16 (and TF32, FP8) from their bit layouts, and three demonstrations."""
    show_reference("formats", fmt)


def show_reference(name: str, fmt: str) -> None:
    from memcalc.report import reference as catalog

    try:
        fmt = check_format(fmt)
    except InputError as e:
        fail(str(e))
    sections, objects, csv_table = catalog.REFERENCE[name]
    render.emit(fmt, objects(), sections(), csv_table=csv_table())


def main() -> None:
    """The app with only the command asked for built: typer makes every command's options into click
    objects before it parses, half of it the other commands' (valgrind: 25M of the 51M instructions);
    `memcalc`, --help, --version or a name that is no command get the whole app."""
    asked = [c for c in app.registered_commands if sys.argv[1:2] == [command_name(c)]]
    if not asked:
        return app()
    one = typer.Typer(**APP)
    one.registered_callback, one.registered_commands = app.registered_callback, asked
    one()


def command_name(info) -> str:
    """A command's name as typer derives it from its function: plan_layouts -> plan-layouts."""
    return info.name or info.callback.__name__.lower().replace("_", "-")
