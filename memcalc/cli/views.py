"""What `memcalc estimate` computes and prints in each of its modes: one GPU, a layout, a sweep.

commands.py parses the options; a view calls the engine and returns the function that prints the result
in a Display (format, units, how much).
"""

import sys

from memcalc.errors import InputError
from memcalc.report import render


def single_view(model, setup, gpu, trick_sets, run, exact: bool = False, cal=None):
    """One GPU (data-parallel over --gpus): the estimate, its roofline step time (cal None: --mfu's),
    its toolbox, and the run if --tokens."""
    from memcalc.memory.estimate import estimate as run_estimate
    from memcalc.memory.state import Parallel
    from memcalc.memory.toolbox import toolbox, verdict_measure
    from memcalc.time.training_run import runs_for_estimate

    est = run_estimate(model, setup, gpu, trick_sets)
    roofline = None
    if cal is not None:
        from memcalc.time.roofline import step_times

        roofline = step_times(model, setup, gpu, trick_sets, cal), cal
    tb = toolbox(model, setup, gpu, trick_sets[0], verdict_measure(setup, trick_sets[0], model.shape))
    runs = runs_for_estimate(est, *run, roofline[0] if roofline else None) if run else ()
    exacts = exact_steps(model, setup, trick_sets) if exact else None

    def show(display: render.Display) -> None:
        """--detail explains the gap term by term with the exact steps too, where one GPU's step replays."""
        one_gpu = setup.parallel == Parallel() and not est.not_replayed
        steps = exacts or (exact_steps(model, setup, trick_sets) if display.detail and one_gpu else None)
        show_estimate(est, tb, runs, display, steps, roofline)

    return show


def exact_steps(model, setup, trick_sets):
    """--exact: one GPU's step replayed as the stack runs it; several GPUs are refused (a layout shows one
    layer of one GPU: exact_layers), and so is what the simulator does not replay (memcalc.exact.recipes)."""
    from memcalc.exact.step import exact_for

    p = setup.parallel
    if p.gpus > 1 or p.zero or p.offload:
        raise InputError("--exact replays one GPU's step: drop --gpus, --zero and --offload, or give a layout "
                         "(--tp, --dp ...) to see one layer on one GPU of it")  # fmt: skip
    return [exact_for(model, setup, t) for t in trick_sets]


def layout_view(model, setup, gpu, trick_sets, layout, explicit: bool, run, exact: bool = False, timing=None):
    """timing: the roofline's calibration, or --mfu's end-to-end rate (memcalc.parallel.comm.step_time)."""
    from memcalc.time.training_run import runs_for_layouts

    ests = layout_estimates(model, setup, gpu, trick_sets, layout, explicit, timing)
    runs = runs_for_layouts(ests, *run) if run else ()
    layers = exact_layers(model, setup, ests, layout) if exact else None
    return lambda display: show_layout(ests, runs, display, layers)


def exact_layers(model, setup, ests, layout):
    """--exact with a layout: what one layer saves on one TP rank, op by op (memcalc.exact on the shard)."""
    from memcalc.verification.distributed import block_terms

    if layout.cp > 1:
        raise InputError("--exact with --cp: ring attention's saved tensors are not simulated; drop --exact or --cp")
    if model.shape.is_moe or model.shape.is_mla:
        raise InputError("--exact with a layout replays a dense block's TP shard; MoE and latent-attention blocks are "
                         "replayed on one GPU: drop the layout (memcalc estimate --exact)")  # fmt: skip
    return [block_terms(model.shape, setup.seq_len, setup.micro_batch, e.tricks, layout) for e in ests]


def sweep_view(model, setup, gpu, trick_sets, spec: str, png: str | None, cal=None):
    from memcalc.report.plot import check_png
    from memcalc.time.sweep import parse_sweep, sweep

    points = parse_sweep(spec)
    png = None if png is None else check_png(png)  # before the work: a bad path is an input error
    swept = sweep(model, setup, gpu, trick_sets, *points, cal)
    return lambda display: show_sweep(swept, display, png)


