"""Published, measured fine-tuning memory figures, one TOML file per source beside this file; see README.md.

    from benchmarks.finetune.corpus import load
    runs = load()                      # every run of every source, validated

    python benchmarks/finetune/corpus.py      # counts per source, split, memory kind and GPU

Standard library only (tomllib, Python 3.11+). load() raises CorpusError naming the file, the run and the
field of the first record that breaks the schema: an unknown (misspelt) field, a missing one, a value of the
wrong type (a number written with its unit, "18.9 GiB", is a string and is refused), a key outside its set,
settings that contradict each other (QLoRA without a quantized base, re-entrant checkpointing without
checkpointing, a LoRA rank on a full fine-tune, one GPU said to run FSDP), a duplicate id.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script too: benchmarks/ importable

from benchmarks import corpus_files as files  # noqa: E402

CorpusError, UNITS = files.CorpusError, files.UNITS

HERE = Path(__file__).resolve().parent

# memcalc's GPU keys, and three that memcalc has no card for: the RTX A6000, an A100 whose memory the source does
# not give, and a GPU the source does not name.
MEMCALC_GPUS = files.MEMCALC_GPUS
OTHER_GPUS = frozenset({"rtx-a6000", "a100", "unstated"})
GPUS = MEMCALC_GPUS | OTHER_GPUS
SPLITS = ("fit", "held-out")
PARALLEL = ("single", "ddp", "fsdp", "deepspeed")
METHODS = ("full", "lora", "qlora", "other-peft")
# Which memory the figure is: torch.cuda.max_memory_allocated, max_memory_reserved, memory_stats()'s
# active_bytes.all.peak, the device's used memory as nvidia-smi / NVML shows it (CUDA context included), or not said.
MEMORY_KINDS = ("peak_allocated", "peak_reserved", "peak_active", "nvidia_smi", "unknown")
DTYPES = ("fp32", "bf16", "fp16")
QUANTS = ("nf4", "fp4", "int8")
ATTENTION = ("sdpa", "flash2", "eager", "xformers")
ENUMS = {"split": SPLITS, "parallel": PARALLEL, "method": METHODS, "memory_kind": MEMORY_KINDS, "memory_unit": UNITS,
         "gpu": GPUS, "dtype": DTYPES, "amp": DTYPES, "quant": QUANTS, "quant_storage": DTYPES,
         "adapter_dtype": DTYPES, "attention": ATTENTION}  # fmt: skip
LORA_ONLY = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "dora", "rslora", "adapter_dtype")


@dataclass(frozen=True)
class Run(files.Measured):
    source: files.Source
    id: str
    where: str  # table or figure and row, or section and paragraph, exactly
    split: str  # "fit" or "held-out"
    model: str  # as the source names it
    gpu: str
    gpus: int
    parallel: str
    method: str
    memory: float  # the figure exactly as published, in memory_unit
    memory_unit: str
    memory_kind: str
    notes: str = ""
    unit_bytes: int | None = None  # bytes per memory_unit, where the source's code pins it against its label
    hf_id: str | None = None
    params: float | None = None
    trainable_params: float | None = None
    trainer: str | None = None
    versions: MappingProxyType = field(default_factory=lambda: MappingProxyType({}), hash=False)  # package -> version
    zero: int | None = None  # FSDP FULL_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD 0; DeepSpeed's stage
    cpu_offload: bool | None = None  # parameters (and optimizer) held in CPU memory
    dtype: str | None = None  # the base weights'
    amp: str | None = None  # autocast's compute dtype, where mixed precision
    quant: str | None = None
    double_quant: bool | None = None
    quant_storage: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: tuple[str, ...] | None = None
    dora: bool | None = None
    rslora: bool | None = None
    adapter_dtype: str | None = None
    peft_type: str | None = None
    grad_checkpointing: bool | None = None
    reentrant: bool | None = None
    attention: str | None = None
    optimizer: str | None = None
    optimizer_in_bwd: bool | None = None
    activation_offload: bool | None = None
    chunked_ce: bool | None = None
    liger: bool | None = None
    compile: bool | None = None
    packing: bool | None = None
    seq: int | None = None
    seq_varies: bool | None = None  # seq is a cap: unpacked, variable-length data padded per batch
    micro_batch: int | None = None
    grad_accum: int | None = None


# name -> (type, required); lists and tables are checked element by element below
RUN_FIELDS: dict[str, tuple[type, bool]] = {
    **{k: (str, True) for k in ("id", "where", "split", "model", "gpu", "parallel", "method", "memory_unit",
                                 "memory_kind")},
    "gpus": (int, True), "memory": (float, True), "versions": (dict, False), "lora_targets": (list, False),
    **{k: (str, False) for k in ("notes", "hf_id", "trainer", "dtype", "amp", "quant", "quant_storage",
                                 "adapter_dtype", "peft_type", "attention", "optimizer")},
    **{k: (int, False) for k in ("unit_bytes", "zero", "lora_rank", "seq", "micro_batch", "grad_accum")},
    **{k: (float, False) for k in ("params", "trainable_params", "lora_alpha", "lora_dropout")},
    **{k: (bool, False) for k in ("cpu_offload", "double_quant", "dora", "rslora", "grad_checkpointing", "reentrant",
                                  "optimizer_in_bwd", "activation_offload", "chunked_ce", "liger", "compile",
                                  "packing", "seq_varies")},
}  # fmt: skip


def _check_run(r: dict, where: str) -> dict:
    def bad(msg: str):
        raise CorpusError(f"{where}: {msg}")

    files.check_keys(r, ENUMS, where)
    for k in ("gpus", "unit_bytes", "lora_rank", "seq", "micro_batch", "grad_accum", "memory", "params",
              "trainable_params", "lora_alpha"):  # fmt: skip
        if k in r and not r[k] > 0:
            bad(f"{k} = {r[k]} is not positive")
    if "lora_dropout" in r and not 0 <= r["lora_dropout"] < 1:
        bad(f"lora_dropout = {r['lora_dropout']} is not a fraction in [0, 1)")
    if (r["parallel"] == "single") != (r["gpus"] == 1):
        bad(f"parallel {r['parallel']!r} with gpus = {r['gpus']}: 'single' is one GPU, and one GPU is 'single'")
    if "zero" in r and (r["parallel"] not in ("fsdp", "deepspeed") or r["zero"] not in (0, 1, 2, 3)):
        bad(f"zero = {r['zero']} needs parallel fsdp or deepspeed and a stage 0-3")
    if "cpu_offload" in r and r["parallel"] not in ("fsdp", "deepspeed"):
        bad("cpu_offload is FSDP's or DeepSpeed's")
    if (r["method"] == "qlora") != ("quant" in r):
        bad("method 'qlora' and a quantized base (quant) go together")
    for k in ("double_quant", "quant_storage"):
        if k in r and "quant" not in r:
            bad(f"{k} without quant")
    if r["method"] not in ("lora", "qlora") and (lora := [k for k in LORA_ONLY if k in r]):
        bad(f"{lora} on method {r['method']!r}: LoRA settings belong to lora or qlora")
    if (r["method"] == "other-peft") != ("peft_type" in r):
        bad("method 'other-peft' and peft_type go together")
    if r.get("reentrant") is not None and r.get("grad_checkpointing") is not True:
        bad("reentrant is said of gradient checkpointing: give grad_checkpointing = true")
    if r.get("optimizer_in_bwd") and r.get("grad_accum", 1) > 1:
        bad("optimizer_in_bwd steps every micro-batch: grad_accum must be 1")
    if "seq_varies" in r and "seq" not in r:
        bad("seq_varies without seq")
    if "trainable_params" in r and "params" in r and r["trainable_params"] > r["params"]:
        bad("trainable_params exceed params")
    for t in r.get("lora_targets", []):
        if not (isinstance(t, str) and t.strip()):
            bad(f"lora_targets holds {t!r}: module names, as strings")
    if "versions" in r:
        r["versions"] = files.versions(r["versions"], where)
    if "lora_targets" in r:
        r["lora_targets"] = tuple(r["lora_targets"])
    return r


def load_file(path: Path) -> list[Run]:
    """The runs of one source file, validated."""
    return files.runs_of(path, files.Source, lambda source, t, where: Run(source=source, **_check_run(
        files.fields(t, RUN_FIELDS, where), where)))


def load(folder: Path | str | None = None) -> list[Run]:
    """Every run of every *.toml source in `folder` (default: this file's folder), in file order."""
    return files.load_folder(Path(folder) if folder is not None else HERE, load_file)


def main() -> None:
    files.summary(load(), (("source", lambda r: r.source.id), ("split", lambda r: r.split),
                     ("memory kind", lambda r: r.memory_kind), ("method", lambda r: r.method),
                     ("gpu", lambda r: r.gpu)))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
