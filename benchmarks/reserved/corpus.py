"""Published figures of *reserved* GPU memory (what PyTorch's caching allocator held at its peak), one TOML file
per source beside this file; see README.md.

    from benchmarks.reserved.corpus import load
    runs = load()                      # every run of every source, validated

    python benchmarks/reserved/corpus.py      # the runs, their setup and figure, per source

Standard library only (tomllib, Python 3.11+). load() raises CorpusError naming the file, the run and the field
of the first record that breaks the schema: a field missing, unknown or of the wrong type, a key outside its set,
a duplicate id.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent

UNITS = {"GiB": 1 << 30, "GB": 10**9, "MiB": 1 << 20, "B": 1}
READINGS = frozenset({
    "max_memory_reserved",  # torch.cuda.max_memory_reserved() == memory_stats()["reserved_bytes.all.peak"]
    "nvidia_smi",  # the device's used memory: reserved plus the CUDA context, cuBLAS and NCCL outside the allocator
})  # fmt: skip
PARALLEL = frozenset({"single", "fsdp2"})
RECOMPUTE = frozenset({"none", "selective-op", "full"})
FLOAT8 = frozenset({"", "tensorwise"})
STACKS = frozenset({"torchtitan", "hf"})  # whose step ran: torchtitan's loop, or Transformers in a plain loop
OPTIMIZERS = frozenset({"adamw-fused", "adamw-foreach"})
UNITS_FSDP = frozenset({
    "blocks+root",  # torchtitan to mid-2025 (parallelize_llama.py apply_fsdp): each block, the last not resharded after
                    # forward, then the root, which holds the token table, final norm and output
    "decoder",  # torchtitan/distributed/fsdp.py apply_fsdp_to_decoder: the table, [norm, output], each block, the root
})  # fmt: skip
PEAK_OVER = frozenset({"training", "run-with-evaluation"})  # whether the source's peak spans evaluation too


class CorpusError(ValueError):
    """A record that breaks the schema (the message names the file, the run and the field)."""


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    cite: str  # owner/repo path @ 40-hex commit, or the thread's URL
    url: str
    reading: str  # READINGS: what the figure is
    measured: str  # how the source took it, in its code's words
    notes: str = ""


@dataclass(frozen=True)
class Run:
    source: Source
    id: str
    where: str  # the table and row, or the comment and log line
    model: str  # as the source names it
    preset: str  # memcalc's preset of the same shape (memcalc/model/presets.py)
    gpu: str  # memcalc's GPU key
    gpus: int
    parallel: str  # single | fsdp2 (fully_shard over every GPU, torchtitan's units)
    stack: str
    seq: int
    micro_batch: int
    precision: str  # bf16: the step's 16-bit compute (torchtitan: fp32 shards, MixedPrecisionPolicy bf16)
    recompute: str
    optimizer: str
    compile: bool
    expandable_segments: bool  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    expandable_stated: bool  # whether the source's command or text gives the allocator's setting
    memory: float  # as published
    memory_unit: str  # as published: GiB is 2**30 bytes, GB 10**9
    torch: str  # the PyTorch version or commit that ran, as the source names it
    float8: str = ""  # torchao's float8 training recipe on the blocks' linears
    float8_all_gather: bool = False  # torchao's enable_fsdp_float8_all_gather
    compiled_loss: bool = False  # the loss function under torch.compile too
    fsdp_units: str = ""  # fsdp2 runs: which fully_shard calls torchtitan made (UNITS_FSDP)
    peak_over: str = "training"
    notes: str = ""

    @property
    def memory_bytes(self) -> int:
        return round(self.memory * UNITS[self.memory_unit])

    @property
    def key(self) -> str:
        return f"{self.source.id}/{self.id}"


CHOICES = {"reading": READINGS, "parallel": PARALLEL, "recompute": RECOMPUTE, "float8": FLOAT8, "stack": STACKS,
           "optimizer": OPTIMIZERS, "memory_unit": frozenset(UNITS), "fsdp_units": UNITS_FSDP | {""},
           "peak_over": PEAK_OVER}  # fmt: skip


def typed(cls, table: dict, where: str, **given):
    """cls from a TOML table: every field of the right type, none unknown, keys from their sets."""
    known = {f.name: f for f in fields(cls)}
    for name in table:
        if name not in known or name in given:
            raise CorpusError(f"{where}: unknown field {name!r}")
    out = dict(given)
    for name, f in known.items():
        if name in given:
            continue
        if name not in table:
            if f.default is MISSING:
                raise CorpusError(f"{where}: {name} is missing")
            continue
        value, kind = table[name], {"str": str, "int": int, "float": (int, float), "bool": bool}[f.type]
        if isinstance(value, bool) != (f.type == "bool") or not isinstance(value, kind):
            raise CorpusError(f"{where}: {name} = {value!r} is not a {f.type}")
        if name in CHOICES and value not in CHOICES[name]:
            raise CorpusError(f"{where}: {name} = {value!r}; known: {', '.join(sorted(CHOICES[name]))}")
        out[name] = value
    return cls(**out)


def load(folder: Path = HERE) -> list[Run]:
    """Every run of every TOML file in folder, validated."""
    runs: list[Run] = []
    for path in sorted(folder.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        source = typed(Source, data.get("source", {}), path.name)
        if source.id != path.stem:
            raise CorpusError(f"{path.name}: source id {source.id!r} is not the file's stem")
        for table in data.get("run", []):
            run = typed(Run, table, f"{path.name} run {table.get('id', '?')}", source=source)
            if run.parallel == "single" and run.gpus != 1:
                raise CorpusError(f"{path.name} run {run.id}: parallel single with {run.gpus} GPUs")
            if (run.parallel == "fsdp2") != bool(run.fsdp_units):
                raise CorpusError(f"{path.name} run {run.id}: fsdp_units is for fsdp2 runs, and each names its units")
            if any(r.key == run.key for r in runs):
                raise CorpusError(f"{path.name} run {run.id}: duplicate id")
            runs.append(run)
    return runs


def main() -> None:
    runs = load()
    for r in runs:
        print(
            f"{r.key}: {r.memory} {r.memory_unit} ({r.source.reading}) {r.model}, {r.gpus} x {r.gpu} {r.parallel}, "
            f"seq {r.seq} x {r.micro_batch}, {r.recompute}, compile {r.compile}, float8 {r.float8 or 'no'}"
        )
    print(f"{len(runs)} runs from {len({r.source.id for r in runs})} sources", file=sys.stderr)


if __name__ == "__main__":
    main()
