"""Numbers no float or int conversion holds, on every option that reads one: one line, exit code 2."""

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
WIDE = "1" + "0" * 309  # 1e309: an int no float holds (OverflowError in float() before the fix)
LONG = "9" * 5000  # past Python's 4,300-digit int conversion limit (ValueError from int())
HUGE_FLOATS = ("1e999", "1" + "0" * 400 + ".5", "1e-999")  # inf, inf, 0.0
ESTIMATE = "estimate --params 8e9 --tricks bf16"
MOE = "estimate --model mixtral-8x7b --tricks bf16"

COUNTS = [f"{ESTIMATE} --seq X", f"{ESTIMATE} --micro-batch X", f"{ESTIMATE} --grad-accum X",
          f"{ESTIMATE} --gpus X", f"{ESTIMATE} --tp X", f"{ESTIMATE} --pp X", f"{ESTIMATE} --cp X",
          f"{ESTIMATE} --dp X", f"{ESTIMATE} --vpp X", f"{ESTIMATE} --tp 2 --gpus-per-node X",
          f"{ESTIMATE} --pp 2 --pp-layers X,0", f"{ESTIMATE} --host-memory X", f"{ESTIMATE} --tokens X",
          f"{MOE} --ep X", f"{MOE} --etp X", "estimate --params X", "estimate --tricks ckpt:X --params 8e9",
          f"{ESTIMATE} --sweep seq=1k:X", f"{ESTIMATE} --sweep micro-batch=1,X",
          *(f"estimate --model llama3-8b --{flag} X" for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab")),
          "plan --model gpt2 --global-batch 8 --seq 1024 --gpus X", "plan --model gpt2 --gpus 8 --seq 1024 --global-batch X",
          "plan --model gpt2 --gpus 8 --global-batch 8 --seq X", "plan --model gpt2 --gpus 8 --global-batch 8 --top X",
          "plan --model gpt2 --gpus 8 --global-batch 8 --gpus-per-node X",
          "plan --model gpt2 --gpus 8 --global-batch 8 --host-memory X",
          "fit --params 8e9 --seq X", "fit --params 8e9 --micro-batch X", "fit --params 8e9 --gpus X",
          "fit --params 8e9 --host-memory X", "mfu --params 8e9 --seq X --tokens-per-sec 1000",
          "mfu --params 8e9 --step-time 1 --global-batch X", "mfu --params 8e9 --step-time 1 --global-batch 8 --gpus X",
          "verify --device meta --model gpt2 --seq X", "verify --device meta --model gpt2 --seq 64 --steps X",
          "verify --model gpt2 --seq 64 --fsdp X", "verify --model gpt2 --seq 64 --tp X",
          "verify --model gpt2 --seq 64 --fsdp 2 --stack fsdp2 --pp X",
          "verify --model gpt2 --seq 64 --fsdp 2 --stack fsdp2 --pp 2 --stage X",
          "verify --model gpt2 --seq 64 --fsdp 2 --stack fsdp2 --pp 2 --grad-accum X"]  # fmt: skip
FRACTIONS = [f"{ESTIMATE} --mfu X", f"{ESTIMATE} --calibration matmul=X", f"{ESTIMATE} --tokens 1e12 --price-per-gpu-hour X",
             f"{MOE} --capacity-factor X", f"{MOE} --expert-imbalance X", "plan --model gpt2 --gpus 8 --global-batch 8 --mfu X",
             "mfu --params 8e9 --tokens-per-sec X", "mfu --params 8e9 --step-time X --global-batch 8",
             "verify --device meta --model gpt2 --seq 64 --tol X"]  # fmt: skip


def one_line_exit_2(args: str) -> str:
    out = CliRunner().invoke(app, args.split(), env=ENV)
    assert out.exit_code == 2, (args, out.exit_code, repr(out.exception), out.output[-300:])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 300, (args, out.stderr[-300:])
    return lines[0]


@pytest.mark.parametrize("number", [WIDE, LONG, "1e400"], ids=["1e309 digits", "5000 digits", "1e400"])
@pytest.mark.parametrize("args", COUNTS)
def test_a_count_too_large_for_a_float_is_one_line(args, number):
    """`--seq 1` and 309 zeros was an OverflowError traceback in parse_count; 5,000 digits a ValueError."""
    one_line_exit_2(args.replace("X", number))


@pytest.mark.parametrize("number", [WIDE, LONG, *HUGE_FLOATS])
@pytest.mark.parametrize("args", FRACTIONS)
def test_a_rate_too_large_or_small_for_a_float_is_one_line(args, number):
    """Floats past the range of a double (inf) or below it (0.0), and ints no float holds."""
    one_line_exit_2(args.replace("X", number))
