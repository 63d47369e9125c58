"""How `memcalc verify` runs (verify/ and torch imported only once a run starts) and prints its results."""

import importlib.util
import os
import sys

from memcalc.errors import InputError
from memcalc.report import render


def needs_torch() -> None:
    """verify/ runs on PyTorch: without it, one line that says how to get it (not torch's traceback)."""
    if importlib.util.find_spec("torch") is None:
        raise InputError("memcalc verify needs PyTorch: pip install 'memcalc[verify]'")


def single_run(model, setup, tricks, matrix: bool, steps: int, device, tol, fmt: str, save: str | None = None,
               linearity: bool = True, units: str = "gb", timeline: bool = False):  # fmt: skip
    """verify/ (torch) imported only now; a progress bar on a terminal for the table format."""
    on_result = None if save is None else saver(save)

    def run():
        from verify.run import verify as run_verify
        from verify.run import verify_matrix

        with progress_bar(fmt == "table" and sys.stdout.isatty()) as progress:
            dev = None if device is None else device.strip().lower()
            if matrix:
                return verify_matrix(model, setup, device=dev, steps=steps, tol=tol, progress=progress,
                                     linearity=linearity, on_result=on_result, units=units)  # fmt: skip
            return [run_verify(model, setup, tricks, device=dev, steps=steps, tol=tol, progress=progress,
                               linearity=linearity, units=units, timeline=timeline)]  # fmt: skip

    return run


def timeline_images(timeline: bool, png: str | None, svg: str | None, matrix: bool, other: bool,
                    device: str | None) -> list:  # fmt: skip
    """--timeline's checks before torch loads: one trick set on one GPU, measured on meta (verify/run.py
    refuses CUDA where it picks it), the image paths, matplotlib."""
    from memcalc.report.plot import check_image, pyplot

    images = [(path, suffix, flag) for path, suffix, flag in ((png, ".png", "--png"), (svg, ".svg", "--svg")) if path]
    if images and not timeline:
        raise InputError(f"{images[0][2]} draws the timeline: add --timeline")
    if timeline and (matrix or other):
        raise InputError("--timeline overlays one trick set's step on one GPU: drop --matrix, --step, --fsdp, --tp "
                         "and --sp")  # fmt: skip
    if timeline and device is not None and device.strip().lower() == "cuda":
        raise InputError("--timeline lays the step measured on meta (or, for an autocast stack, on CPU tensors) over "
                         "the prediction; CUDA is measured by its allocator's counters: --device meta")  # fmt: skip
    for path, suffix, flag in images:
        check_image(path, suffix)
        pyplot(flag)
    return [(path, flag) for path, _, flag in images]


def draw_timeline(results, images: list, units: str) -> None:
    """The measured step drawn dashed over the predicted one, into each image asked for."""
    if not images:
        return
    from memcalc.report.timeline import measured_series, series_of
    from memcalc.report.timeline_plot import save_timeline

    overlay = results[0].timeline
    if overlay is None:  # the run ended early (its error says why)
        return
    p, m = overlay.predicted, overlay.measured
    for path, flag in images:
        save_timeline([series_of(p, "predicted"), measured_series(m)], path, units,
                      title=f"{results[0].model}, {p.tricks.label}: measured on {m.device} over the prediction",
                      flag=flag, dashed=(1,), marks=[[], list(overlay.measured_marks)])  # fmt: skip
        print(f"wrote {path}", file=sys.stderr)


def export_timeline(results, exports: dict[str, str]) -> None:
    """--snapshot and --trace: the predicted step (the measurement is live bytes, not an allocator's)."""
    overlay = results[0].timeline if exports else None
    if overlay is not None:  # None: the run ended early (its error says why)
        from .views import write_exports

        write_exports([overlay.predicted], exports)


def saver(folder: str, dist: bool = False):
    """on_result for --save: each run's JSON in folder/NN-<tricks>.json (dist: a distributed check's)."""
    from pathlib import Path

    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot make {folder}: {e.strerror}") from None

    count = [0]

    def save(result) -> None:
        from memcalc.verification.results import to_dict

        count[0] += 1  # numbered, so that the files sort in the order the runs ran
        data = result if dist else to_dict(result)
        label = result.tricks.label if dist else result.tricks
        (path / f"{count[0]:02d}-{label}.json").write_text(render.to_json(data) + "\n")

    return save


