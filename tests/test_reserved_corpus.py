"""benchmarks/reserved/: the corpus of published reserved-memory figures loads, each run with its source and
unit, the loader refuses a broken record, and the report runs (on two of the corpus's cheapest runs: the whole
report replays twelve full-size steps, some 20 s; its output is benchmarks/reserved/REPORT.md)."""

from __future__ import annotations

import pytest

from benchmarks.reserved.corpus import UNITS, CorpusError, load
from benchmarks.reserved.report import LEGEND, markdown, predict, rows, summary

GOOD = """[source]
id = "{stem}"
title = "t"
cite = "owner/repo path @ 0000000000000000000000000000000000000000"
url = "https://example.org"
reading = "max_memory_reserved"
measured = "torch.cuda.max_memory_reserved()"

[[run]]
id = "a"
where = "Table 1"
model = "m"
preset = "llama3-8b"
gpu = "h100-sxm"
gpus = 8
parallel = "fsdp2"
fsdp_units = "decoder"
stack = "torchtitan"
seq = 8192
micro_batch = 1
precision = "bf16"
recompute = "full"
optimizer = "adamw-fused"
compile = false
expandable_segments = false
expandable_stated = true
memory = 40.5
memory_unit = "GiB"
torch = "2.13"
"""


def test_every_run_has_its_source_its_unit_and_its_setup():
    runs = load()
    assert len(runs) >= 12
    for run in runs:
        s = run.source
        assert s.title and s.cite and s.url.startswith("https://") and s.measured, run.key
        assert run.where and run.torch and run.memory > 0, run.key
        assert run.memory_unit in UNITS and isinstance(run.memory_bytes, int)
    assert {r.memory_unit for r in runs} >= {"GiB", "B"}


@pytest.mark.parametrize("change, message", [
    ('memory_unit = "GiB"', 'memory_unit = "gb"'),  # a unit outside the set
    ("memory = 40.5", 'memory = "40.5 GiB"'),  # a number written with its unit is a string
    ('torch = "2.13"', 'torch = "2.13"\nmemroy = 1'),  # a misspelt field
    ('fsdp_units = "decoder"\n', ""),  # an FSDP2 run that does not say whose units
    ('where = "Table 1"\n', ""),  # a field missing
])  # fmt: skip
def test_the_loader_refuses_a_broken_record(tmp_path, change, message):
    (tmp_path / "ok.toml").write_text(GOOD.format(stem="ok"))
    assert [r.memory_bytes for r in load(tmp_path)] == [round(40.5 * 2**30)]
    (tmp_path / "bad.toml").write_text(GOOD.format(stem="bad").replace(change, message))
    with pytest.raises(CorpusError, match="bad.toml"):
        load(tmp_path)


def test_the_report_runs_on_two_runs():
    runs = [r for r in load() if r.key in ("peft_metamathqa/llama3.2-3b-full", "torchtitan_performance/t3-fsdp")]
    table = rows(runs)
    assert [r["run"] for r in table] == [r.key for r in runs]
    for run, r in zip(runs, table):
        assert r["predicted_bytes"] == predict(run, run.expandable_segments).reserved_bytes
        assert r["ratio"] == r["predicted_bytes"] / run.memory_bytes
        assert r["predicted_bytes"] >= r["allocated_bytes"] > 0 and set(r["left_out"]) <= set(LEGEND)
    assert table[0]["one_stream_bytes"] is None and table[1]["one_stream_bytes"] > 0  # FSDP2's streams, or none
    stats = summary(table)
    assert stats["all"]["n"] == 2 and stats["all"]["worst"] == max(abs(r["ratio"] - 1) for r in table)
    text = markdown(table, stats)
    assert all(r["run"] in text for r in table) and "median" in text
