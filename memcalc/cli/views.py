"""How `memcalc estimate` prints an answer: the engine answers the job (memcalc.engine), a view renders it
in a Display (format, units, how much). No arithmetic here."""

import sys

from memcalc.report import render

from .inputs import warn


def answer_view(job):
    """The job's answer, computed now (bad input fails before anything prints), printed by the returned
    function."""
    from memcalc.engine.answer import answer

    ans = answer(job)
    return lambda display: (show_answer if job.data_parallel else show_layout)(ans, display)


def sweep_view(job, spec: str, png: str | None):
    from memcalc.engine.sweep import parse_sweep, sweep
    from memcalc.errors import InputError
    from memcalc.report.plot import check_image

    if not job.data_parallel:
        raise InputError("--sweep works on a data-parallel job (--gpus, --zero, --offload); drop --tp, --pp, --cp, --ep")
    points = parse_sweep(spec)
    png = None if png is None else check_image(png, ".png")  # before the work: a bad path is an input error
    swept = sweep(job.model, job.setup, job.gpu, job.trick_sets, *points, job.time_model, job.layout)
    return lambda display: show_sweep(swept, display, png)


def timeline_view(job, png: str | None, svg: str | None, exports: dict[str, str]):
    """--timeline: the job's answer with each trick set's step recorded; the image paths checked, and
    matplotlib found, before the work; exports: --snapshot's and --trace's paths (export_paths)."""
    from memcalc.engine.answer import answer
    from memcalc.report.plot import check_image, pyplot

    asked = ((png, ".png", "--png"), (svg, ".svg", "--svg"))
    images = [(check_image(path, suffix), flag) for path, suffix, flag in asked if path is not None]
    for _, flag in images:
        pyplot(flag)
    ans = answer(job)
    return lambda display: show_timeline(ans, display, images, exports)


EXPORTS = {"--snapshot": (".pickle", "a pickle file (PyTorch's memory snapshot)"),
           "--trace": (".json", "a JSON file (a trace for ui.perfetto.dev)")}  # fmt: skip


def export_paths(timeline: bool, snapshot: str | None, trace: str | None) -> dict[str, str]:
    """--snapshot's and --trace's paths by flag, checked before the work; refused without --timeline."""
    from memcalc.errors import InputError
    from memcalc.report.files import check_path

    asked = {flag: path for flag, path in (("--snapshot", snapshot), ("--trace", trace)) if path is not None}
    if asked and not timeline:
        raise InputError(f"{next(iter(asked))} exports the step's timeline: add --timeline")
    for flag, path in asked.items():
        suffix, kind = EXPORTS[flag]
        check_path(path, suffix, flag, kind)
    return asked


def write_exports(timelines, exports: dict[str, str]) -> None:
    """The timelines as PyTorch's memory snapshot (--snapshot) and as a trace (--trace), the caching
    allocator replayed once for both."""
    if not exports:
        return
    from memcalc.report.files import write_file
    from memcalc.report.snapshot import dumps, snapshot_bytes
    from memcalc.report.trace_events import trace_text

    dumped = dumps(timelines)
    for flag, path in exports.items():
        data = snapshot_bytes(timelines, dumped) if flag == "--snapshot" else trace_text(timelines, dumped).encode()
        write_file(path, data)
        print(f"wrote {path}", file=sys.stderr)  # stderr: stdout stays the chart, JSON or CSV


def show_timeline(ans, d: render.Display, images: list, exports: dict[str, str]) -> None:
    """The chart of each trick set's step on one axis, what is live at each peak, the verdict; or the JSON
    (the answer's, its timelines under `timeline`), or every allocation as CSV; the exports written first."""
    from memcalc.report import answer as report
    from memcalc.report import timeline as chart

    tls = ans.timelines
    write_exports(tls, exports)
    for path, flag in images:
        from memcalc.report.timeline_plot import save_timeline

        title = f"{ans.job.model.shape.name or 'the model'}, seq {ans.job.setup.seq_len:,}: live memory over one step"
        save_timeline([chart.series_of(t) for t in tls], path, d.units, ans.verdicts[0].usable_bytes, ans.job.gpu.key,
                      title, flag)  # fmt: skip
        print(f"wrote {path}", file=sys.stderr)  # stderr: stdout stays the chart, JSON or CSV
    if d.fmt == "json":
        return emit_json(ans, d)
    if d.fmt == "csv":
        sys.stdout.write(render.to_csv(chart.CSV_HEADERS, chart.csv_rows(tls)))
        return
    lines = chart.chart_lines([chart.series_of(t) for t in tls], d.units)
    top = len(max((t.at_peak for t in tls), key=len)) if d.detail else chart.TOP_GROUPS
    sections = [chart.at_peak_section(t, d.units, top) for t in tls]
    preamble = report.preamble(ans, d.units, d.detail) + ["", "Live memory over the step, event by event "
                                                          "(each allocation, the frees between two as one; the replay's), from the model state up"]  # fmt: skip
    if tls and tls[0].micro_batches < tls[0].accumulated:
        preamble.append(f"(the first {tls[0].micro_batches} of its {tls[0].accumulated:,} micro-batches: each later "
                        "one starts where the third did and repeats it)")  # fmt: skip
    if d.fmt == "markdown":
        preamble += ["", "```text", *lines, "```"]
    else:
        preamble += lines
    render.emit(d.fmt, None, sections, preamble, exact=d.exact, after=[report.verdict(ans, d.units)])