def custom_run(model, setup, tricks, spec: str, device: str | None):
    """--step FILE:FUNCTION: the user's step measured (verify/custom.py), and, given a model, the stack's
    prediction for that shape beside it. model None: measured only."""
    from memcalc.exact.base.config import not_replayed

    dev = "meta" if device is None else device.strip().lower()
    if dev not in ("meta", "cpu"):
        raise InputError(f"--step measures on meta or cpu (every storage counted by its op), not {dev}")
    stack = setup.stack
    gap = "" if model is None else not_replayed(stack.model, stack.recipe, stack.impl, setup.optimizer, tricks.precision)
    if model is None:
        gap = "no model given: add --model, --params or --config for memcalc's prediction beside the measurement"

    def run():
        from verify.custom import TORCH_VERSION, load, measure_user_step

        measured, n_params = measure_user_step(load(spec), setup.seq_len, setup.micro_batch, dev)
        predicted = None
        if not gap:
            from memcalc.exact.step import exact_step

            predicted = exact_step(model.shape, setup.seq_len, setup.micro_batch, tricks, 1, stack, setup.optimizer)
        return custom_result(spec, model, setup, tricks, dev, TORCH_VERSION, measured, n_params, predicted, gap)

    return run


def custom_result(spec, model, setup, tricks, device, torch_version, measured, n_params, predicted, gap):
    from memcalc.verification.results import CustomResult, Row

    p = predicted.phases if predicted else None
    saved = predicted.activations.total_bytes if predicted else None
    pairs = [
        ("live between steps", p and p.state_bytes + p.inputs_bytes, measured.state_bytes),  # the user's keeps its inputs
        ("saved for backward", saved, measured.saved_bytes),
        ("kept after forward", p and p.retained_bytes, measured.retained_bytes),
        ("forward peak", p and p.forward_peak_bytes, measured.forward_peak_bytes),
        ("backward peak", p and p.backward_peak_bytes, measured.backward_peak_bytes),
        ("optimizer-step peak", p and p.optimizer_peak_bytes, measured.optimizer_peak_bytes),
        ("whole-step peak", p and p.step_peak_bytes, measured.step_peak_bytes),
    ]
    rows = (Row("parameters", "count", None, model and model.n_params, n_params),) + tuple(
        Row(q, "bytes", None, predicted_bytes, got) for q, predicted_bytes, got in pairs)  # fmt: skip
    peaks = (measured.forward_peak_at, measured.backward_peak_at, measured.optimizer_peak_at)
    return CustomResult(spec, "" if model is None else model.origin, setup.stack.label, tricks.label, device,
                        torch_version, setup.seq_len, setup.micro_batch, rows, peaks, measured.saved_by_op, gap)  # fmt: skip


def dist_run(model, setup, tricks, fsdp, tp, sp: bool, device: str, matrix: bool = False, save: str | None = None,
             reshard: bool | None = None):  # fmt: skip
    """--fsdp/--tp: one rank of a (dp x tp) job on PyTorch's FSDP2 and DTensor, checked before torch loads;
    --matrix: every trick set the check runs, --save: each one's JSON as soon as it is measured."""
    from memcalc.memory.state import MAX_GPUS
    from memcalc.model.layout import Layout
    from memcalc.model.shape import parse_count
    from memcalc.verification.distributed import check_dist, dist_matrix

    if model is not None and (model.shape.is_moe or model.shape.is_mla or model.shape.mtp_layers):
        raise InputError("--fsdp/--tp check a dense model's shards; mixture-of-experts, latent-attention and MTP "
                         "models are checked on one GPU (memcalc verify --device meta)")  # fmt: skip
    dp = 1 if fsdp is None else parse_count(fsdp, "fsdp", MAX_GPUS)
    if reshard is not None and setup.stack.engine != "fsdp2":
        raise InputError("--reshard/--no-reshard choose torchtitan's reshard_after_forward: add --stack fsdp2")
    layout = Layout(tp=1 if tp is None else parse_count(tp, "tp", MAX_GPUS), dp=dp, zero=3 if dp > 1 else 0, sp=sp,
                    reshard_after_forward=reshard)  # fmt: skip
    dev = device.strip().lower()
    if matrix:
        dist_matrix(model.shape, setup, layout, dev)
    else:
        check_dist(model.shape, setup, tricks, layout, dev)
    on_result = None if save is None else saver(save, dist=True)

    def run():
        from verify.distributed import verify_distributed, verify_distributed_matrix

        if matrix:
            return verify_distributed_matrix(model, setup, layout, dev, on_result)
        return verify_distributed(model, setup, tricks, layout, dev)

    return run


