"""Published training-throughput measurements, one TOML file per source beside this file; see README.md.

    from benchmarks.published.corpus import load
    runs = load()                      # every run of every source, validated

    python benchmarks/published/corpus.py     # counts per source and per GPU

Standard library only (tomllib, Python 3.11+). load() raises CorpusError naming the file, the run and
the field of the first record that breaks the schema: a missing or misspelt field, a value of the wrong
type (a number written with its unit, "137 TFLOP/s", is a string and is refused), a layout whose
degrees do not multiply to the GPU count, a global batch that the micro-batch and data-parallel degree
do not divide, a duplicate id.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: no tomllib in the standard library
    raise RuntimeError("benchmarks/published/corpus.py needs Python 3.11 or newer (tomllib)") from None

HERE = Path(__file__).resolve().parent

STACKS = frozenset({"megatron", "deepspeed", "megatron-deepspeed", "torchtitan", "llm-foundry", "other"})
GPUS = frozenset({
    "v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h100-hbm2e", "h800", "h200",
    "b200", "mi250x", "mi300x",
})  # fmt: skip
PRECISIONS = frozenset({
    "fp32", "fp16", "bf16", "mixed16", "fp8-te", "fp8-te-delayed", "fp8-torchao", "fp8-torchao-tensorwise",
    "fp8-torchao-rowwise", "fp8-blockwise",
})  # fmt: skip
RECOMPUTE = frozenset({"none", "full", "selective", "selective-op", "selective-layer"})
MEMORY_UNITS = frozenset({"GB", "GiB"})
# The figures a run reports; it has at least one. gpu_hours and train_tokens are whole-training totals.
MEASURES = ("tflops_per_gpu", "mfu", "hfu", "tokens_per_s_per_gpu", "step_s", "tokens_per_s", "memory_gb", "gpu_hours",
            "train_tokens")  # fmt: skip
KEY = re.compile(r"^[a-z0-9]+(?:[-_.][a-z0-9]+)*$")
COMMIT = re.compile(r"\b[0-9a-f]{40}\b")


class CorpusError(ValueError):
    """A record that breaks the schema (the message names the file, the run and the field)."""


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    cite: str
    url: str
    stack: str
    flops_convention: str
    path: str  # the TOML file, relative to this folder
    notes: str = ""


@dataclass(frozen=True)
class Run:
    source: Source
    id: str
    where: str
    model: str
    gpu: str
    gpus: int
    precision: str
    stack: str  # the source's, unless the run names its own
    notes: str = ""
    gpus_per_node: int | None = None
    interconnect: str | None = None
    # model shape, as published
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn: int | None = None
    gated_mlp: bool | None = None
    vocab: int | None = None
    params: float | None = None
    active_params: float | None = None
    seq: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    # layout
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    vpp: int | None = None
    model_parallel: int | None = None
    sequence_parallel: bool | None = None
    zero: int | None = None
    recompute: str | None = None
    flash: bool | None = None
    compile: bool | None = None
    async_tp: bool | None = None  # torchtitan's asynchronous TP: its collectives decomposed under the matmuls
    # the measured figures, exactly as published
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    tokens_per_s_per_gpu: float | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    memory_gb: float | None = None
    memory_unit: str | None = None
    gpu_hours: float | None = None
    train_tokens: float | None = None
    derived: bool = False  # a measured figure is arithmetic on published ones (notes show it), not read

    @property
    def key(self) -> str:
        """Unique across the corpus: source id / run id."""
        return f"{self.source.id}/{self.id}"


SOURCE_REQUIRED = {"id": str, "title": str, "cite": str, "url": str, "stack": str, "flops_convention": str}
SOURCE_OPTIONAL = {"notes": str}
RUN_REQUIRED = {"id": str, "where": str, "model": str, "gpu": str, "gpus": int, "precision": str}
RUN_OPTIONAL: dict[str, type] = {"notes": str, "stack": str, "interconnect": str, "recompute": str,
                                 "memory_unit": str, "derived": bool}  # fmt: skip
for _f in fields(Run):
    if _f.name in RUN_REQUIRED or _f.name in RUN_OPTIONAL or _f.name == "source":
        continue
    RUN_OPTIONAL[_f.name] = {"int | None": int, "float | None": float, "bool | None": bool}[_f.type]
POSITIVE_INTS = {"gpus", "gpus_per_node", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch",
                 "global_batch", "tp", "pp", "dp", "cp", "ep", "vpp", "model_parallel"}  # fmt: skip


def _typed(value, want: type, where: str):
    """value as `want`: an int is accepted where a float is wanted, a bool never stands for a number."""
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want in (int, float) and isinstance(value, bool) or not isinstance(value, want):
        raise CorpusError(f"{where}: {value!r} is a {type(value).__name__}, expected {want.__name__} (numbers are "
                          f"plain, units go in the field name or the notes)")  # fmt: skip
    if want is str and not value.strip():
        raise CorpusError(f"{where}: empty")
    return value


def _fields(table: dict, required: dict, optional: dict, where: str) -> dict:
    unknown = set(table) - set(required) - set(optional)
    if unknown:
        raise CorpusError(f"{where}: unknown field(s) {sorted(unknown)} (new fields go in corpus.py and README.md)")
    missing = [k for k in required if k not in table]
    if missing:
        raise CorpusError(f"{where}: missing required field(s) {missing}")
    return {k: _typed(v, {**required, **optional}[k], f"{where}.{k}") for k, v in table.items()}


def _check_run(r: dict, where: str) -> None:
    def bad(msg: str):
        raise CorpusError(f"{where}: {msg}")

    for k in POSITIVE_INTS & r.keys():
        if r[k] < 1:
            bad(f"{k} = {r[k]} is not a positive integer")
    for k in ("params", "active_params", *MEASURES):
        if k in r and not r[k] > 0:
            bad(f"{k} = {r[k]} is not positive")
    if not KEY.match(r["id"]):
        bad(f"id {r['id']!r} is not a lower-case key")
    if r["gpu"] not in GPUS:
        bad(f"gpu {r['gpu']!r} is not one of {sorted(GPUS)}")
    if r["precision"] not in PRECISIONS:
        bad(f"precision {r['precision']!r} is not one of {sorted(PRECISIONS)}")
    if "stack" in r and r["stack"] not in STACKS:
        bad(f"stack {r['stack']!r} is not one of {sorted(STACKS)}")
    if "recompute" in r and r["recompute"] not in RECOMPUTE:
        bad(f"recompute {r['recompute']!r} is not one of {sorted(RECOMPUTE)}")
    if not any(k in r for k in MEASURES):
        bad(f"no measured figure: give at least one of {list(MEASURES)}")
    for k in ("mfu", "hfu"):
        if k in r and not r[k] <= 1:
            bad(f"{k} = {r[k]} is a fraction of peak (0.44, not 44)")
    if "zero" in r and r["zero"] not in (0, 1, 2, 3):
        bad(f"zero = {r['zero']} is not a ZeRO stage 0-3")
    if ("memory_gb" in r) != ("memory_unit" in r):
        bad("memory_gb and memory_unit go together")
    if "memory_unit" in r and r["memory_unit"] not in MEMORY_UNITS:
        bad(f"memory_unit {r['memory_unit']!r} is not one of {sorted(MEMORY_UNITS)}")
    if "kv_heads" in r and "heads" in r and r["heads"] % r["kv_heads"]:
        bad(f"heads = {r['heads']} is not a multiple of kv_heads = {r['kv_heads']}")
    if "active_params" in r and "params" in r and r["active_params"] > r["params"]:
        bad("active_params exceed params")
    if "gpus_per_node" in r and r["gpus"] > r["gpus_per_node"] and r["gpus"] % r["gpus_per_node"]:
        bad(f"gpus = {r['gpus']} is not a whole number of {r['gpus_per_node']}-GPU nodes")
    cp = r.get("cp", 1)
    if all(k in r for k in ("tp", "pp", "dp")) and r["tp"] * r["pp"] * r["dp"] * cp != r["gpus"]:
        bad(f"tp*pp*dp*cp = {r['tp']}*{r['pp']}*{r['dp']}*{cp} != gpus = {r['gpus']}")
    if "model_parallel" in r:
        if "tp" in r and "pp" in r and r["tp"] * r["pp"] != r["model_parallel"]:
            bad(f"tp*pp = {r['tp'] * r['pp']} != model_parallel = {r['model_parallel']}")
        if "dp" in r and r["model_parallel"] * r["dp"] * cp != r["gpus"]:
            bad(f"model_parallel*dp*cp = {r['model_parallel'] * r['dp'] * cp} != gpus = {r['gpus']}")
    for k in ("tp", "pp", "dp", "cp", "model_parallel"):
        if k in r and r[k] > r["gpus"]:
            bad(f"{k} = {r[k]} exceeds gpus = {r['gpus']}")
    if all(k in r for k in ("global_batch", "micro_batch", "dp")) and r["global_batch"] % (r["micro_batch"] * r["dp"]):
        bad(f"global_batch = {r['global_batch']} is not divisible by micro_batch*dp = {r['micro_batch']}*{r['dp']}")
    if "vpp" in r and "layers" in r and "pp" in r and r["layers"] < r["pp"] * r["vpp"]:
        bad(f"{r['layers']} layers cannot fill pp*vpp = {r['pp'] * r['vpp']} stages")


def load_file(path: Path) -> list[Run]:
    """The runs of one source file, validated."""
    name = path.name
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise CorpusError(f"{name}: not valid TOML: {e}") from None
    unknown = set(data) - {"source", "run"}
    if unknown:
        raise CorpusError(f"{name}: unknown top-level table(s) {sorted(unknown)}")
    if not isinstance(data.get("source"), dict):
        raise CorpusError(f"{name}: no [source] table")
    s = _fields(data["source"], SOURCE_REQUIRED, SOURCE_OPTIONAL, f"{name} [source]")
    if s["id"] != path.stem:
        raise CorpusError(f"{name} [source]: id {s['id']!r} is not the file's stem {path.stem!r}")
    if s["stack"] not in STACKS:
        raise CorpusError(f"{name} [source]: stack {s['stack']!r} is not one of {sorted(STACKS)}")
    if not s["url"].startswith("https://"):
        raise CorpusError(f"{name} [source]: url {s['url']!r} is not an https address")
    if "github.com/" in s["url"] and not COMMIT.search(s["cite"]):
        raise CorpusError(f"{name} [source]: a repository is cited at a commit: cite names no 40-hex commit")
    source = Source(path=name, **s)
    raw_runs = data.get("run")
    if not isinstance(raw_runs, list) or not raw_runs:
        raise CorpusError(f"{name}: no [[run]] records")
    runs, seen = [], set()
    for i, table in enumerate(raw_runs):
        where = f"{name} run {table.get('id', f'#{i + 1}')!s}"
        r = _fields(table, RUN_REQUIRED, RUN_OPTIONAL, where)
        _check_run(r, where)
        if r["id"] in seen:
            raise CorpusError(f"{where}: duplicate run id within {name}")
        seen.add(r["id"])
        r.setdefault("stack", source.stack)
        runs.append(Run(source=source, **r))
    return runs


def load(folder: Path | str | None = None) -> list[Run]:
    """Every run of every *.toml source in `folder` (default: this file's folder), in file order."""
    folder = Path(folder) if folder is not None else HERE
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise CorpusError(f"no *.toml sources in {folder}")
    runs = [run for path in files for run in load_file(path)]
    keys = Counter(run.key for run in runs)
    if dupes := sorted(k for k, n in keys.items() if n > 1):
        raise CorpusError(f"duplicate run keys {dupes}")
    return runs


def main() -> None:
    runs = load()
    print(f"{len(runs)} runs from {len({r.source.id for r in runs})} sources")
    for title, key in (("source", lambda r: r.source.id), ("gpu", lambda r: r.gpu)):
        print(f"\nper {title}:")
        for name, n in sorted(Counter(map(key, runs)).items()):
            print(f"  {name:32} {n:4}")


if __name__ == "__main__":
    sys.exit(main())
