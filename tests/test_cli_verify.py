"""`memcalc verify` through the CLI: meta, the matrix, the distributed check, bad input. (The issue's command at full
size: tests/test_verify_meta.py.)"""

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.verification.results import Row, VerifyResult

pytest.importorskip("torch")


def run(*args):
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1"})


# The command, `memcalc verify --device meta --tricks bf16,flash,ckpt --params 8e9 --seq 8192`,
# is tests/test_verify_meta.py::test_the_issue_command_end_to_end: its output is checked there, with
# what verify measured inside it (one 8B measurement for both).


def test_json_rows_carry_error_and_pass():
    # GPT-2 cut to 2 of its 12 layers (for time): every row and field is there at any depth, and
    # test_verify_meta.py measures the full depth of 8B models
    out = run("verify", "--device", "meta", "--model", "gpt2", "--layers", "2", "--seq", "1024", "--tricks",
              "bf16,flash", "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["passed"] is True and data["device"] == "meta"
    judged = [r for r in data["rows"] if r["passed"] is not None]
    assert judged and all(r["passed"] and r["error"] == 0 for r in judged)


def test_distributed_check_on_the_fake_process_group():
    # GPT-2 at full width, 2 layers, as in test_verify_distributed.py (only the layer count is cut for time)
    out = run("verify", "--model", "gpt2", "--layers", "2", "--seq", "1024", "--tricks", "bf16", "--fsdp", "8",
              "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["world"] == 8 and data["backend"] == "fake"


def test_a_failed_row_exits_1(monkeypatch):
    import verify.run

    def failing(*args, **kwargs):
        row = Row("whole-step peak", "bytes", 1, 100, 200, 0.03)
        return VerifyResult("m", "o", "gpt", "bf16", "meta", "test", "x", "eager", None, 8, 1, 1, 2, 2, "", 0.03,
                            (row,), None, None, None, 0.0)  # fmt: skip

    monkeypatch.setattr(verify.run, "verify", failing)
    out = run("verify", "--device", "meta", "--model", "gpt2")
    assert out.exit_code == 1 and "FAIL" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["verify", "--model", "gpt2", "--device", "tpu"], "unknown device"),
    (["verify", "--model", "gpt2", "--tol", "2"], "tol must be a fraction"),
    (["verify", "--model", "gpt2", "--tricks", "bf16,warp"], "unknown trick"),
    (["verify", "--model", "gpt2", "--steps", "0"], "steps must be positive"),
    (["verify", "--model", "gpt2", "--fsdp", "8", "--tricks", "fp16"], "fp16"),
    (["verify", "--model", "gpt2", "--seq", "1024", "--tp", "5"], "must divide"),
    (["verify", "--model", "gpt2", "--fsdp", "4", "--dist-device", "tpu"], "unknown verify device"),
    (["verify", "--model", "gpt2", "--seq", "4096"], "learned position table"),
    # accepted and ignored before: it picks where --fsdp/--tp run their ranks
    (["verify", "--model", "gpt2", "--dist-device", "cpu-gloo"], "--dist-device applies to --fsdp and --tp"),
    (["verify", "--model", "gpt2", "--dist-device", "meta", "--matrix"], "--dist-device applies to --fsdp and --tp"),
])  # fmt: skip
def test_bad_input(args, message):
    out = run(*args)
    assert out.exit_code == 2, out.output
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
