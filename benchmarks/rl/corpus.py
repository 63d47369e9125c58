"""Published, measured GPU-memory figures for RL and preference fine-tuning (GRPO, PPO, DPO, KTO, SimPO), one TOML
file per source beside this file; see README.md.

    from benchmarks.rl.corpus import load
    runs = load()                      # every run of every source, validated

    python benchmarks/rl/corpus.py     # runs per source, split, algorithm, memory kind and GPU

Standard library only (tomllib, Python 3.11+). load() raises CorpusError naming the file, the run and the field of
the first record that breaks the rules: an unknown (misspelt) field, a missing one, a value of the wrong type (a
number written with its unit, "24 GiB", is a string and is refused), a key outside its set, settings that
contradict each other, a duplicate id.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script too: benchmarks/ importable

from benchmarks import corpus_files as files  # noqa: E402

CorpusError, UNITS = files.CorpusError, files.UNITS

HERE = Path(__file__).resolve().parent

# memcalc's GPU keys, the cards described beside this file (gpus/KEY.json, memcalc's --gpu FILE), and two it has no
# card for: an A100 whose memory the source does not give, and a GPU the source does not name.
GPUS = files.MEMCALC_GPUS | {"a100", "unstated"} | {p.stem for p in (HERE / "gpus").glob("*.json")}
SPLITS = ("fit", "held-out")
ALGORITHMS = ("grpo", "ppo", "dpo", "kto", "orpo", "simpo")
PARALLEL = ("single", "ddp", "fsdp", "deepspeed", "megatron")
METHODS = ("full", "lora", "qlora", "unstated")
# Which memory: torch.cuda.max_memory_allocated, max_memory_reserved, the device's used memory (nvidia-smi, NVML,
# CUDA context and every process on the card included), or not said.
MEMORY_KINDS = ("peak_allocated", "peak_reserved", "nvidia_smi", "unknown")
ROLLOUT = ("none", "hf-generate", "vllm", "sglang", "unstated")
PLACEMENT = ("none", "colocated", "separate", "unstated")
DTYPES = ("fp32", "bf16", "fp16")
ENUMS = {"split": SPLITS, "algorithm": ALGORITHMS, "parallel": PARALLEL, "method": METHODS,
         "memory_kind": MEMORY_KINDS, "memory_unit": UNITS, "gpu": GPUS, "rollout": ROLLOUT,
         "placement": PLACEMENT, "dtype": DTYPES}  # fmt: skip
ONLINE = ("grpo", "ppo")  # algorithms that generate during training


@dataclass(frozen=True)
class Run(files.Measured):
    source: files.Source
    id: str
    where: str  # the file and line, or the table and row, exactly, with a short verbatim quote
    split: str
    algorithm: str
    framework: str  # "ms-swift 3.x (swift rlhf)", "plain PyTorch + vLLM", ...
    model: str  # as the source names it
    gpu: str
    gpus: int  # the total
    parallel: str
    method: str
    memory: float  # the figure exactly as published, per GPU, in memory_unit
    memory_unit: str
    memory_kind: str
    rollout: str  # the generation engine; "none" for offline algorithms (DPO, KTO, SimPO)
    placement: str  # rollout engine on the training GPUs ("colocated") or its own ("separate"); "none" if no rollout
    notes: str = ""
    unit_bytes: int | None = None  # bytes per memory_unit where the source's code pins it against its label
    hf_id: str | None = None
    versions: MappingProxyType | None = None  # package -> version, only versions that ran
    zero: int | None = None  # DeepSpeed stage, or FSDP FULL_SHARD 3 / SHARD_GRAD_OP 2 / NO_SHARD 0
    tp: int | None = None  # Megatron tensor parallel size
    ep: int | None = None  # Megatron expert parallel size
    dtype: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None  # LoraConfig's lora_dropout (0 where not given: PEFT's default)
    grad_checkpointing: bool | None = None
    packing: bool | None = None  # packed or padding-free batches
    gpu_memory_utilization: float | None = None  # the rollout engine's fraction of the card
    micro_batch: int | None = None  # sequences (DPO: preference pairs) per GPU per forward
    grad_accum: int | None = None
    global_batch: int | None = None
    num_generations: int | None = None
    seq: int | None = None  # max total length (prompt + response, or the pair's longer side)
    prompt_len: int | None = None
    response_len: int | None = None
    step_time_s: float | None = None  # seconds per optimizer step (or per iteration, as the source says)


RUN_FIELDS: dict[str, tuple[type, bool]] = {
    **{k: (str, True) for k in ("id", "where", "split", "algorithm", "framework", "model", "gpu", "parallel",
                                 "method", "memory_unit", "memory_kind", "rollout", "placement")},
    "gpus": (int, True), "memory": (float, True), "versions": (dict, False),
    **{k: (str, False) for k in ("notes", "hf_id", "dtype")},
    **{k: (int, False) for k in ("unit_bytes", "zero", "tp", "ep", "lora_rank", "micro_batch", "grad_accum",
                                 "global_batch", "num_generations", "seq", "prompt_len", "response_len")},
    **{k: (float, False) for k in ("lora_alpha", "lora_dropout", "gpu_memory_utilization", "step_time_s")},
    **{k: (bool, False) for k in ("grad_checkpointing", "packing")},
}  # fmt: skip
POSITIVE = ("gpus", "unit_bytes", "memory", "tp", "ep", "lora_rank", "lora_alpha", "micro_batch", "grad_accum",
            "global_batch", "num_generations", "seq", "prompt_len", "response_len", "step_time_s")


def _check_run(r: dict, where: str) -> dict:
    def bad(msg: str):
        raise CorpusError(f"{where}: {msg}")

    files.check_keys(r, ENUMS, where)
    for k in POSITIVE:
        if k in r and not r[k] > 0:
            bad(f"{k} = {r[k]} is not positive")
    if (r["parallel"] == "single") != (r["gpus"] == 1):
        bad(f"parallel {r['parallel']!r} with gpus = {r['gpus']}: 'single' is one GPU, and one GPU is 'single'")
    if "zero" in r and (r["parallel"] not in ("fsdp", "deepspeed") or r["zero"] not in (0, 1, 2, 3)):
        bad(f"zero = {r['zero']} needs parallel fsdp or deepspeed and a stage 0-3")
    for k in ("tp", "ep"):
        if k in r and r["parallel"] != "megatron":
            bad(f"{k} is Megatron's: parallel must be 'megatron'")
    if "lora_dropout" in r and not 0 <= r["lora_dropout"] < 1:
        bad(f"lora_dropout = {r['lora_dropout']} is not a probability in [0, 1)")
    if r["method"] == "full" and ("lora_rank" in r or "lora_alpha" in r or "lora_dropout" in r):
        bad("LoRA settings on method 'full'")
    online = r["algorithm"] in ONLINE
    if online == (r["rollout"] == "none"):
        bad(f"algorithm {r['algorithm']!r} with rollout {r['rollout']!r}: GRPO and PPO generate, the others do not")
    if (r["rollout"] == "none") != (r["placement"] == "none"):
        bad("placement 'none' goes with rollout 'none' and only with it")
    if not online and ("num_generations" in r or "response_len" in r or "gpu_memory_utilization" in r):
        bad("num_generations, response_len and gpu_memory_utilization belong to GRPO or PPO")
    if "gpu_memory_utilization" in r and not 0 < r["gpu_memory_utilization"] <= 1:
        bad("gpu_memory_utilization is a fraction in (0, 1]")
    if r["memory_kind"] == "unknown" and not r.get("notes"):
        bad("memory_kind 'unknown' needs notes saying what is likely")
    if "versions" in r:
        r["versions"] = files.versions(r["versions"], where)
    return r


def load_file(path: Path) -> list[Run]:
    """The runs of one source file, validated (a GitHub issue is cited by its number, not a commit)."""
    return files.runs_of(path, files.Source, lambda source, t, where: Run(source=source, **_check_run(
        files.fields(t, RUN_FIELDS, where), where)),
                   issues_cited=True)  # fmt: skip


def load(folder: Path | str | None = None) -> list[Run]:
    """Every run of every *.toml source in `folder` (default: this file's folder), in file order."""
    return files.load_folder(Path(folder) if folder is not None else HERE, load_file)


def main() -> None:
    files.summary(load(), (("source", lambda r: r.source.id), ("split", lambda r: r.split),
                     ("algorithm", lambda r: r.algorithm), ("memory kind", lambda r: r.memory_kind),
                     ("method", lambda r: r.method), ("gpu", lambda r: r.gpu)))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
