"""benchmarks/rl/: the corpus of published, measured GPU-memory figures for RL and preference fine-tuning loads,
every run is cited with an exact location and says which memory it is, ids are unique, and the loader refuses a
broken record (benchmarks/rl/README.md)."""

import re
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.rl import corpus  # benchmarks/ is a namespace package at the repository's root

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "benchmarks" / "rl"

RUNS = corpus.load()
LOCATION = re.compile(r"\b(Table|table|Section|section|row|line|comment|log)\b|\.(md|sh|rst|py)\b")

GOOD_SOURCE = """[source]
id = "{stem}"
title = "t"
cite = "owner/repo file @ 0123456789abcdef0123456789abcdef01234567"
url = "https://github.com/owner/repo/blob/0123456789abcdef0123456789abcdef01234567/file.md"
"""
GOOD_RUN = """
[[run]]
id = "a"
where = "file.md, line 1"
split = "fit"
algorithm = "grpo"
framework = "TRL GRPOTrainer"
model = "m"
gpu = "h100-sxm"
gpus = 1
parallel = "single"
method = "full"
rollout = "vllm"
placement = "colocated"
memory = 40
memory_unit = "GiB"
memory_kind = "peak_reserved"
"""


def test_the_corpus_has_what_was_found():
    """16 runs from 3 sources were found (see README.md); the brief's bar is 10 runs from 3 sources."""
    assert len(RUNS) >= 10
    assert len({r.source.id for r in RUNS}) >= 3
    assert {r.algorithm for r in RUNS} >= {"grpo", "ppo", "dpo"}


def test_every_run_has_a_location_and_a_memory_kind():
    for r in RUNS:
        assert r.source.cite.strip() and r.source.url.startswith("https://"), r.key
        assert LOCATION.search(r.where), f"{r.key}: where = {r.where!r} names no line, table, section or file"
        assert r.memory_kind in corpus.MEMORY_KINDS and r.memory_unit in corpus.UNITS, r.key
        assert r.memory_bytes > 0, r.key
        if r.memory_kind == "unknown":
            assert r.notes or r.source.notes, r.key


def test_ids_are_unique_and_files_are_named_for_their_source():
    assert not [k for k, n in Counter(r.key for r in RUNS).items() if n > 1]
    assert sorted(p.stem for p in FOLDER.glob("*.toml")) == sorted({r.source.id for r in RUNS})
    readme = (FOLDER / "README.md").read_text(encoding="utf-8")
    for source in {r.source.id for r in RUNS}:
        assert f"`{source}`" in readme, f"README.md does not list {source}"


def test_both_splits_are_used():
    assert {r.split for r in RUNS} == {"fit", "held-out"}


def test_units_convert_as_the_source_computed_them():
    by_key = {r.key: r for r in RUNS}
    # printed "GB" from / 1024**3: GiB, pinned by unit_bytes
    assert by_key["garg_grpo_from_scratch/qwen2.5-math-1.5b-baseline"].memory_bytes == 21.43 * 2**30
    assert by_key["ms_swift_examples/dpo-lora-qwen2.5-7b-1gpu"].memory_bytes == 24 * 2**30


def test_a_good_record_loads(tmp_path):
    (tmp_path / "ok.toml").write_text(GOOD_SOURCE.format(stem="ok") + GOOD_RUN, encoding="utf-8")
    (run,) = corpus.load(tmp_path)
    assert run.key == "ok/a" and run.memory_bytes == 40 * 2**30


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('memory = 40', 'memory = "40 GiB"', r"bad.toml run a\.memory: .*str"),
        ('memory_kind = "peak_reserved"', 'memory_kind = "peak"', "bad.toml run a: memory_kind"),
        ('split = "fit"', 'splt = "fit"', "bad.toml run a: unknown field"),
        ('gpus = 1', 'gpus = 2', "bad.toml run a: parallel 'single'"),
        ('rollout = "vllm"', 'rollout = "none"', "bad.toml run a: algorithm 'grpo' with rollout"),
        ('where = "file.md, line 1"\n', '', "bad.toml run a: missing required field"),
    ],
)
def test_a_malformed_record_is_refused(tmp_path, old, new, message):
    assert old in GOOD_RUN
    (tmp_path / "bad.toml").write_text(GOOD_SOURCE.format(stem="bad") + GOOD_RUN.replace(old, new), encoding="utf-8")
    with pytest.raises(corpus.CorpusError, match=message):
        corpus.load(tmp_path)


def test_a_duplicate_id_and_a_missing_commit_are_refused(tmp_path):
    (tmp_path / "dup.toml").write_text(GOOD_SOURCE.format(stem="dup") + GOOD_RUN + GOOD_RUN, encoding="utf-8")
    with pytest.raises(corpus.CorpusError, match="dup.toml run a: duplicate run id"):
        corpus.load(tmp_path)
    (tmp_path / "dup.toml").unlink()
    source = GOOD_SOURCE.format(stem="nocommit").replace("0123456789abcdef0123456789abcdef01234567", "main", 1)
    (tmp_path / "nocommit.toml").write_text(source + GOOD_RUN, encoding="utf-8")
    with pytest.raises(corpus.CorpusError, match="nocommit.toml .source.: a repository is cited at a commit"):
        corpus.load(tmp_path)
