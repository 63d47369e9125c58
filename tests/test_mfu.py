"""`memcalc mfu`: the published conventions reproduce their published numbers."""

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.cli.groups import ModelOptions
from memcalc.errors import InputError
from memcalc.model.gpus import gpu
from memcalc.model.tricks import parse_tricks
from memcalc.time.mfu import mfu_report, tokens_per_gpu_second


def by_key(report):
    return {c.convention: c for c in report.conventions}


def test_korthikanti_table5_gpt3():
    # Korthikanti et al. 2022, Table 5: GPT-3 175B on 64 A100s (312 TFLOP/s), global batch 64, seq 2048,
    # vocab 51200, selective recompute, 13.75 s per iteration -> MFU 51.4%, HFU 52.8%
    model = ModelOptions(model="gpt3-175b", vocab="51200").resolve()
    rate = tokens_per_gpu_second(None, 13.75, 64, 2048, 64)
    row = by_key(mfu_report(model, gpu("a100-80gb"), parse_tricks("bf16,selective"), 2048, rate))["korthikanti"]
    assert round(row.mfu * 100, 1) == 51.4
    assert round(row.hfu * 100, 1) == 52.8


def test_nanogpt_flops_per_token():
    # nanoGPT model.py estimate_mfu: 6N + 12·L·H·Q·T with N less the position table; GPT-2 124M with
    # nanoGPT's vocabulary padded to 50304: N = 123,689,472 -> 855,383,040 FLOPs per token at T = 1024
    model = ModelOptions(model="gpt2", vocab="50304").resolve()
    row = by_key(mfu_report(model, gpu("a100-40gb"), parse_tricks("bf16"), 1024, 1.0))["palm"]
    assert row.model_flops_per_token == 855_383_040


def test_conventions_disagree_and_causal_is_lowest_with_attention():
    model = ModelOptions(params="8e9").resolve()
    rows = by_key(mfu_report(model, gpu("h100-sxm"), parse_tricks("bf16,ckpt"), 8192, 3000.0))
    assert rows["causal"].mfu < rows["palm"].mfu
    assert rows["6n"].hfu / rows["6n"].mfu == pytest.approx(8 / 6)
    assert rows["torchtitan"].hfu == rows["torchtitan"].mfu  # torchtitan leaves recompute out


def test_throughput_inputs():
    assert tokens_per_gpu_second(None, 2.0, 8, 1024, 4) == 1024.0
    with pytest.raises(InputError, match="not both"):
        tokens_per_gpu_second(5.0, 2.0, 8, 1024, 4)
    with pytest.raises(InputError, match="give --tokens-per-sec"):
        tokens_per_gpu_second(None, 2.0, None, 1024, 4)


def test_cli_mfu():
    args = ["mfu", "--model", "gpt3-175b", "--vocab", "51200", "--seq", "2048", "--gpu", "a100-80gb",
            "--step-time", "13.75", "--global-batch", "64", "--gpus", "64", "--tricks", "bf16,selective"]  # fmt: skip
    out = CliRunner().invoke(app, args + ["--format", "json"])
    assert out.exit_code == 0, out.output
    rows = {c["convention"]: c for c in json.loads(out.stdout)["conventions"]}
    assert round(rows["korthikanti"]["mfu"], 3) == 0.514
    table = CliRunner().invoke(app, args)
    assert "51.4%" in table.stdout and "52.8%" in table.stdout
    bad = CliRunner().invoke(app, ["mfu", "--params", "8e9", "--tokens-per-sec", "-3"])
    assert bad.exit_code == 2 and "positive" in bad.stderr


def test_one_hfu_everywhere():
    """Issue 10, defect 11: at the throughput estimate predicts, `memcalc mfu` gives estimate's HFU (flash's
    backward QKᵀ and the recompute counted from the kernels), and estimate's CSV carries the hardware FLOPs
    behind its own hfu column."""
    run = CliRunner().invoke
    for tricks in ("bf16,flash", "bf16,flash,ckpt", "bf16,selective"):
        est = json.loads(run(app, ["estimate", "--params", "8e9", "--seq", "8192", "--tricks", tricks,
                                   "--format", "json"]).stdout)["time"][0]  # fmt: skip
        rate = est["tokens_per_second"]
        out = run(app, ["mfu", "--params", "8e9", "--seq", "8192", "--tricks", tricks, "--tokens-per-sec", repr(rate),
                        "--format", "json"])  # fmt: skip
        ours = {c["convention"]: c for c in json.loads(out.stdout)["conventions"]}["memcalc"]
        assert ours["hfu"] == pytest.approx(est["hfu"], rel=1e-12), tricks
        assert ours["mfu"] == pytest.approx(est["mfu"], rel=1e-12), tricks
        row = next(csv.DictReader(io.StringIO(run(app, ["estimate", "--params", "8e9", "--seq", "8192", "--tricks",
                                                        tricks, "--format", "csv"]).stdout)))  # fmt: skip
        hfu = float(row["hardware_flops_per_token"]) * float(row["tokens_per_second"]) / 989e12
        assert hfu == pytest.approx(float(row["hfu"]), abs=1e-4), tricks
