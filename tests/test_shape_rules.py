"""What a shape must satisfy, checked once in the shape so every command refuses alike (issue 10, defects 5, 7)."""

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model.shape import ModelShape

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
ODD_HEAD = ["--model", "llama3-8b", "--hidden", "60", "--heads", "4", "--kv-heads", "2", "--layers", "2", "--seq", "64",
            "--tricks", "bf16"]  # fmt: skip


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


def error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output[-800:])
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-800:]
    return lines[0]


def test_rope_needs_an_even_head_dim():
    """Defect 5: rotary positions rotate pairs of dimensions, so an odd head_dim is refused by the shape."""
    with pytest.raises(InputError, match="even head_dim"):
        ModelShape(n_layers=2, hidden=60, n_heads=4, n_kv_heads=2, positions="rope")
    with pytest.raises(InputError, match="even head_dim"):
        ModelShape(n_layers=2, hidden=64, n_heads=4, head_dim=15, positions="rope")
    ModelShape(n_layers=2, hidden=60, n_heads=4, positions="learned", max_positions=64)  # no rotation: fine
    ModelShape(n_layers=2, hidden=60, n_heads=4, positions="none")


def test_estimate_exact_and_verify_refuse_the_same_shape_alike():
    """Defect 5: verify crashed in apply_rope while estimate --exact predicted; now both give the same line."""
    exact = error_line(run("estimate", *ODD_HEAD, "--exact"))
    pytest.importorskip("torch")
    verify = error_line(run("verify", *ODD_HEAD, "--device", "meta"))
    assert exact == verify and "even head_dim" in exact
