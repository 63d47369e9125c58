"""What the TOML corpora of published measurements (benchmarks/finetune/, benchmarks/rl/) share: one file per source,
a [source] table and [[run]] records, each field checked against its spec, the folder loaded, the summary printed.
Each corpus says its own fields and rules; this reads the files. Standard library only (tomllib, Python 3.11+).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    raise RuntimeError("benchmarks/ corpora need Python 3.11 or newer (tomllib)") from None

COMMIT = re.compile(r"\b[0-9a-f]{40}\b")
RUN_ID = re.compile(r"^[a-z0-9]+(?:[-_.][a-z0-9]+)*$")
# memcalc's GPU keys (memcalc/model/gpu_table.py): what a run's gpu may be, beside each corpus's keys for cards memcalc
# has no entry for
MEMCALC_GPUS = frozenset({
    "v100-16gb", "v100-32gb", "t4", "a100-40gb", "a100-80gb", "a100-pcie", "a10", "a10g", "rtx3090", "rtx4090", "l4",
    "l40s", "h100-sxm", "h100-pcie", "h100-nvl", "h200", "h800", "h100-hbm2e", "h20", "b200", "gb200", "rtx5090",
    "mi250x", "mi300x", "mi325x",
})  # fmt: skip
UNITS = MappingProxyType({"B": 1, "MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30})  # a memory figure's
SOURCE_FIELDS = {**{k: (str, True) for k in ("id", "title", "cite", "url")}, "notes": (str, False)}


class CorpusError(ValueError):
    """A record that breaks the rules (the message names the file, the run and the field)."""


@dataclass(frozen=True)
class Source:
    """A source's [source] table: who published the figures, where, and what holds for all of them."""

    id: str
    title: str
    cite: str
    url: str
    path: str  # the TOML file, relative to its folder
    notes: str = ""


class Measured:
    """What a run with a memory figure answers (its dataclass holds source, id, memory, memory_unit, unit_bytes)."""

    @property
    def key(self) -> str:
        """Unique across the corpus: source id / run id."""
        return f"{self.source.id}/{self.id}"

    @property
    def memory_bytes(self) -> float:
        """The figure in bytes: unit_bytes where given, else what the unit's name means."""
        return self.memory * (self.unit_bytes or UNITS[self.memory_unit])


def value(v, want: type, where: str):
    """v as `want`; an int stands for a float, a bool never for a number, a string never for either."""
    if want is float and type(v) is int:
        return float(v)
    if type(v) is not want:
        hint = " (numbers are plain; the unit goes in memory_unit or the notes)" if isinstance(v, str) else ""
        raise CorpusError(f"{where}: {v!r} is a {type(v).__name__}, expected {want.__name__}{hint}")
    if want is str and not v.strip():
        raise CorpusError(f"{where}: empty")
    return v


def fields(table: dict, spec: dict[str, tuple[type, bool]], where: str) -> dict:
    """A table's fields, each known to the spec and of its type, every required one present."""
    if unknown := sorted(set(table) - set(spec)):
        raise CorpusError(f"{where}: unknown field(s) {unknown} (new fields go in corpus.py and README.md)")
    if missing := [k for k, (_, required) in spec.items() if required and k not in table]:
        raise CorpusError(f"{where}: missing required field(s) {missing}")
    return {k: value(v, spec[k][0], f"{where}.{k}") for k, v in table.items()}


def check_keys(r: dict, enums: dict, where: str) -> None:
    """A run's id is a lower-case key, and each field with a closed set of values holds one of them."""
    if not RUN_ID.match(r["id"]):
        raise CorpusError(f"{where}: id {r['id']!r} is not a lower-case key")
    for k, allowed in enums.items():
        if k in r and r[k] not in allowed:
            raise CorpusError(f"{where}: {k} {r[k]!r} is not one of {sorted(allowed)}")


def versions(given: dict, where: str) -> MappingProxyType:
    """A run's versions: each a lower-case package name and its version as a string (frozen)."""
    for k, v in given.items():
        if not (RUN_ID.match(k) and isinstance(v, str) and v.strip()):
            raise CorpusError(f"{where}: versions.{k} = {v!r}: a lower-case package name and its version as a string")
    return MappingProxyType(dict(given))


def read(path: Path, make_source: Callable, issues_cited: bool = False) -> tuple[object, list[tuple[str, dict]]]:
    """One source file: its Source (make_source(path=..., **fields)) and its [[run]] tables, each with where it is.
    A GitHub repository is cited at a 40-hex commit (an issue, where issues_cited, by its number)."""
    name = path.name
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise CorpusError(f"{name}: not valid TOML: {e}") from None
    if unknown := sorted(set(data) - {"source", "run"}):
        raise CorpusError(f"{name}: unknown top-level table(s) {unknown}")
    if not isinstance(data.get("source"), dict):
        raise CorpusError(f"{name}: no [source] table")
    s = fields(data["source"], SOURCE_FIELDS, f"{name} [source]")
    if s["id"] != path.stem:
        raise CorpusError(f"{name} [source]: id {s['id']!r} is not the file's stem {path.stem!r}")
    if not s["url"].startswith("https://"):
        raise CorpusError(f"{name} [source]: url {s['url']!r} is not an https address")
    issue = issues_cited and "/issues/" in s["url"]
    if "github.com/" in s["url"] and not issue and not COMMIT.search(s["cite"]):
        raise CorpusError(f"{name} [source]: a repository is cited at a commit: cite names no 40-hex commit")
    tables = data.get("run")
    if not isinstance(tables, list) or not tables:
        raise CorpusError(f"{name}: no [[run]] records")
    return make_source(path=name, **s), [(f"{name} run {t.get('id', f'#{i + 1}')!s}", t) for i, t in enumerate(tables)]


def runs_of(path: Path, make_source: Callable, make_run: Callable[[object, dict, str], object],
            issues_cited: bool = False) -> list:  # fmt: skip
    """The runs of one source file, each made by make_run(source, table, where), which checks it; ids unique."""
    source, tables = read(path, make_source, issues_cited)
    runs, seen = [], set()
    for where, table in tables:
        run = make_run(source, table, where)
        if run.id in seen:
            raise CorpusError(f"{where}: duplicate run id within {path.name}")
        seen.add(run.id)
        runs.append(run)
    return runs


def load_folder(folder: Path, load_file: Callable[[Path], list]) -> list:
    """Every run of every *.toml source in folder, in file order; run keys unique across the sources."""
    files = sorted(Path(folder).glob("*.toml"))
    if not files:
        raise CorpusError(f"no *.toml sources in {folder}")
    runs = [run for path in files for run in load_file(path)]
    if dupes := sorted(k for k, n in Counter(run.key for run in runs).items() if n > 1):
        raise CorpusError(f"duplicate run keys {dupes}")
    return runs


def summary(runs: list, groups: tuple[tuple[str, Callable], ...]) -> None:
    """How many runs, sources and held-out runs, then the runs per group."""
    held = sum(r.split == "held-out" for r in runs)
    print(f"{len(runs)} runs from {len({r.source.id for r in runs})} sources ({held} held out)")
    for title, key in groups:
        print(f"\nper {title}:")
        for name, n in sorted(Counter(map(key, runs)).items()):
            print(f"  {name:32} {n:4}")
