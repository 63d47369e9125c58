"""The entry points of `memcalc verify`: one trick set (verify) or all of them (verify_matrix).

Each run builds the model verify/builder.py describes, trains it for a few steps on the device,
and compares every measured quantity with memcalc.exact's prediction and the textbook's number.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from memcalc.errors import InputError
from memcalc.exact.step import ExactStep, exact_step
from memcalc.memory.estimate import Setup
from memcalc.model.gpus import GPU, GPUS
from memcalc.model.shape import Model, ModelShape, check_positions
from memcalc.model.tricks import Tricks, parse_tricks
from memcalc.report.units import size
from memcalc.time.calibration import calibration_for
from memcalc.time.roofline import roofline
from memcalc.exact.timeline import step_timeline
from memcalc.verification.results import DEFAULT_TOL, Row, Timing, VerifyResult
from memcalc.verification.timeline import Overlay, measured

from .cuda import (
    OOM,
    CpuStats,
    CudaStats,
    DeviceRun,
    deepest_fit,
    measure_device,
    measure_retained,
    median,
    with_layers,
)
from .autocast import autocasts, cpu_rows
from .meta import measure_meta
from .recipes import check_recipe
from .rows import flop_rows, layer_rows, overlay_row, step_rows, textbook, textbook_gaps

# The matrix: the field's progression, plus fp16 and the remaining recompute combinations.
MATRIX = tuple(parse_tricks(t) for t in (
    "fp32", "bf16", "fp16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective", "bf16,flash,selective", "bf16,ckpt",
))  # fmt: skip
FIT_MARGIN = 0.92  # of free memory the prediction may fill: allocator rounding, cuBLAS workspaces, kernels' scratch
RETRIES = 4  # out-of-memory retries, each with 80% of the layers
STAGES = {"meta": 2, "cuda": 2, "cpu": 2}  # progress calls per run (measure_meta's two passes; device_rows' two)
Progress = Callable[[str, int, int], None]  # (what runs now, stages done, stages in all)


def pick_device(device: str | None) -> tuple[str, str]:
    """cuda when present, else meta; an explicit choice is checked. (cpu: the tests' stand-in.)"""
    if device is None:
        if torch.cuda.is_available():
            return "cuda", "CUDA is available"
        return "meta", "no CUDA device: the meta device (nothing allocated; every storage tracked)"
    if device not in ("cuda", "meta", "cpu"):
        raise InputError(f"unknown device {device!r}; choose cuda or meta")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device cuda, but torch {torch.__version__} sees no CUDA device")
    return device, f"--device {device}"


def check_setup(setup: Setup) -> None:
    if setup.grad_accum != 1:  # the recipe runs one micro-batch per optimizer step
        raise InputError(f"verify measures one micro-batch per step: grad_accum must be 1, got {setup.grad_accum}")


def check_stack(setup: Setup, tricks: Tricks, device: str) -> None:
    """Where verify measures Transformers' model so far: on the meta device, and under autocast on CPU
    tensors (recipes.check_recipe says which recipes and optimizers it trains)."""
    if setup.stack.model == "hf" and device != "meta" and not autocasts(setup.stack, tricks):
        raise InputError("--stack hf is measured on the meta device so far: give --device meta")
    online = setup.stack.online
    if device == "meta" and online is not None and online.completion_len < setup.seq_len - 1:
        raise InputError(f"--rl {setup.stack.rl} on meta: a boolean index keeps every position there (verify/trl.py "
                         "fused_paths), so the prompt's positions would be scored: give --completion-len "
                         f"{setup.seq_len - 1} (a one-token prompt), or --recipe autocast to measure on CPU "
                         "tensors")  # fmt: skip


def autocast_device(device: str | None) -> tuple[str, str]:
    """Where an autocast stack is measured: torch.autocast does nothing on the meta device, so on real
    CPU tensors at reduced size (verify/autocast.py); a CUDA run of it is not wired yet."""
    if device is not None and device.strip().lower() == "cuda":
        pick_device("cuda")  # no GPU: its one-line refusal
        raise InputError("the autocast recipe is measured on CPU tensors at reduced size so far, not on CUDA: "
                         "drop --device cuda")  # fmt: skip
    if device is not None and device.strip().lower() not in ("meta", "cpu"):
        pick_device(device)  # an unknown device: its one-line refusal
    return "cpu", "torch.autocast does nothing on the meta device: real CPU tensors at reduced size"


def gpu_for(name: str) -> GPU | None:
    """The GPU table's entry for torch.cuda.get_device_name(), or None."""
    n = name.upper()
    if "H200" in n:
        return GPUS["h200"]
    if "H100" in n:
        return GPUS["h100-pcie" if "PCIE" in n else "h100-sxm"]
    if "A100" in n:
        return GPUS["a100-40gb" if "40G" in n else "a100-80gb"]
    return None


def attention_name(tricks: Tricks, device: str, ops: tuple[str, ...] = (), stack_model: str = "reference") -> str:
    if stack_model == "hf":
        if not tricks.flash:
            return "Transformers' eager_attention_forward (the model's modeling file): the scores materialised"
        if tricks.precision == "fp32":  # CUDA's flash kernel takes 16 bits only
            return ("Transformers' sdpa path at fp32: SDPA's memory-efficient kernel "
                    "(aten._scaled_dot_product_efficient_attention) for one key head per query head, its math "
                    "path for grouped heads")  # fmt: skip
        return ("Transformers' sdpa path (integrations/sdpa_attention.py) down to aten._flash_attention_forward, "
                "the kernel CUDA's SDPA flash backend runs")  # fmt: skip
    if not tricks.flash:
        return "eager: softmax(QKᵀ)V, the scores materialised"
    if device == "meta":
        return "aten._scaled_dot_product_flash_attention, called directly (what SDPA's flash backend runs on CUDA)"
    return f"flash: {', '.join(ops) if ops else 'no attention op seen'}"


# -- rows ---------------------------------------------------------------------------------------------


def meta_rows(shape: ModelShape, setup: Setup, tricks: Tricks, tol: float, progress,
              timeline: bool = False) -> tuple[list[Row], tuple, Overlay | None]:  # fmt: skip
    """The rows on meta, and with timeline the measured step laid over the predicted one (Overlay)."""
    m = measure_meta(shape, setup.seq_len, setup.micro_batch, tricks, progress, setup.stack, setup.optimizer,
                     timeline)  # fmt: skip
    e = exact_step(shape, setup.seq_len, setup.micro_batch, tricks, 1, setup.stack, setup.optimizer, watched=True)
    tb, s, ph, a, L = textbook(shape, setup, tricks), m.step, e.phases, e.activations, shape.n_layers
    where = {"forward": s.forward_peak_at, "backward": s.backward_peak_at, "optimizer": s.optimizer_peak_at}
    first = m.first_blocks  # dense blocks before MoE ones (or fine-tuning's first blocks, frozen or with an input
    later = " MoE" if shape.n_experts else " later"  # needing no grad): one layer past them; they count outside
    outside = f"outside the{later} layers (and the first {first} blocks)" if first else "outside the layers"
    plain, n = L - first - m.n_checkpointed, m.n_checkpointed
    rows = [
        Row("weights and buffers", "bytes", tb["weights"], ph.weights_bytes, s.weights_bytes, tol),
        Row("model state between steps (weights, master, AdamW m and v)", "bytes", tb["state"], ph.state_bytes,
            s.state_bytes, tol),
        Row("gradients after backward", "bytes", tb["grads"], ph.grads_bytes, s.grads_bytes, tol),
    ] + layer_rows(m, a, tb, tol, later) + [
        Row(f"saved for backward, {outside}", "bytes", None if first else tb["outside"], a.outside_bytes,
            m.saved_outside_bytes, tol, "textbook: the logits and their fp32 copy"),
        Row(f"saved for backward, all {L} layers", "bytes", tb["saved"], a.total_bytes, s.saved_bytes, tol,
            "textbook: no formula for sac" if tb["saved"] is None else ""),
        Row("saved bytes linear in depth (outside + L × layer)" if not n else
            f"saved bytes linear in depth (outside + {plain} plain + {n} checkpointed layers)", "bytes", None,
            m.saved_from_depths, s.saved_bytes, 0.0),
        Row("kept after forward (saved, checkpoint inputs, loss)", "bytes", None, ph.retained_bytes,
            s.retained_bytes, tol),
    ]  # fmt: skip
    rows += step_rows(e, s, tb, tol, where) + flop_rows(e, m.flops, tb, tol)
    notes = (f"meta measured in {m.seconds:.1f} s", e.note) + textbook_gaps(tricks)
    if setup.stack.model == "hf":
        from .hf import describe

        notes += (describe(shape),)
    overlay = None
    if timeline:
        predicted = step_timeline(shape, setup.seq_len, setup.micro_batch, tricks, 1, setup.stack, setup.optimizer)
        overlay = Overlay(predicted, measured(m.timeline, "meta"))
        rows.append(overlay_row(overlay))
    return rows, notes, overlay


def reserved_row(shape: ModelShape, setup: Setup, tricks: Tricks, stats, gpu: GPU | None, measured: int) -> Row:
    """max_memory_reserved beside memcalc.exact.reserved's replay of the caching allocator (CUDA only: CPU tensors
    have no caching allocator), with cuBLAS's workspaces, which two threads' handles allocate through it
    (memcalc.model.headroom.cublas_workspace)."""
    name = "reserved by the caching allocator (max_memory_reserved)"
    if stats.device != "cuda":
        return Row(name, "bytes", None, None, measured)
    from memcalc.exact.reserved import step_reserved
    from memcalc.model.headroom import cublas_workspace

    r = step_reserved(shape, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack, setup.optimizer)
    workspaces = 2 * cublas_workspace(gpu.arch if gpu is not None else "sm90")
    return Row(name, "bytes", None, r.reserved_bytes + workspaces, measured, None,
               "predicted: the allocator replayed over build and two steps, + two cuBLAS workspaces")  # fmt: skip


def device_rows(shape: ModelShape, setup: Setup, tricks: Tricks, tol: float, stats, steps: int, linearity: bool,
                gpu: GPU | None, progress) -> tuple[list[Row], DeviceRun, Timing, tuple]:  # fmt: skip
    progress(f"training {shape.n_layers} layers on {stats.device}")
    run = measure_device(shape, setup.seq_len, setup.micro_batch, tricks, stats, steps, setup.grad_accum,
                         stack=setup.stack, optimizer=setup.optimizer)  # fmt: skip
    e = exact_step(shape, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack, setup.optimizer,
                   stats.device, watched=stats.device != "cuda")  # CPU tensors (the stand-in): CPU's kernels
    tb, ph, d, L = textbook(shape, setup, tricks), e.phases, run.phases, shape.n_layers
    where = {"forward": ph.forward_peak_at, "backward": ph.backward_peak_at, "optimizer": ph.optimizer_peak_at}
    rows = [
        Row("after build: weights and buffers (memory_allocated)", "bytes", tb["weights"], ph.weights_bytes,
            d.after_build_bytes, tol),
        Row("after the first optimizer step: model state and inputs", "bytes", tb["state"],
            ph.state_bytes + ph.inputs_bytes, d.after_first_step_bytes, tol),
        Row("kept after forward (saved, checkpoint inputs, loss)", "bytes", None, ph.retained_bytes,
            d.retained_bytes, tol),
    ]  # fmt: skip
    rows += step_rows(e, d, tb, tol, {k: "exact: " + v for k, v in where.items()})
    rows.append(reserved_row(shape, setup, tricks, stats, gpu, d.reserved_peak_bytes))
    L2 = max(1, L // 2)
    progress(f"second depth: {L2} layers" if linearity and L > 1 else "done")
    if linearity and L > 1:
        r2 = measure_retained(with_layers(shape, L2), setup.seq_len, setup.micro_batch, tricks, stats)
        e2 = exact_step(with_layers(shape, L2), setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack,
                        setup.optimizer, stats.device)  # fmt: skip
        exact, measured = (ph.retained_bytes - e2.phases.retained_bytes) / (L - L2), (d.retained_bytes - r2) / (L - L2)
        rows.append(Row(f"kept after forward, per layer (depths {L} and {L2})", "bytes", tb["layer"], exact, measured,
                        tol))  # fmt: skip
    timing = timing_of(run, e, setup, tricks, gpu, shape)
    predicted = f"; predicted by the roofline ({timing.calibration})" if timing.predicted_seconds else ""
    rows += flop_rows(e, None, tb, tol) + [
        Row("step time (median)", "seconds", None, timing.predicted_seconds, timing.step_seconds, None,
            f"{timing.steps} steps after warm-up{predicted}"),
        Row("tokens/s", "tokens/s", None, None, timing.tokens_per_second),
        Row("achieved TFLOP/s (model FLOPs)", "TFLOP/s", None, None, timing.model_tflops),
        Row("MFU", "fraction", None, None, timing.mfu, None,
            f"peak {timing.peak_tflops:g} TFLOP/s" if timing.peak_tflops else "GPU not in the table"),
    ]  # fmt: skip
    return rows, run, timing, (f"attention kernels seen: {', '.join(run.attention_ops) or 'none (eager)'}",)


def timing_of(run: DeviceRun, e: ExactStep, setup: Setup, tricks: Tricks, gpu: GPU | None,
              shape: ModelShape | None = None) -> Timing:  # fmt: skip
    """Measured step time, throughput and utilisation; beside them the roofline's prediction for
    the model as built (shape), op by op, on a GPU the table knows."""
    t = median(run.step_seconds)
    tokens = setup.tokens_per_step
    model_tf, hw_tf = e.flops.model * setup.grad_accum / t / 1e12, e.flops.counted * setup.grad_accum / t / 1e12
    peak = gpu.peak_flops(tricks.precision) / 1e12 if gpu is not None else None
    predicted = None
    if gpu is not None and shape is not None:
        cal = calibration_for(gpu.key)
        predicted = roofline(shape, setup.seq_len, setup.micro_batch, setup.grad_accum, tricks, gpu, cal)
    return Timing(len(run.step_seconds), t, run.step_seconds, tokens / t, model_tf, hw_tf, peak,
                  model_tf / peak if peak else None, hw_tf / peak if peak else None,
                  predicted.step_seconds if predicted else None, predicted.calibration if predicted else "",
                  predicted.ops if predicted else ())  # fmt: skip


# -- entry points -----------------------------------------------------------------------------------


def verify(model: Model, setup: Setup, tricks: Tricks, device: str | None = None, steps: int = 3,
           layers: int | None = None, tol: float | None = None, progress: Progress | None = None,
           linearity: bool = True, cpu_limit_bytes: int | None = None, units: str = "gb",
           timeline: bool = False) -> VerifyResult:  # fmt: skip
    """Measure one trick set and compare it with memcalc's predictions.

    device: cuda, meta, or None (cuda when present, else meta). cpu runs the CUDA path on CPU
      tensors with the tracker for the allocator (for tests; cpu_limit_bytes plays a GPU's size).
    steps: timed steps after the warm-up and the measured step (CUDA).
    layers: build this many layers instead of the model's. On CUDA a model that the prediction says
      will not fit is built as deep as fits, and an out-of-memory error retries shallower.
    linearity: on CUDA, also measure at half the depth (per-layer bytes are linear in depth).
    units: gb or gib, for the sizes written into notes and errors (the rows hold bytes).
    timeline: lay the step measured on meta (an autocast stack's on CPU tensors) over the prediction,
      allocation by allocation (the result's timeline), and judge that every one coincides.
    Out of memory and a missing flash kernel come back as the result's error; bad input raises
    InputError.
    """
    check_setup(setup)
    check_recipe(tricks.precision, setup.stack, setup.optimizer)
    on_cpu = autocasts(setup.stack, tricks)
    device, reason = autocast_device(device) if on_cpu else pick_device(device)
    check_stack(setup, tricks, device)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive whole number, got {steps!r}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise InputError(f"layers must be a positive whole number, got {layers!r}")
    tol = DEFAULT_TOL[device] if tol is None else tol
    if not 0 <= tol < 1:
        raise InputError(f"tolerance must be a fraction in [0, 1), got {tol}")
    shape = with_layers(model.shape, layers or model.shape.n_layers)
    check_positions(shape, setup.seq_len)
    report, start = stage_reporter(progress, device), time.perf_counter()
    result = dict(model=shape.name, origin=model.origin, family=shape.family, tricks=tricks.label, device=device,
                  device_reason=reason, torch_version=torch.__version__, seq_len=setup.seq_len,
                  micro_batch=setup.micro_batch, grad_accum=setup.grad_accum, layers_requested=shape.n_layers,
                  tolerance=tol, per_sample=setup.per_sample)  # fmt: skip
    if timeline and not on_cpu and device != "meta":
        raise InputError("--timeline lays the step measured on meta (or, for an autocast stack, on CPU tensors) "
                         f"over the prediction; {device} is measured by its allocator's counters: --device meta")
    if on_cpu:
        result.update(autocast_result(shape, setup, tricks, tol, report, units, timeline))
    elif device == "meta":
        rows, notes, overlay = meta_rows(shape, setup, tricks, tol, report, timeline)
        result.update(attention=attention_name(tricks, "meta", stack_model=setup.stack.model), gpu_name=None,
                      layers_built=shape.n_layers, layers_note="", rows=tuple(rows), phases=None, timing=None,
                      error=None, notes=notes, timeline=overlay)  # fmt: skip
    else:
        result.update(verify_on_device(shape, setup, tricks, device, steps, tol, linearity, cpu_limit_bytes, report,
                                       units))  # fmt: skip
    return VerifyResult(**result, seconds=time.perf_counter() - start)


def autocast_result(shape: ModelShape, setup: Setup, tricks: Tricks, tol: float, report, units: str = "gb",
                    timeline: bool = False) -> dict:  # fmt: skip
    """An autocast stack, measured on CPU tensors at reduced size beside the CPU replay of that step
    (verify/autocast.py cpu_rows); the CUDA prediction at the size asked in a note."""
    rows, notes, red, overlay = cpu_rows(shape, setup, tricks, tol, report, textbook, timeline)
    if overlay is not None:
        rows.append(overlay_row(overlay))
    p = exact_step(shape, setup.seq_len, setup.micro_batch, tricks, 1, setup.stack, setup.optimizer).phases
    peak, at = max(((p.forward_peak_bytes, p.forward_peak_at), (p.backward_peak_bytes, p.backward_peak_at),
                    (p.optimizer_peak_bytes, p.optimizer_peak_at)), key=lambda x: x[0])  # fmt: skip
    notes += (f"the CUDA prediction at the size asked ({shape.n_layers} layers, seq {setup.seq_len}): whole-step "
              f"peak {size(peak, units)} ({peak:,} B) at {at}",)  # fmt: skip
    if setup.stack.model == "hf":
        from .hf import describe

        notes += (describe(shape) + ", under autocast as Accelerate prepares its forward",)
    attention = ("SDPA's CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu)" if tricks.flash
                 else attention_name(tricks, "cpu", stack_model=setup.stack.model))  # fmt: skip
    return dict(attention=attention, gpu_name=None, layers_built=red.shape.n_layers, layers_note=red.note,
                rows=tuple(rows), phases=None, timing=None, error=None, notes=notes, timeline=overlay)


def verify_on_device(shape: ModelShape, setup: Setup, tricks: Tricks, device: str, steps: int, tol: float,
                     linearity: bool, cpu_limit_bytes: int | None, report, units: str = "gb") -> dict:  # fmt: skip
    """The deepest model that fits, measured; out of memory retried shallower, then reported."""
    if tricks.flash and device == "cpu":
        raise InputError("flash attention needs CUDA (or the meta device)")
    stats = CudaStats() if device == "cuda" else CpuStats(cpu_limit_bytes)
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else None
    gpu = gpu_for(gpu_name) if gpu_name else None
    budget = stats.free_bytes() * FIT_MARGIN

    def predicted(layers: int) -> int:
        s = with_layers(shape, layers)
        return exact_step(s, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack,
                          setup.optimizer).peak_bytes  # fmt: skip

    built, note = shape.n_layers, ""
    if predicted(built) > budget:
        built = deepest_fit(shape, lambda layers: predicted(layers) <= budget)
        need = size(predicted(shape.n_layers), units)
        note = f"{shape.n_layers} layers need {need} (predicted); {built} fit in {size(budget, units)}"
    error, rows, run, timing, notes = None, [], None, None, ()
    for _ in range(RETRIES):
        if built < 1:
            error = f"out of memory: not even one layer fits ({note or size(budget, units) + ' free'})"
            break
        try:
            rows, run, timing, notes = device_rows(with_layers(shape, built), setup, tricks, tol, stats, steps,
                                                   linearity, gpu, report)  # fmt: skip
            error = None
            break
        except OOM as exc:
            stats.release()
            first = (str(exc).strip().splitlines() or ["out of memory"])[0][:160]
            smaller = min(built - 1, int(built * 0.8))
            error = f"out of memory at {built} layers: {first}"
            note = f"{built} layers ran out of memory ({first}); retried with {smaller}"
            built = smaller
        except RuntimeError as exc:  # no flash kernel for this GPU, dtype or head size; cuBLAS errors
            stats.release()
            error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            break
    return dict(attention=attention_name(tricks, device, run.attention_ops if run else ()), gpu_name=gpu_name,
                layers_built=built if rows else 0, layers_note=note, rows=tuple(rows),
                phases=run.phases if run else None, timing=timing, error=error, notes=notes)  # fmt: skip


def verify_matrix(model: Model, setup: Setup, device: str | None = None, trick_sets: tuple[Tricks, ...] = MATRIX,
                  steps: int = 3, layers: int | None = None, tol: float | None = None,
                  progress: Progress | None = None, linearity: bool = True,
                  cpu_limit_bytes: int | None = None, on_result: Callable[[VerifyResult], None] | None = None,
                  units: str = "gb") -> list[VerifyResult]:  # fmt: skip
    """verify() for every trick set in turn; a run that fails is a result (its error), the rest go on.
    progress counts whole runs: (trick set: what runs now, runs done, runs in all); on_result gets
    each result as soon as its run ends (so a run cut short by a time limit keeps what it finished)."""
    results, n = [], len(trick_sets)
    for i, tricks in enumerate(trick_sets):
        sub = None
        if progress is not None:
            sub = lambda what, done, total, i=i, label=tricks.label: progress(f"{label}: {what}", i, n)  # noqa: E731
        results.append(verify(model, setup, tricks, device, steps, layers, tol, sub, linearity, cpu_limit_bytes, units))
        if on_result is not None:
            on_result(results[-1])
    if progress is not None:
        progress("done", n, n)
    return results


def stage_reporter(progress: Progress | None, device: str) -> Callable[[str], None]:
    """report(what) -> progress(what, stages done before it, stages in all)."""
    count = [0]

    def report(what: str) -> None:
        if progress is not None:
            progress(what, count[0], STAGES[device])
        count[0] += 1

    return report
