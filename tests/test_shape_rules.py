"""What a shape must satisfy, checked once in the shape so every command refuses alike (issue 10, defects 5, 7)."""

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model.params import param_counts
from memcalc.model.presets import REACH, canonical_model
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


@pytest.mark.parametrize("n", [1, 124_000_000, 250_000_000, 900_000_000_000, 10**14])
def test_params_far_from_every_canonical_shape_are_refused(n):
    """Defect 7: --params 1 reported a 1-parameter model on a 596M shape, and 124e6 a shape whose embedding
    alone exceeds N; a canonical shape is used only within REACH (2x) of its own count, else one clear line."""
    with pytest.raises(InputError, match="give the shape"):
        canonical_model(n)
    line = error_line(run("estimate", "--params", str(n)))
    assert "canonical shapes cover" in line and "--model" in line


@pytest.mark.parametrize("n,name", [
    (8_000_000_000, "qwen3-8b"), (7_500_000_000, "qwen3-8b"), (300_000_000, "qwen3-0.6b"),
    (596_049_920, "qwen3-0.6b"), (70e9, "llama3-70b"), (175e9, "gpt3-175b"), (800e9, "llama3.1-405b"),
])  # fmt: skip
def test_params_within_reach_keep_the_nearest_shape(n, name):
    """Defect 7: inside the table's reach nothing changes (8e9 stays N = 8,000,000,000 on Qwen3-8B's shape)."""
    model = canonical_model(int(n))
    assert model.shape.name == name and model.n_params == int(n)


def test_every_accepted_params_fits_its_shape():
    """Defect 7: wherever --params is accepted, the shape's parameters outside the layers (embedding, final
    norm, output layer) are fewer than N, and N is within REACH of the shape's own count."""
    for k in range(1, 200):
        n = int(10 ** (8 + k * 0.02))  # 1e8 ... 1e12, 2% steps in log
        try:
            model = canonical_model(n)
        except InputError:
            continue
        counts = param_counts(model.shape)
        assert counts.total - counts.layers < n
        assert counts.total / REACH <= n <= counts.total * REACH
