"""Result objects -> tables (rich, Markdown), CSV and JSON. The engine never formats; this does."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields, is_dataclass

from memcalc.model.tricks import Tricks
from memcalc.terms import Term

from . import units as u

FORMATS = ("table", "json", "markdown", "csv")

# A cell is plain text, or (main, detail): the detail is printed dim under the main text.
Cell = str | tuple[str, str]


@dataclass
class Section:
    """One titled table with notes under it; every output format is made from these."""

    title: str
    headers: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    align: str = ""  # "l" or "r" per column; default: the first left, the rest (numbers) right


def sized(n: int, units: str) -> Cell:
    """A byte count as '427.6 GB' with the exact bytes underneath."""
    return (u.size(n, units), u.exact_bytes(n))


BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(value: float, scale: float, width: int, mark: float | None = None) -> str:
    """A horizontal bar of value/scale of width cells, in eighths, with '│' at mark (a limit line)."""
    eighths = round(8 * width * min(value, scale) / scale) if scale > 0 else 0
    cells = list("█" * (eighths // 8) + (BLOCKS[eighths % 8] if eighths % 8 else ""))
    cells += [" "] * (width - len(cells))
    if mark is not None and 0 < mark <= scale:
        cells[min(width - 1, int(width * mark / scale))] = "│"
    return "".join(cells).rstrip()


# ---- JSON -----------------------------------------------------------------------------------


def to_jsonable(obj: object) -> object:
    """Dataclasses as dicts of their fields and properties (totals are properties), recursively."""
    if isinstance(obj, Tricks):
        return obj.names
    if isinstance(obj, Term):
        return {"name": obj.name, "value": obj.value, "formula": obj.symbolic(), "source": obj.source}
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
        for name in properties(type(obj)):
            out[name] = to_jsonable(getattr(obj, name))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def properties(cls: type) -> list[str]:
    return [name for klass in reversed(cls.__mro__) for name, v in vars(klass).items() if isinstance(v, property)]


def to_json(obj: object) -> str:
    return json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False)


# ---- text formats ---------------------------------------------------------------------------


def cell_text(cell: Cell, sep: str = " ") -> str:
    return cell if isinstance(cell, str) else f"{cell[0]}{sep}({cell[1]})"


def to_markdown(sections: list[Section], preamble: list[str] = ()) -> str:
    lines = [f"{line}  " for line in preamble]
    for s in sections:
        lines += ["", f"### {s.title}", "", "| " + " | ".join(s.headers) + " |"]
        lines.append("|" + "|".join("---" for _ in s.headers) + "|")
        lines += ["| " + " | ".join(cell_text(c).replace("|", "\\|") for c in row) + " |" for row in s.rows]
        if s.notes:
            lines.append("")
            lines += [f"- {n}" for n in s.notes]
    return "\n".join(lines).lstrip("\n") + "\n"


def to_csv(headers: list[str], rows: list[list[object]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(headers)
    writer.writerows(rows)
    return out.getvalue()


def emit(fmt: str, result: object, sections: list[Section], preamble: list[str] = (),
         csv_table: tuple[list[str], list[list[object]]] | None = None) -> None:  # fmt: skip
    """One result in the chosen format: JSON of the object itself, CSV rows, or its tables."""
    if fmt == "json":
        print(to_json(result))
    elif fmt == "csv":
        sys.stdout.write(to_csv(*(csv_table or first_table(sections))))
    elif fmt == "markdown":
        sys.stdout.write(to_markdown(sections, preamble))
    else:
        print_tables(sections, preamble)


def first_table(sections: list[Section]) -> tuple[list[str], list[list[str]]]:
    return sections[0].headers, [[cell_text(c) for c in row] for row in sections[0].rows]


def print_tables(sections: list[Section], preamble: list[str] = (), file: io.TextIOBase | None = None) -> None:
    """Plain aligned tables: first column left, numbers right, a cell's detail dim on the line under it.

    Written out by hand rather than with rich.Table: laying out six tables through rich costs ~25 ms,
    more than the whole estimate, and `memcalc estimate` must start as fast as typer itself.
    """
    out = file or sys.stdout
    style = Style(color_enabled(out))
    lines = list(preamble)
    for s in sections:
        lines += ["", style.bold(s.title)] + table_lines(s, style) + [style.dim("  " + n) for n in s.notes]
    out.write("\n".join(lines).lstrip("\n") + "\n")


def table_lines(s: Section, style: Style) -> list[str]:
    mains = [[c if isinstance(c, str) else c[0] for c in row] for row in s.rows]
    details = [["" if isinstance(c, str) else c[1] for c in row] for row in s.rows]
    widths = [max(len(x) for x in column) for column in zip(s.headers, *mains, *details)]

    align = s.align or "l" + "r" * (len(widths) - 1)

    def line(cells: list[str]) -> str:
        padded = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)]
        return " " + "  ".join(padded).rstrip()

    out = [style.bold(line(s.headers)), " " + "  ".join("─" * w for w in widths)]
    for main, detail in zip(mains, details):
        out.append(line(main))
        if any(detail):
            out.append(style.dim(line(detail)))
    return out


class Style:
    """Bold and dim as ANSI codes on a terminal; nothing when piped or when NO_COLOR is set."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def bold(self, text: str) -> str:
        return f"\x1b[1m{text}\x1b[0m" if self.enabled else text

    def dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.enabled else text


def color_enabled(out: io.TextIOBase) -> bool:
    return "NO_COLOR" not in os.environ and hasattr(out, "isatty") and out.isatty()
