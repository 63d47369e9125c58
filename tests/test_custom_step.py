"""memcalc verify --step: the user's own model and step measured (verify/custom.py), memcalc's prediction beside it."""

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

pytest.importorskip("torch")

EXAMPLE = "examples/custom_step.py:build"


def run(*args, layers="2"):
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "100", "CUSTOM_STEP_LAYERS": layers})


def rows_of(out) -> dict:
    assert out.exit_code == 0, out.output
    return {r["quantity"]: r for r in json.loads(out.stdout)["rows"]}


def test_a_llama_written_from_scratch_against_the_reference_stack():
    # examples/custom_step.py is Llama 3 8B in plain PyTorch, fp32 with torch.optim.AdamW (its for-loop): the same
    # parameters as the preset to the element, and forward and backward within 0.1% of the reference stack's
    # replay (the differences are the user's RoPE and the fused gate/up matmul, a few MB in GBs)
    rows = rows_of(run("verify", "--step", EXAMPLE, "--model", "llama3-8b", "--layers", "2", "--tricks", "fp32",
                       "--seq", "512", "--format", "json"))  # fmt: skip
    assert rows["parameters"]["measured"] == rows["parameters"]["exact"] == 1_486_901_248
    for q in ("saved for backward", "forward peak", "backward peak", "live between steps"):
        assert abs(rows[q]["error"]) < 1e-3, (q, rows[q])
    # the loop AdamW's temporaries over the reference's: the user's optimizer peak is higher, and shown so
    assert rows["optimizer-step peak"]["measured"] > rows["optimizer-step peak"]["exact"]
    # against the stack the example trains with, torch.optim's AdamW for-loop: the optimizer step adds to the
    # state what the stack's does, to the byte (what lives between steps differs by the example's RoPE tables)
    rows = rows_of(run("verify", "--step", EXAMPLE, "--model", "llama3-8b", "--layers", "2", "--tricks", "fp32",
                       "--seq", "512", "--stack", "torch", "--optimizer-impl", "loop", "--format", "json"))  # fmt: skip
    state, opt = rows["live between steps"], rows["optimizer-step peak"]
    assert opt["measured"] - opt["exact"] == state["measured"] - state["exact"]
    assert 0 < abs(state["measured"] - state["exact"]) < 1 << 20


def test_without_a_model_the_step_is_measured_alone():
    out = run("verify", "--step", EXAMPLE, "--seq", "256", layers="1")
    assert out.exit_code == 0, out.output
    assert "no model given" in out.output and "Your step peaks at" in out.output
    rows = rows_of(run("verify", "--step", EXAMPLE, "--seq", "256", "--format", "json", layers="1"))
    assert all(r["exact"] is None for r in rows.values())
    assert rows["parameters"]["measured"] == 4096 * (2 * 128256 + 1) + 4096 * (4096 + 2048 + 4096 + 2 * 14336 + 2) + 14336 * 4096


TINY = '''
import torch

def build(device, seq_len, micro_batch):
    model = torch.nn.Linear(64, 64, bias=False)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.ones(micro_batch, seq_len, 64, device=device)
    return model, opt, lambda: model(x).square().mean()

def broken(device, seq_len, micro_batch):
    model = torch.nn.Linear(64, 64)
    return model, None, lambda: model(torch.ones(3, 65, device=device)).sum()

def not_a_step(device, seq_len, micro_batch):
    return torch.nn.Linear(4, 4)
'''


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return str(path)


@pytest.mark.parametrize("device, step_count", [("meta", 0), ("cpu", 4)])
def test_the_state_of_a_tiny_step_by_hand(tiny, device, step_count):
    # weights 64x64 fp32 (16,384 B), AdamW's exp_avg and exp_avg_sq (2 x 16,384 B), the input the step keeps
    # (8 x 64 fp32, 2,048 B); AdamW's step count is a 4-byte fp32 tensor on the CPU whatever the parameters'
    # device (torch/optim/adamw.py _init_group, not fused or capturable): counted only when the step runs on cpu
    rows = rows_of(run("verify", "--step", f"{tiny}:build", "--seq", "8", "--device", device, "--format", "json"))
    assert rows["live between steps"]["measured"] == 3 * 16_384 + 2_048 + step_count
    assert rows["parameters"]["measured"] == 4096


@pytest.mark.parametrize(
    "args, says",
    [
        (["--step", "nocolon"], "--step takes MODULE:FUNCTION"),
        (["--step", "missing.py:build"], "no file missing.py"),
        (["--step", "no_such_module_xyz:build"], "cannot import no_such_module_xyz"),
        (["--step", "{tiny}:nothing"], "has no function nothing"),
        (["--step", "{tiny}:broken"], "your step raised RuntimeError"),
        (["--step", "{tiny}:not_a_step"], "must return (model, optimizer, loss)"),
        (["--step", "{tiny}:build", "--matrix"], "--matrix does not apply to --step"),
        (["--step", "{tiny}:build", "--fsdp", "2"], "--fsdp/--tp/--sp does not apply to --step"),
        (["--step", "{tiny}:build", "--matrix", "--tol", "0.1"], "--matrix and --tol do not apply to --step"),
        (["--step", "{tiny}:build", "--device", "cuda"], "measures on meta or cpu"),
    ],
)
def test_bad_steps_are_one_line_and_exit_2(tiny, args, says):
    out = run("verify", *[a.replace("{tiny}", tiny) for a in args], "--seq", "8")
    assert out.exit_code == 2, out.output
    assert says in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1, out.output


def test_the_broken_step_says_where_in_the_users_file(tiny):
    out = run("verify", "--step", f"{tiny}:broken", "--seq", "8")
    assert "tiny.py:" in out.output
