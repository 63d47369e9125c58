"""The GPU evidence run's plumbing, on meta: verify --matrix --save, then verify.summary."""

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

pytest.importorskip("torch")


def test_matrix_save_and_summary(tmp_path):
    from verify import summary

    folder = tmp_path / "tiny-s128"
    out = CliRunner().invoke(app, ["verify", "--matrix", "--device", "meta", "--layers", "2", "--hidden", "64",
                                   "--heads", "4", "--seq", "128", "--no-linearity", "--save", str(folder),
                                   "--format", "json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    runs = json.loads(out.stdout)
    assert len(runs) == 8 and len(list(folder.glob("*.json"))) == 8  # each run written as it ended
    (tmp_path / "env.txt").write_text("test")
    data = summary.load(tmp_path)
    assert data["environment"] == "test" and len(data["matrices"]["tiny-s128"]) == 8
    table = summary.markdown(data)
    assert table.count("| tiny-s128 |") == 8 and "FAIL" not in table


def test_save_needs_matrix(tmp_path):
    out = CliRunner().invoke(app, ["verify", "--model", "gpt2", "--save", str(tmp_path)])
    assert out.exit_code == 2 and "add --matrix" in out.stderr