def show_sweep(swept, d: render.Display, png: str | None = None) -> None:
    from memcalc.report import sweep as report

    if png is not None:
        from memcalc.report.plot import save_png

        save_png(swept, png, d.units)
        print(f"wrote {png}", file=sys.stderr)  # stderr: stdout stays the table, JSON or CSV
    csv_table = (report.SWEEP_CSV_HEADERS, report.sweep_csv_rows(swept))
    render.emit(d.fmt, swept, report.sweep_sections(swept, d.units), csv_table=csv_table, exact=d.exact, source=d.source)


def emit_json(ans, d: render.Display) -> None:
    from memcalc.report.schema import answer_json

    print(render.to_json(answer_json(ans), d.source))


def show_layout(ans, d: render.Display) -> None:
    """A job with tensor, pipeline, context or expert parallel: its stages, traffic and time."""
    from memcalc.report import layout as report

    ests = list(ans.layouts)
    warn(w for e in ests for w in report.layout_warnings(e))
    if d.fmt == "json":
        return emit_json(ans, d)
    if d.fmt == "csv":
        rows = [[e.tricks.label, *row] for e in ests for row in report.layout_csv_rows(e)]
        sys.stdout.write(render.to_csv(["tricks", *report.LAYOUT_CSV_HEADERS], rows))
        return
    one = ests[0] if len(ests) == 1 else None
    sections = report.layout_sections(one, d.units, d.detail) if one else [report.tricks_section(ests, d.units)]
    sections += [report_runs(ans)] if ans.runs else []
    sections += [report.exact_layer_section(ests, list(ans.exact), d.units)] if ans.exact else []
    render.emit(d.fmt, None, sections, report.layout_preamble(ests, d.units), exact=d.exact,
                after=[report.layout_verdict(ests, d.units)])  # fmt: skip
    if d.explain:
        for e in ests:
            render.print_lines(["", f"== {e.tricks.label} =="] + report.layout_explain_lines(e))


def report_runs(ans):
    from memcalc.report.estimate import runs_section

    return runs_section(ans.runs)


def show_answer(ans, d: render.Display) -> None:
    """A data-parallel job: the verdict per trick set with the whole-model textbook beside it."""
    from memcalc.report import answer as report
    from memcalc.report import estimate as textbook
    from memcalc.report import explain
    from memcalc.report.layout import layout_warnings

    est = ans.textbook
    lines = [w for e in ans.layouts for w in layout_warnings(e)]
    if ans.roofline is not None:
        from memcalc.report.roofline import time_warnings

        lines += time_warnings(ans.roofline)
    warn(lines)
    if d.fmt == "json":
        return emit_json(ans, d)
    sections = report.sections(ans, d.units, d.detail)
    sections += [report_runs(ans)] if ans.runs else []
    if ans.exact:
        peaks = [v.total_bytes for v in ans.verdicts]
        sections.insert(1, textbook.exact_section(est, list(ans.exact), d.units, peaks))
    csv_rows = report.csv_rows(ans) if d.fmt == "csv" else []
    render.emit(d.fmt, None, sections, report.preamble(ans, d.units, d.detail), (report.CSV_HEADERS, csv_rows),
                exact=d.exact, after=[report.verdict(ans, d.units)])  # fmt: skip
    if d.explain and d.fmt in ("table", "markdown"):
        lines = explain.explain_lines(est, ans.roofline is None and ans.job.layout.world == 1)
        if ans.roofline is not None:
            from memcalc.report.roofline import explain_lines

            lines += explain_lines(ans.roofline, ans.layouts[0].time.calibration)
        if ans.exact:
            lines += explain.exact_explain_lines(est, list(ans.exact))
        render.print_lines([""] + lines)
