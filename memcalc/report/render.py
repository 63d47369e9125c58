"""Result objects -> tables (rich, Markdown), CSV and JSON. The engine never formats; this does."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import textwrap
from dataclasses import field, fields, is_dataclass

from memcalc.model.tricks import Tricks
from memcalc.records import record
from memcalc.terms import Term

from . import units as u

FORMATS = ("table", "json", "markdown", "csv")

# A cell is plain text, or (main, detail): the detail is printed dim under the main text.
Cell = str | tuple[str, str]


@record(frozen=True)
class Display:
    """How a result is shown: the format, the units, and how much of it."""

    fmt: str = "table"
    units: str = "gb"
    detail: bool = False  # every section, not only the answer
    exact: bool = False  # each value's exact count (bytes) under it; --detail implies it
    explain: bool = False  # the formulas with this config's numbers
    source: dict | None = None  # --from FILE: what its keys set (memcalc.report.from_file), in JSON under "from"


@record
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
    """Dataclasses as dicts of their fields (but those marked metadata={"json": False}: what only an export
    reads) and properties (totals are properties), recursively."""
    if isinstance(obj, Tricks):
        return obj.names
    if isinstance(obj, Term):
        return {"name": obj.name, "value": obj.value, "formula": obj.symbolic(), "source": obj.source}
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj) if f.metadata.get("json", True)}
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


def to_json(obj: object, source: dict | None = None) -> str:
    """obj as JSON; with source (what --from read), that under "from" at the end of obj's object."""
    data = to_jsonable(obj)
    if source is not None and isinstance(data, dict):
        data = {**data, "from": source}
    return json.dumps(data, indent=2, ensure_ascii=False)


# ---- text formats ---------------------------------------------------------------------------


def cell_text(cell: Cell, sep: str = " ", exact: bool = True) -> str:
    """A cell as one string: its exact count in brackets when exact, else its main text alone."""
    if isinstance(cell, str):
        return cell
    return f"{cell[0]}{sep}({cell[1]})" if exact else cell[0]


def to_markdown(sections: list[Section], preamble: list[str] = (), exact: bool = False, after: list[str] = ()) -> str:
    lines = [f"{line}  " for line in preamble]
    for s in sections:
        lines += ["", f"### {s.title}", "", "| " + " | ".join(s.headers) + " |"]
        lines.append("|" + "|".join("---" for _ in s.headers) + "|")
        lines += ["| " + " | ".join(cell_text(c, exact=exact).replace("|", "\\|") for c in row) + " |"
                  for row in s.rows]  # fmt: skip
        if s.notes:
            lines.append("")
            lines += [f"- {n}" for n in s.notes]
    lines += ["", *after] if after else []
    return "\n".join(lines).lstrip("\n") + "\n"


def to_csv(headers: list[str], rows: list[list[object]]) -> str:
    import csv  # here: only --format csv writes it

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(headers)
    writer.writerows(rows)
    return out.getvalue()


def emit(fmt: str, result: object, sections: list[Section], preamble: list[str] = (),
         csv_table: tuple[list[str], list[list[object]]] | None = None, exact: bool = False,
         after: list[str] = (), source: dict | None = None) -> None:  # fmt: skip
    """One result in the chosen format: JSON of the object itself, CSV rows, or its tables.

    exact: tables and Markdown show each value's exact count (bytes) too; JSON and CSV always carry it.
    after: paragraphs printed after the tables (the verdict), in the text formats.
    source: what --from read, under "from" in the JSON (the text formats show it before: memcalc.cli.views).
    """
    if fmt == "json":
        print(to_json(result, source))
    elif fmt == "csv":
        sys.stdout.write(to_csv(*(csv_table or first_table(sections))))
    elif fmt == "markdown":
        sys.stdout.write(to_markdown(sections, preamble, exact, after))
    else:
        print_tables(sections, preamble, exact=exact, after=after)


def first_table(sections: list[Section]) -> tuple[list[str], list[list[str]]]:
    return sections[0].headers, [[cell_text(c) for c in row] for row in sections[0].rows]


