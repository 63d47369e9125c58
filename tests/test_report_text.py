"""How figures read: two that a sentence compares differ in print when they differ, one GPU is singular,
and verify's sizes follow --units."""

import re

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.report import units as u

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
MISS = "estimate --model qwen3-4b --gpu h200 --tricks bf16,flash"  # 47,532 tokens on tp 2 miss by 1 MB
# 11,776 tokens peak at 150,220,193,640 bytes; a headroom of 536,626 KB leaves the h200 (150,754,820,096 bytes)
# 2 MB short of it (a headroom given: the peak against what it leaves, the allocator not replayed)


def run(args: str):
    out = CliRunner().invoke(app, args.split(), env=ENV)
    assert out.exit_code == 0, out.output[-500:]
    return out.stdout


def test_a_pair_of_sizes_gets_the_digits_that_tell_them_apart():
    assert u.size_pair(150_210_000_000, 150_212_000_000) == ("150.210 GB", "150.212 GB")
    assert u.size_pair(150_210_000_000, 150_210_000_001) == ("150.210000000 GB", "150.210000001 GB")
    assert u.size_pair(150_210_000_000, 150_210_000_000) == ("150.2 GB", "150.2 GB")  # equal: as size() prints
    assert u.size_pair(8e9, 9e9, "gib") == (u.size(8e9, "gib"), u.size(9e9, "gib"))  # distinct already
    assert u.size_pair(2_000_000, 0) == ("0.002 GB", "0.000 GB") and u.size_pair(200_000, 0)[0] == "0.0002 GB"


@pytest.mark.parametrize("args, pattern", [
    (f"{MISS} --seq 11776 --headroom 536626KB", r"needs ([\d.,]+ GB) at its peak, of the ([\d.,]+ GB) usable"),
    (f"{MISS} --seq 47532 --tp 2", r"needs ([\d.,]+ GB) of the ([\d.,]+ GB) usable"),
])  # fmt: skip
def test_a_verdict_that_misses_by_megabytes_shows_the_difference(args, pattern):
    """"needs 150.2 GB at its peak, of the 150.2 GB usable": it did not fit by 2 MB."""
    verdict = [line for line in run(args).splitlines() if line.startswith("Does not fit")][0]
    needs, usable = re.search(pattern, verdict).groups()
    assert needs != usable and float(needs.split()[0]) > float(usable.split()[0]), verdict


def test_a_stage_over_by_kilobytes_is_not_zero_over():
    """A fits? cell "no, 0.000 GB over" (the whole-step peak 2 MB over, 0.2 MB with a layout's)."""
    from memcalc.report.estimate import fit_text

    class Over:
        free_bytes, host_fits = -200_000, True

    assert fit_text(Over, "gb") == "no, 0.0002 GB over"


def test_one_gpu_is_singular():
    """"= 1 GPUs", "Cluster totals over 1 GPUs", "x 1 data-parallel GPUs": one GPU reads as one."""
    for args in ("--tokens 1e12 --detail", "--dp 1 --tokens 1e12 --detail", "--gpus 8 --zero 1 --tokens 1e12 --detail",
                 "--tp 2 --tokens 1e12 --detail", "--tp 2 --pp 2 --gpus 4"):  # fmt: skip
        out = run(f"estimate --params 8e9 --tricks bf16,flash {args}")
        assert not re.search(r"\b1 GPUs\b", out), (args, [line for line in out.splitlines() if "1 GPUs" in line])
    assert "on 1 GPU\n" in run("estimate --params 8e9 --tricks bf16,flash --tokens 1e12")
    assert "Cluster totals over 2 GPUs" in run("estimate --params 8e9 --tricks bf16,flash --tp 2 --detail")


@pytest.mark.parametrize("units, label, other", [("gb", " GB", " GiB"), ("gib", " GiB", " GB")])
def test_verify_notes_follow_units(units, label, other):
    """verify --stack hf printed its CUDA prediction in GiB among GB rows."""
    pytest.importorskip("torch")
    out = run(f"verify --device meta --model gpt2 --layers 2 --seq 128 --stack hf --units {units}")
    assert "the CUDA prediction at the size asked" in out and label in out
    assert other not in out.replace(" GB/s", ""), [line for line in out.splitlines() if other in line]
