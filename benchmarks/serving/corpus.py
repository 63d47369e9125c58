"""Published vLLM startup logs, the memory lines each printed, one TOML file per source beside this file.

    from benchmarks.serving.corpus import load
    logs = load()                        # every log, validated
    python benchmarks/serving/corpus.py  # counts per engine, card, model and split

Standard library only (tomllib, Python 3.11+). load() raises CorpusError naming the file, the log and the field
of the first record that breaks the schema (an unknown or missing field, a wrong type, a key outside its set,
a duplicate id, a config file that is not there).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
ENGINES = ("v0", "v1")
SPLITS = ("fit", "held-out")
PUBLISHED = ("total_gib", "weights_gib", "non_torch_gib", "activation_gib", "available_gib", "tokens", "blocks",
             "concurrency")  # fmt: skip
FIELDS = {"id": str, "url": str, "engine": str, "version": str, "gpu": str, "model": str, "hf_id": str, "tp": int,
          "context": int, "utilization": float, "settings_stated": bool, "split": str, "published": dict,
          "notes": str}  # fmt: skip
OPTIONAL = {"weights": str, "max_num_batched_tokens": int, "max_num_seqs": int, "config": str, "sampler": str}


class CorpusError(ValueError):
    """A record that breaks the schema."""


@dataclass(frozen=True)
class Log:
    """One published startup log: where, which vLLM, card, model and settings, and what it printed."""

    id: str
    url: str
    engine: str  # v0: worker.py's "Memory profiling" lines; v1: gpu_worker.py's "Available KV cache memory"
    version: str
    gpu: str  # memcalc's key, "" where the thread does not name the card
    model: str  # memcalc's preset, "" where memcalc has none
    hf_id: str
    tp: int  # 0: not stated
    context: int  # max_model_len; 0: not stated
    utilization: float
    settings_stated: bool  # the release, card, model and every budget setting are stated
    split: str
    published: dict
    notes: str
    source: str = ""
    weights: str = "bf16"
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    config: str = ""  # a config.json beside this file (configs/) for a model memcalc has no preset of
    sampler: str = "torch"  # flashinfer where the log says "Using FlashInfer for top-p & top-k sampling"


def check(record: dict, where: str, folder: Path = HERE) -> None:
    for name, kind in (FIELDS | OPTIONAL).items():
        if name not in record:
            if name in FIELDS:
                raise CorpusError(f"{where}: missing field {name!r}")
            continue
        value = record[name]
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            raise CorpusError(f"{where}: {name} must be {kind.__name__}, got {value!r}")
    unknown = set(record) - set(FIELDS) - set(OPTIONAL)
    if unknown:
        raise CorpusError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    if record["engine"] not in ENGINES or record["split"] not in SPLITS:
        raise CorpusError(f"{where}: engine must be one of {ENGINES}, split one of {SPLITS}")
    bad = set(record["published"]) - set(PUBLISHED)
    if bad or not record["published"]:
        raise CorpusError(f"{where}: published takes {', '.join(PUBLISHED)}, got {sorted(record['published'])}")
    if record.get("sampler", "torch") not in ("torch", "flashinfer"):
        raise CorpusError(f"{where}: sampler must be torch or flashinfer, got {record['sampler']!r}")
    if record.get("config") and (record["model"] or not (folder / record["config"]).is_file()):
        raise CorpusError(f"{where}: config {record['config']!r} must be a file beside the corpus, and model empty")


def load(folder: Path = HERE) -> list[Log]:
    """Every log of every TOML file in the folder, validated."""
    out, seen = [], set()
    for path in sorted(folder.glob("*.toml")):
        for i, record in enumerate(tomllib.loads(path.read_text()).get("log", [])):
            where = f"{path.name} log {i} ({record.get('id', '?')})"
            check(record, where, folder)
            if record["id"] in seen:
                raise CorpusError(f"{where}: duplicate id")
            seen.add(record["id"])
            out.append(Log(**record, source=path.stem))
    return out


def main() -> None:
    logs = load()
    print(f"{len(logs)} logs from {len({lg.url for lg in logs})} sources")
    for name in ("engine", "gpu", "hf_id", "split", "settings_stated"):
        tally = Counter(getattr(lg, name) if getattr(lg, name) != "" else "(not named)" for lg in logs)
        print(f"  {name}: " + ", ".join(f"{k} {n}" for k, n in tally.items()))


if __name__ == "__main__":
    sys.exit(main())