def pipeline_run(model, setup, tricks, fsdp, tp, sp: bool, pp, stage, grad_accum, device: str, matrix: bool,
                 reshard: bool | None):  # fmt: skip
    """--fsdp D --pp P --stack fsdp2: one rank of stage K (--stage; default: the stage estimate reports as the
    layout's peak) over m micro-batches (--grad-accum, default P), checked before torch loads."""
    from dataclasses import replace

    from memcalc.memory.state import MAX_GPUS
    from memcalc.model.layout import Layout
    from memcalc.model.shape import parse_count
    from memcalc.verification.pipeline import check_pipeline, peak_stage

    if pp is None:
        raise InputError("--stage/--grad-accum choose a pipeline stage's check: add --pp P")
    if matrix:
        raise InputError("--matrix is not run with --pp: check one trick set per run")
    if device.strip().lower() != "meta":
        raise InputError("--pp is checked on the fake process group: --dist-device meta")
    p = parse_count(pp, "pp", MAX_GPUS)
    if p < 2:
        raise InputError("--pp checks a pipeline: give P > 1 stages")
    if tp is not None or sp:
        raise InputError("the FSDP + PP check runs tp 1 and cp 1: drop --tp/--sp")
    dp = 1 if fsdp is None else parse_count(fsdp, "fsdp", MAX_GPUS)
    m = p if grad_accum is None else parse_count(grad_accum, "grad-accum", 1 << 16)
    layout = Layout(dp=dp, pp=p, zero=3 if dp > 1 else 0, reshard_after_forward=reshard)
    setup = replace(setup, grad_accum=m)
    check_pipeline(model.shape, setup, tricks, layout, 0)
    k = peak_stage(model.shape, setup, tricks, layout) if stage is None else parse_stage(stage, p)

    def run():
        from verify.distributed import verify_pipeline

        return verify_pipeline(model, setup, tricks, layout, k)

    return run


def parse_stage(text: str, pp: int) -> int:
    from memcalc.model.jsonfile import brief

    try:
        k = int(text.strip())
    except ValueError:
        k = -1
    if not 0 <= k < pp:
        raise InputError(f"--stage must be a whole number in [0, {pp}), got {brief(text)}")
    return k


def overlay_lines(r, d: render.Display) -> list[str]:
    """--timeline in the text formats: the prediction's chart over the measurement's, × where they differ."""
    if r.timeline is None or d.fmt not in ("table", "markdown"):
        return []
    from memcalc.report.timeline import chart_lines, measured_series, series_of

    o = r.timeline
    lines = chart_lines([series_of(o.predicted, "predicted"), measured_series(o.measured)], d.units,
                        marks=[[], list(o.measured_marks)])  # fmt: skip
    verdict = o.first_difference or f"all {o.coinciding:,} events coincide: the same op, bytes and live bytes"
    head = ["", f"The step event by event, predicted and measured on {o.measured.device}: {verdict}"]
    return head + (["```text", *lines, "```"] if d.fmt == "markdown" else lines)


class progress_bar:
    """A rich progress bar fed by verify's progress(what, done, total) calls; a no-op when off."""

    def __init__(self, on: bool) -> None:
        self.on, self.bar, self.task = on, None, None

    def __enter__(self):
        if not self.on:
            return None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("verify", total=1)
        return self.update

    def update(self, what: str, done: int, total: int) -> None:
        self.bar.update(self.task, description=what, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def show_verify(results, d: render.Display) -> bool:
    """One result's rows, the matrix summary, or the distributed table; whether every row passed."""
    from memcalc.report import verify as vr
    from memcalc.verification.results import CustomResult, to_dict

    if isinstance(results, CustomResult):
        render.emit(d.fmt, to_dict(results), vr.custom_sections(results, d.units, d.detail), vr.custom_preamble(results),
                    (vr.CSV_HEADERS, vr.csv_rows([results])), exact=d.exact, after=[vr.custom_verdict(results, d.units)])  # fmt: skip
        return True
    from memcalc.verification.distributed import TABLE_HEADERS, DistResult

    if isinstance(results, list) and results and isinstance(results[0], DistResult):
        rows = [[r.tricks.label, *row] for r in results for row in r.table()]
        render.emit(d.fmt, results, vr.dist_matrix_sections(results), vr.dist_preamble(results[0], matrix=True),
                    (["tricks", *TABLE_HEADERS], rows), exact=d.exact, after=[vr.dist_matrix_verdict(results)])  # fmt: skip
        return all(r.passed for r in results)
    if isinstance(results, list) and len(results) == 1:
        r = results[0]
        render.emit(d.fmt, to_dict(r), vr.verify_sections(r, d.units, d.detail), vr.verify_preamble(r) + overlay_lines(r, d),
                    (vr.CSV_HEADERS, vr.csv_rows(results)), exact=d.exact, after=[vr.verify_verdict(results)])  # fmt: skip
        passed = r.passed
    elif isinstance(results, list):
        render.emit(d.fmt, [to_dict(r) for r in results], vr.matrix_sections(results, d.units),
                    csv_table=(vr.CSV_HEADERS, vr.csv_rows(results)), exact=d.exact, after=[vr.verify_verdict(results)])  # fmt: skip
        passed = all(r.passed for r in results)
    else:
        if os.environ.get("RANK", "0") != "0":  # torchrun: every rank holds the whole result; rank 0 prints
            return results.passed
        render.emit(d.fmt, results, vr.dist_sections(results), vr.dist_preamble(results),
                    (TABLE_HEADERS, results.table()), exact=d.exact, after=[vr.dist_verdict(results)])  # fmt: skip
        passed = results.passed
    return passed
