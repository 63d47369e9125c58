"""--sweep: memory and step time against the sequence or the micro-batch."""

import csv
import importlib.util
import io
import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.engine.answer import answer
from memcalc.engine.job import Job
from memcalc.engine.sweep import parse_sweep, sweep
from memcalc.memory.estimate import Setup
from memcalc.model.gpus import gpu
from memcalc.model.presets import canonical_model
from memcalc.model.tricks import PROGRESSION
from memcalc.model.layout import Layout


def test_parse_sweep():
    assert parse_sweep("seq=1024:65536") == ("seq", (1024, 2048, 4096, 8192, 16384, 32768, 65536))
    assert parse_sweep("seq=1k:4k:1k") == ("seq", (1024, 2048, 3072, 4096))  # binary, as sequence lengths are
    assert parse_sweep("micro-batch=1,3,5") == ("micro-batch", (1, 3, 5))
    for bad, message in [("heads=1:4", "takes seq="), ("seq=4096:1024", "below"), ("seq=1:2:3:4", "takes A:B"),
                         ("seq=1:1000000:1", "at most"), ("seq=0:8", "positive")]:  # fmt: skip
        with pytest.raises(InputError, match=message):
            parse_sweep(bad)


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=8, zero=2)])
def test_each_point_is_the_estimate_at_that_value(layout):
    """The sweep charts estimate's own answer: the verdict and the step time of the same job at each value."""
    model, g = canonical_model(8_000_000_000), gpu("h100-sxm")
    sw = sweep(model, Setup(seq_len=8192), g, PROGRESSION, "seq", (2048, 8192), layout=layout)
    assert len(sw.points) == 2 * len(PROGRESSION)
    at = answer(Job(model, Setup(seq_len=2048), g, layout))
    for p, v, e in zip(sw.points[: len(PROGRESSION)], at.verdicts, at.layouts):
        assert (p.value, p.memory_bytes, p.fits, p.step_seconds) == (2048, v.total_bytes, v.fits, e.time.step_seconds)


def test_sweep_cli_formats():
    args = ["estimate", "--params", "8e9", "--sweep", "seq=1024:8192", "--tricks", "bf16,flash,ckpt"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "Peak memory per GPU against seq" in table.stdout and "█" in table.stdout
    rows = list(csv.DictReader(io.StringIO(CliRunner().invoke(app, args + ["--format", "csv"]).stdout)))
    assert [r["value"] for r in rows] == ["1024", "2048", "4096", "8192"]
    data = json.loads(CliRunner().invoke(app, args + ["--format", "json"]).stdout)
    assert data["values"] == [1024, 2048, 4096, 8192]
    memory = [p["memory_bytes"] for p in data["points"]]
    assert memory == sorted(memory)  # memory grows with the sequence


def test_png(tmp_path):
    path = tmp_path / "sweep.png"
    out = CliRunner().invoke(app, ["estimate", "--params", "8e9", "--sweep", "seq=1024:4096", "--png", str(path)])
    if importlib.util.find_spec("matplotlib") is None:
        assert out.exit_code == 2 and "--png needs matplotlib" in out.stderr
    else:
        assert out.exit_code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lone = CliRunner().invoke(app, ["estimate", "--params", "8e9", "--png", str(path)])
    assert lone.exit_code == 2 and "draws a sweep" in lone.stderr


def test_a_sweep_charts_what_the_textbook_has_no_formula_for():
    """The sweep charts the verdict, the replayed step: sac and ckpt:N too (the textbook has no formula for sac)."""
    out = CliRunner().invoke(app, ["estimate", "--model", "gpt2", "--tricks", "sac", "--sweep", "seq=256:1024",
                                   "--format", "json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    memory = [p["memory_bytes"] for p in json.loads(out.stdout)["points"]]
    assert len(memory) == 3 and memory == sorted(memory)