def layout_estimates(model, setup, gpu, trick_sets, layout, explicit: bool, timing=None):
    """One estimate per trick set; the progression drops the sets a layout cannot run (CP needs flash)."""
    from memcalc.parallel.plan import layout_estimate

    if not explicit and layout.cp > 1:
        trick_sets = tuple(t for t in trick_sets if t.flash)
    return [layout_estimate(model, setup, gpu, t, layout, timing=timing) for t in trick_sets]


def show_sweep(swept, d: render.Display, png: str | None = None) -> None:
    from memcalc.report import sweep as report

    if png is not None:
        from memcalc.report.plot import save_png

        save_png(swept, png, d.units)
        print(f"wrote {png}", file=sys.stderr)  # stderr: stdout stays the table, JSON or CSV
    csv_table = (report.SWEEP_CSV_HEADERS, report.sweep_csv_rows(swept))
    render.emit(d.fmt, swept, report.sweep_sections(swept, d.units), csv_table=csv_table, exact=d.exact)


def show_layout(ests, runs, d: render.Display, layers=None) -> None:
    from memcalc.report import estimate as report
    from memcalc.report import layout as plan_report

    for warning in dict.fromkeys(w for e in ests for w in plan_report.layout_warnings(e)):
        print(f"warning: {warning}", file=sys.stderr)
    one = ests[0] if len(ests) == 1 else None
    if d.fmt == "json":
        from memcalc.report.schema import layouts_json

        print(render.to_json(layouts_json(ests, runs, layers)))
        return
    if d.fmt == "csv":
        rows = [[e.tricks.label, *row] for e in ests for row in plan_report.layout_csv_rows(e)]
        sys.stdout.write(render.to_csv(["tricks", *plan_report.LAYOUT_CSV_HEADERS], rows))
        return
    sections = plan_report.layout_sections(one, d.units, d.detail) if one else [plan_report.tricks_section(ests, d.units)]
    sections += [report.runs_section(runs)] if runs else []
    sections += [plan_report.exact_layer_section(ests, layers, d.units)] if layers else []
    render.emit(d.fmt, None, sections, plan_report.layout_preamble(ests, d.units), exact=d.exact,
                after=[plan_report.layout_verdict(ests, d.units)])  # fmt: skip
    if d.explain:
        for e in ests:
            render.print_lines(["", f"== {e.tricks.label} =="] + plan_report.layout_explain_lines(e))


def show_estimate(est, tb, runs, d: render.Display, exacts=None, roofline=None) -> None:
    """roofline: (step times, calibration), or None when --mfu times the step."""
    from memcalc.report import estimate as report

    warnings = report.warnings(est)
    if roofline is not None:
        from memcalc.report.roofline import time_warnings

        warnings += time_warnings(roofline[0])
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    sections = report.estimate_sections(est, tb, d.units, roofline, d.detail)
    sections += [report.runs_section(runs)] if runs else []
    if exacts:
        sections.insert(1, report.exact_section(est, exacts, d.units))
    result = None  # JSON only: converting every op of the roofline costs more than the estimate
    if d.fmt == "json":
        from memcalc.report.schema import estimate_json

        result = estimate_json(est, tb, runs, exacts, roofline)
    csv_rows = report.estimate_csv_rows(est, roofline[0] if roofline else None) if d.fmt == "csv" else []
    preamble = report.preamble(est, d.units) if d.detail else report.short_preamble(est, d.units)
    render.emit(d.fmt, result, sections, preamble, (report.CSV_HEADERS, csv_rows), exact=d.exact,
                after=[report.verdict(est, tb, d.units)])  # fmt: skip
    if d.explain and d.fmt in ("table", "markdown"):
        lines = report.explain_lines(est, roofline is None)
        if roofline is not None:
            from memcalc.report.roofline import explain_lines

            lines += explain_lines(*roofline)
        if exacts:
            lines += report.exact_explain_lines(est, exacts)
        render.print_lines([""] + lines)
