"""benchmarks/published/: the corpus of published training-throughput measurements loads, each record
validates, and it is as large and as well cited as its README says (benchmarks/published/README.md)."""

import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "benchmarks" / "published"


def _corpus():
    spec = importlib.util.spec_from_file_location("published_corpus", FOLDER / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


corpus = _corpus()
RUNS = corpus.load()
LOCATION = re.compile(r"\b(Table|Figure|Section|Abstract|row|line|paragraph|heading)\b|§|\.md\b|\.png\b|\.tex\b")


def test_the_corpus_is_large_enough():
    assert len(RUNS) >= 60
    assert len({r.source.id for r in RUNS}) >= 6
    assert len({r.gpu for r in RUNS}) >= 5  # several GPU generations


def test_every_run_has_a_citation_and_an_exact_location():
    for r in RUNS:
        assert r.source.cite.strip() and r.source.url.startswith("https://"), r.key
        assert r.source.flops_convention.strip(), r.key
        assert LOCATION.search(r.where), f"{r.key}: where = {r.where!r} names no table, figure, section or line"
        if "github.com/" in r.source.url:
            assert re.search(r"\b[0-9a-f]{40}\b", r.source.cite), f"{r.source.id}: a repository is cited at a commit"


def test_no_duplicate_ids():
    assert not [k for k, n in Counter(r.key for r in RUNS).items() if n > 1]
    for path in FOLDER.glob("*.toml"):
        ids = [r.id for r in corpus.load_file(path)]
        assert len(ids) == len(set(ids)), path.name


def test_each_record_validates():
    """load() validated everything; here the properties a reader relies on, run by run."""
    for r in RUNS:
        assert r.gpu in corpus.GPUS and r.precision in corpus.PRECISIONS and r.stack in corpus.STACKS, r.key
        assert any(getattr(r, k) is not None for k in corpus.MEASURES), r.key
        for k in ("mfu", "hfu"):
            assert getattr(r, k) is None or 0 < getattr(r, k) <= 1, r.key
        if None not in (r.tp, r.pp, r.dp):
            assert r.tp * r.pp * r.dp * (r.cp or 1) == r.gpus, r.key
        if None not in (r.global_batch, r.micro_batch, r.dp):
            assert r.global_batch % (r.micro_batch * r.dp) == 0, r.key
        if r.derived:
            assert "derived" in r.notes.lower(), f"{r.key}: a derived figure shows its arithmetic in notes"


def test_every_source_file_is_loaded_and_named_for_its_id():
    files = sorted(p.stem for p in FOLDER.glob("*.toml"))
    assert files == sorted({r.source.id for r in RUNS})


GOOD = """[source]
id = "sample"
title = "t"
cite = "Someone 2024, arXiv:0000.00000"
url = "https://arxiv.org/abs/0000.00000"
stack = "megatron"
flops_convention = "6N per token"

[[run]]
id = "r1"
where = "Table 1, row 1"
model = "GPT 1B"
gpu = "a100-80gb"
gpus = 16
tp = 2
pp = 2
dp = 4
micro_batch = 2
global_batch = 64
precision = "bf16"
tflops_per_gpu = 150
"""


@pytest.mark.parametrize("change, message", [
    (("gpus = 16", "gpus = 12"), "!= gpus = 12"),
    (("global_batch = 64", "global_batch = 60"), "not divisible"),
    (("tflops_per_gpu = 150", 'tflops_per_gpu = "150 TFLOP/s"'), "expected float"),
    (("tflops_per_gpu = 150", "mfu = 44"), "fraction"),
    (("tflops_per_gpu = 150", ""), "no measured figure"),
    (('where = "Table 1, row 1"\n', ""), "missing required"),
    (("tp = 2", "tpp = 2"), "unknown field"),
    (('gpu = "a100-80gb"', 'gpu = "A100"'), "gpu"),
    (('id = "sample"', 'id = "other"'), "stem"),
    (("gpus = 16", "gpus = true"), "expected int"),
])  # fmt: skip
def test_the_validator_refuses_a_broken_record(tmp_path, change, message):
    (tmp_path / "sample.toml").write_text(GOOD)
    assert len(corpus.load(tmp_path)) == 1
    (tmp_path / "sample.toml").write_text(GOOD.replace(*change))
    with pytest.raises(corpus.CorpusError, match=message):
        corpus.load(tmp_path)


def test_the_validator_refuses_a_duplicate_run_id(tmp_path):
    run = GOOD.split("[[run]]", 1)[1]
    (tmp_path / "sample.toml").write_text(GOOD + "\n[[run]]" + run)
    with pytest.raises(corpus.CorpusError, match="duplicate"):
        corpus.load(tmp_path)
