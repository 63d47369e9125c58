"""Turn what the user typed into engine inputs beside the option groups (memcalc.cli.groups: the model, the stack,
the step, the layout, the card): the trick sets, the time model, the run; and the output's format and units,
and the one line a refusal or a warning is. One InputError line for each thing that cannot be."""

from __future__ import annotations

import sys
from dataclasses import replace

import typer

from memcalc.errors import InputError
from memcalc.model.sizes import parse_positive
from memcalc.model.tricks import PROGRESSION, Tricks, parse_tricks, trick_warnings
from memcalc.report import render


def resolve_tricks(texts: list[str] | None, gpu=None, default: str | None = None) -> tuple[tuple[Tricks, ...], list[str]]:
    """Each --tricks picks one combination (repeated: several, in the order given, each once); without it,
    the command's default (None: estimate's progression fp32 -> ... -> bf16+selective), fp16 in place of
    bf16 on a card without bf16 tensor cores (V100, T4; a bf16 named there is refused: check_precision),
    without fp32 on a card whose --gpu file gives no fp32 rate. With what every command says on stderr once
    its input is good (warn): what the card's file left out (GPU.derived), that switch, and
    memcalc.model.tricks.trick_warnings."""
    said = [f"{gpu.key} ({gpu.name}): {gpu.derived}"] if gpu is not None and gpu.derived else []
    if texts:
        sets = tuple(dict.fromkeys(parse_tricks(text) for text in texts))
    else:
        sets = (parse_tricks(default),) if default else PROGRESSION
        if gpu is not None:
            sets, switched = default_on(gpu, sets)
            said += switched
    return sets, said + [w for t in sets for w in trick_warnings(t)]


def default_on(gpu, sets: tuple[Tricks, ...]) -> tuple[tuple[Tricks, ...], list[str]]:
    """A default's trick sets as the card runs them: fp16 in place of bf16 where it has no bf16 tensor cores,
    and only those it has a peak for (a --gpu file may give no fp32 or fp16 rate; with none left, the sets as
    they were, for check_precision to refuse in one line). With the switch said."""
    from memcalc.model.gpus import half_precision

    said, half = [], half_precision(gpu)
    if half != "bf16" and gpu.peak_flops(half) and any(t.precision == "bf16" for t in sets):
        sets = tuple(replace(t, precision=half) if t.precision == "bf16" else t for t in sets)
        said.append(f"the {gpu.name} has no bf16 tensor cores (Volta, Turing): fp16 in place of bf16 in the default "
                    "tricks; --tricks names others")  # fmt: skip
    return tuple(t for t in sets if gpu.peak_flops(t.precision)) or sets, said


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def warn(lines) -> None:
    """What the user should know beside the answer, each line once on stderr (stdout stays the answer)."""
    for line in dict.fromkeys(lines):
        print(f"warning: {line}", file=sys.stderr)


def check_format(fmt: str) -> str:
    key = fmt.strip().lower()
    if key not in render.FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose {', '.join(render.FORMATS)}")
    return key


def parse_run(tokens: str | None, price: str | None) -> tuple[int, float | None] | None:
    """--tokens N [--price-per-gpu-hour X]: the length (and price) of the whole run, or None."""
    from memcalc.model.shape import parse_count
    from memcalc.time.training_run import MAX_TOKENS

    if tokens is None:
        if price is not None:
            raise InputError("--price-per-gpu-hour needs --tokens (the length of the run)")
        return None
    return parse_count(tokens, "tokens", MAX_TOKENS), None if price is None else parse_positive(price, "price-per-gpu-hour")


def roofline_calibration(gpu, spec: str | None):
    """--calibration SPEC: a JSON file, NAME=X overrides, or both (file first), comma-separated. A card whose
    --gpu file leaves out a rate the roofline needs is timed end to end at the default MFU instead (as plan
    times a shape it cannot trace), its GPU.derived saying so."""
    from memcalc.memory.setup import DEFAULT_MFU
    from memcalc.model.gpus import roofline_gaps
    from memcalc.time.calibration import calibration_for

    gaps = roofline_gaps(gpu)
    if gaps and spec:
        raise InputError(f"--calibration tunes the roofline, which needs the card's {' and '.join(gaps)}: its --gpu "
                         "file does not give them; add them to the file, or drop --calibration")  # fmt: skip
    if gaps:
        return DEFAULT_MFU

    items = [x.strip() for x in (spec or "").split(",") if x.strip()]
    paths, overrides = [x for x in items if "=" not in x], [x for x in items if "=" in x]
    if len(paths) > 1:
        raise InputError(f"--calibration takes one file, got {', '.join(paths)}")
    return calibration_for(gpu.key, paths[0] if paths else None, ",".join(overrides) or None)


def render_units(units: str) -> str:
    from memcalc.report.units import check_units

    return check_units(units)


def with_file(ctx, options: dict, command: str, listed: tuple[str, ...] = ()):
    """--from FILE: the command's options with the file's merged under those typed, and what it read (None
    without --from)."""
    if options.get("from_file") is None:
        return options, None
    from .fromfile import apply_file, typed_names

    return apply_file(options, typed_names(ctx, options), command, listed)


def explained(message: str, source) -> str:
    """A refusal; with --from, the file's keys behind each option it names that the file set."""
    if source is None:
        return message
    from .fromfile import blame

    return blame(message, source)


def show_file(source, fmt: str) -> dict | None:
    """What --from read, before the answer: its table on stdout (CSV: on stderr, the answer's rows alone on
    stdout), the keys the verdict leaves out as warnings; the JSON of it, for the answer's "from"."""
    if source is None:
        return None
    from memcalc.report.from_file import from_file_json, from_file_section

    section = from_file_section(source)
    if fmt == "markdown":
        sys.stdout.write(render.to_markdown([section]) + "\n")
    elif fmt in ("table", "csv"):
        render.print_tables([section], file=sys.stdout if fmt == "table" else sys.stderr)
        if fmt == "table":
            print()
    warn(f"{source.path}: not modelled, so not in the verdict: {line}" for line in source.unmodelled())
    return from_file_json(source)
