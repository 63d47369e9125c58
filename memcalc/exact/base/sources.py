"""The code a replayed result depends on: every module of memcalc that memcalc.exact imports, at any depth.

Found by reading import statements, never by importing: a regular expression over each file's text (some
0.1 ms a file), relative imports resolved, a package's __init__ counted with each module under it. An
import inside a function counts like one at the top (the replay imports some of its modules lazily), and
so does one under `if TYPE_CHECKING:`, which only adds a file to watch. memcalc.exact.base.cache keys its
results on these files' sizes and modification times.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # memcalc/
ROOT = PACKAGE / "exact"  # the replay: every module under it, for it imports them all, some lazily
IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)|import[ \t]+([^\n]*))",
                    re.M)  # fmt: skip


def module_file(dotted: str) -> Path | None:
    """The file of memcalc's module `dotted` (memcalc.a.b: memcalc/a/b.py or memcalc/a/b/__init__.py), or None
    where it names something else (a class, a function, another package)."""
    parts = dotted.split(".")
    if parts[0] != "memcalc":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def package_of(path: Path) -> str:
    """The dotted package a file's relative imports start from: its folder's."""
    return ".".join(("memcalc", *path.parent.relative_to(PACKAGE).parts))


def names(text: str) -> list[str]:
    """The names of one import's list: 'a, b as c' or '(a,\\n b)', comments and aliases dropped."""
    text = re.sub(r"#[^\n]*", "", text).strip("() \t\n")
    return [n.split(" as ")[0].strip() for n in text.split(",") if n.strip()]


def imported(path: Path) -> set[Path]:
    """The files of memcalc's modules that the file at `path` imports, with their packages' __init__ files."""
    package = package_of(path)
    dotted: list[str] = []
    for dots, module, listed, plain in IMPORT.findall(path.read_text()):
        if plain:
            dotted += names(plain)
            continue
        if dots:
            base = package.split(".")
            base = base[: len(base) - len(dots) + 1]
            module = ".".join(base + ([module] if module else []))
        dotted += [module] + [f"{module}.{name}" for name in names(listed)]
    found = set()
    for name in dotted:
        parts = name.split(".")
        for n in range(1, len(parts) + 1):  # memcalc.a.b runs memcalc/__init__, memcalc/a/__init__, then b
            file = module_file(".".join(parts[:n]))
            if file is not None:
                found.add(file)
    return found


def dependencies() -> list[Path]:
    """Every file the replay's modules import, at any depth, theirs included; sorted."""
    todo = sorted(ROOT.rglob("*.py"))
    seen = set(todo)
    while todo:
        for file in imported(todo.pop()):
            if file not in seen:
                seen.add(file)
                todo.append(file)
    return sorted(seen)
