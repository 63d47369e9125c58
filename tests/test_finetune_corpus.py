"""benchmarks/finetune/: the corpus of published, measured fine-tuning memory figures loads, every run is
cited with its exact location, it meets issue 40's bar (25 runs from 4 sources) with a held-out part, and the
loader refuses each kind of broken record (benchmarks/finetune/README.md)."""

import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "benchmarks" / "finetune"


def _corpus():
    spec = importlib.util.spec_from_file_location("finetune_corpus", FOLDER / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


corpus = _corpus()
RUNS = corpus.load()
LOCATION = re.compile(r"\b(Table|table|Figure|Section|section|row|line|paragraph)\b|\.(md|mdx|rst|json)\b")


def test_the_corpus_meets_the_bar():
    """Issue 40: at least 25 measured runs from at least 4 sources; here also more than one memory kind and GPU."""
    assert len(RUNS) >= 25
    assert len({r.source.id for r in RUNS}) >= 4
    assert len({r.memory_kind for r in RUNS}) >= 3
    assert len({r.gpu for r in RUNS} - corpus.OTHER_GPUS) >= 4
    assert {r.method for r in RUNS} >= {"full", "lora", "qlora"}


def test_every_run_is_cited_with_an_exact_location():
    for r in RUNS:
        assert r.source.cite.strip() and r.source.url.startswith("https://"), r.key
        assert LOCATION.search(r.where), f"{r.key}: where = {r.where!r} names no table, section, row or file"
        if "github.com/" in r.source.url:
            assert re.search(r"\b[0-9a-f]{40}\b", r.source.cite), f"{r.source.id}: a repository is cited at a commit"


def test_a_held_out_part_spread_across_sources():
    """About a third held out, and every source of four runs or more has runs on both sides."""
    held = [r for r in RUNS if r.split == "held-out"]
    assert 0.25 <= len(held) / len(RUNS) <= 0.45
    per_source = Counter(r.source.id for r in RUNS)
    for source, n in per_source.items():
        splits = {r.split for r in RUNS if r.source.id == source}
        if n >= 4:
            assert splits == {"fit", "held-out"}, source


def test_each_figure_says_which_memory_it_is_and_in_what_unit():
    for r in RUNS:
        assert r.memory_kind in corpus.MEMORY_KINDS and r.memory_unit in corpus.UNITS, r.key
        assert r.memory_bytes > 0, r.key
        if r.memory_kind == "unknown":
            assert r.notes or r.source.notes, f"{r.key}: an unknown kind says why in the notes"
    by_key = {r.key: r for r in RUNS}
    assert by_key["torchtune_readme/llama3.2-3b-qlora"].memory_bytes == 4.6 * 2**30
    # NVML's used memory printed "MB" from // 1024**2: MiB, pinned by unit_bytes
    assert by_key["transformers_perf_train_gpu_one/bert-large-vanilla-bs4"].memory_bytes == 14949 * 2**20


def test_every_source_file_is_loaded_named_for_its_id_and_listed_in_the_readme():
    files = sorted(p.stem for p in FOLDER.glob("*.toml"))
    assert files == sorted({r.source.id for r in RUNS})
    readme = (FOLDER / "README.md").read_text(encoding="utf-8")
    for source in files:
        assert f"`{source}`" in readme, f"README.md does not list {source}"
    assert not [k for k, n in Counter(r.key for r in RUNS).items() if n > 1]


def test_the_gpu_keys_are_memcalcs():
    """A GPU key of memcalc's table means that card; the three others are none of memcalc's."""
    from memcalc.model.gpu_table import GPUS

    assert corpus.MEMCALC_GPUS <= set(GPUS)
    assert not corpus.OTHER_GPUS & set(GPUS)


GOOD = """[source]
id = "sample"
title = "t"
cite = "someone/somewhere README.md @ 0123456789abcdef0123456789abcdef01234567"
url = "https://github.com/someone/somewhere/blob/0123456789abcdef0123456789abcdef01234567/README.md"

[[run]]
id = "r1"
where = "README.md, Table 1, row 1"
split = "fit"
model = "Llama 3.1 8B"
gpu = "rtx4090"
gpus = 1
parallel = "single"
method = "lora"
versions = {torch = "2.4.0"}
lora_rank = 8
lora_targets = ["q_proj", "v_proj"]
grad_checkpointing = true
reentrant = false
optimizer_in_bwd = false
grad_accum = 4
memory = 16.2
memory_unit = "GiB"
memory_kind = "peak_reserved"
"""


@pytest.mark.parametrize("change, message", [
    (("memory = 16.2", 'memory = "16.2 GiB"'), "expected float"),
    (("gpus = 1", "gpus = true"), "expected int"),
    (("lora_rank = 8", "lora_rnak = 8"), "unknown field"),
    (('memory_kind = "peak_reserved"\n', ""), "missing required"),
    (('gpu = "rtx4090"', 'gpu = "RTX 4090"'), "gpu"),
    (('split = "fit"', 'split = "test"'), "split"),
    (('memory_kind = "peak_reserved"', 'memory_kind = "peak"'), "memory_kind"),
    (('memory_unit = "GiB"', 'memory_unit = "gb"'), "memory_unit"),
    (("memory = 16.2", "memory = 0"), "not positive"),
    (('method = "lora"', 'method = "qlora"'), "quant"),
    (('method = "lora"', 'method = "full"'), "LoRA settings"),
    (("grad_checkpointing = true", "grad_checkpointing = false"), "reentrant"),
    (("optimizer_in_bwd = false", "optimizer_in_bwd = true"), "grad_accum"),
    (("gpus = 1", "gpus = 2"), "single"),
    (('parallel = "single"', 'parallel = "single"\nzero = 3'), "zero"),
    (('torch = "2.4.0"', "torch = 2.4"), "versions"),
    (('["q_proj", "v_proj"]', '["q_proj", 7]'), "lora_targets"),
    (('id = "sample"', 'id = "other"'), "stem"),
    (("@ 0123456789abcdef0123456789abcdef01234567", "@ main"), "commit"),
])  # fmt: skip
def test_the_loader_refuses_a_broken_record(tmp_path, change, message):
    (tmp_path / "sample.toml").write_text(GOOD)
    (good,) = corpus.load(tmp_path)
    assert good.lora_targets == ("q_proj", "v_proj") and good.versions["torch"] == "2.4.0"
    (tmp_path / "sample.toml").write_text(GOOD.replace(*change))
    with pytest.raises(corpus.CorpusError, match=message):
        corpus.load(tmp_path)


def test_the_loader_refuses_a_duplicate_run_id(tmp_path):
    run = GOOD.split("[[run]]", 1)[1]
    (tmp_path / "sample.toml").write_text(GOOD + "\n[[run]]" + run)
    with pytest.raises(corpus.CorpusError, match="duplicate"):
        corpus.load(tmp_path)


def test_runs_are_frozen(tmp_path):
    (tmp_path / "sample.toml").write_text(GOOD)
    (run,) = corpus.load(tmp_path)
    with pytest.raises(AttributeError):
        run.memory = 1.0
    with pytest.raises(TypeError):
        run.versions["torch"] = "2.5.0"