def width() -> int:
    """Columns to lay out in: $COLUMNS, else the terminal's, else 100 (piped output, files, docs)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return 100


def print_tables(sections: list[Section], preamble: list[str] = (), file: io.TextIOBase | None = None,
                 exact: bool = False, after: list[str] = (), cols: int | None = None) -> None:  # fmt: skip
    """Plain aligned tables: first column left, numbers right, a cell's exact count dim on the line under
    it when exact; notes and long lines wrap, and columns wrap their text, to fit the width.

    Written out by hand rather than with rich.Table: laying out six tables through rich costs ~25 ms,
    more than the whole estimate, and `memcalc estimate` must start as fast as typer itself.
    """
    out, cols = file or sys.stdout, cols or width()
    style = Style(color_enabled(out))
    lines = [w for line in preamble for w in wrap(line, cols, "", "  ")]
    for s in sections:
        notes = [style.dim(w) for n in s.notes for w in wrap(n, cols, "  ", "    ")]
        lines += ["", *(style.bold(w) for w in wrap(s.title, cols))] + table_lines(s, style, exact, cols) + notes
    for paragraph in after:
        lines += ["", *(style.bold(w) for w in wrap(paragraph, cols))]
    out.write("\n".join(lines).lstrip("\n") + "\n")


def print_lines(lines: list[str]) -> None:
    """Lines of prose (--explain), each wrapped to the width under its own indent."""
    cols = width()
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()))
        print("\n".join(wrap(line.strip(), cols, indent, indent + "    ")))


def wrap(text: str, cols: int, first: str = "", rest: str = "") -> list[str]:
    """text in lines of at most cols characters (a word longer than a line keeps its own line)."""
    if not text:
        return [first.rstrip()]
    return textwrap.wrap(text, cols, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False) or [first.rstrip()]  # fmt: skip


def table_lines(s: Section, style: Style, exact: bool = False, cols: int = 10**6) -> list[str]:
    """The table in lines: columns as wide as their widest cell, narrowed (their text wrapped) to fit cols."""
    mains = [[c if isinstance(c, str) else c[0] for c in row] for row in s.rows]
    details = [["" if isinstance(c, str) or not exact else c[1] for c in row] for row in s.rows]
    align = s.align or "l" + "r" * (len(s.headers) - 1)
    widths = fit_widths([list(column) for column in zip(s.headers, *mains, *details)], align, cols - 1)

    def lines(cells: list[str]) -> list[str]:
        """One row, over as many lines as its tallest wrapped cell."""
        wrapped = [[c] if len(c) <= w else wrap(c, w) for c, w in zip(cells, widths)]
        out = []
        for i in range(max(len(w) for w in wrapped)):
            parts = [w[i] if i < len(w) else "" for w in wrapped]
            padded = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(parts, widths, align)]
            out.append(" " + "  ".join(padded).rstrip())
        return out

    out = [style.bold(x) for x in lines(s.headers)] + [" " + "  ".join("-" * w for w in widths)]  # ASCII: 1 byte a column
    for main, detail in zip(mains, details):
        out += lines(main)
        if any(detail):
            out += [style.dim(x) for x in lines(detail)]
    return out


def fit_widths(columns: list[list[str]], align: str, cols: int) -> list[int]:
    """Each column's width: its widest cell, then the widest columns narrowed one character at a time
    until the row, with two spaces between columns, fits cols. A text column (left-aligned) wraps its
    cells at spaces, down to its longest word; a number column (right-aligned) wraps only its header."""
    widths = [max(len(x) for x in column) for column in columns]
    least = [narrowest(column, a) for column, a in zip(columns, align)]
    while sum(widths) + 2 * (len(widths) - 1) > cols:
        room = [(w, i) for i, (w, m) in enumerate(zip(widths, least)) if w > m]
        if not room:
            break
        widths[max(room)[1]] -= 1
    return widths


def narrowest(column: list[str], align: str) -> int:
    """How narrow a column can wrap: its longest word (headers always wrap; numbers' cells never do)."""
    header, cells = column[0], column[1:]
    words = header.split() + ([w for x in cells for w in x.split()] if align == "l" else [])
    return max([len(w) for w in words] + ([len(x) for x in cells] if align == "r" else []), default=0)


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
