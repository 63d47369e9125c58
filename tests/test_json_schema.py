"""`memcalc estimate --format json`: one schema with or without a layout, one step time (issue 12, item 4).

A layout used to switch to other top-level keys (and to {"layouts": [...]} with several trick sets), and
the one-GPU JSON carried two step times: the roofline's and an MFU-based one under `compute`.
"""

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.memory.estimate import Setup, estimate
from memcalc.model.gpus import gpu
from memcalc.model.presets import preset_model
from memcalc.model.tricks import parse_tricks
from memcalc.time.calibration import calibration_for
from memcalc.time.roofline import rooflines

JOB = ["estimate", "--model", "llama3-8b", "--seq", "4096"]


def estimate_json(*args: str) -> dict:
    out = CliRunner().invoke(app, [*JOB, *args, "--format", "json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def element_keys(data: dict) -> dict[str, set[str]]:
    """The keys of each list's entries (those that are objects), per top-level key."""
    return {k: set().union(*(x for x in v if isinstance(x, dict))) for k, v in data.items()
            if isinstance(v, list) and v and isinstance(v[0], dict)}  # fmt: skip


ONE_GPU = estimate_json()


@pytest.mark.parametrize("args", [
    ("--tp", "1"), ("--tp", "2", "--pp", "2"), ("--tp", "2", "--sp", "--dp", "4", "--zero", "1", "--tokens", "1e12"),
    ("--tricks", "bf16,flash", "--tp", "1"), ("--mfu", "0.4"), ("--tp", "2", "--mfu", "0.4"), ("--exact",),
    ("--gpus", "8", "--zero", "3"), ("--tp", "2", "--exact", "--tricks", "bf16,flash"),
    ("--timeline", "--tricks", "bf16,flash", "--tricks", "bf16,flash,ckpt"),
])  # fmt: skip
def test_one_schema(args):
    """The same top-level keys in the same order, and the same keys in every `memory` and `time` entry,
    for one GPU, a layout, several trick sets or one, --mfu or the roofline, --exact, --timeline."""
    data = estimate_json(*args)
    assert list(data) == list(ONE_GPU)
    keys = element_keys(data)
    for key in ("memory", "time"):
        assert keys[key] == element_keys(ONE_GPU)[key], key
    assert len(data["memory"]) == len(data["time"]) == len(data["trick_sets"])


def test_a_layout_of_one_gpu_is_the_one_gpu_job():
    """--tp 1 (or --dp 1, --gpus 1) is the job of one GPU: the same object, so the same JSON to the byte."""
    for args in (("--tp", "1"), ("--dp", "1"), ("--gpus", "1")):
        assert estimate_json(*args) == ONE_GPU, args
    assert ONE_GPU["layout"]["world"] == 1 and all(v["phases"] for v in ONE_GPU["verdict"])


def test_one_step_time_the_roofline_s():
    """The one-GPU JSON's step time is the roofline's, to the byte; no second, MFU-based one; the MFU and HFU
    are derived from it; the kernels keep their own detail."""
    assert "compute" not in ONE_GPU and ONE_GPU["time_model"] == "roofline"
    model, g = preset_model("llama3-8b"), gpu("h100-sxm")
    trick_sets = tuple(parse_tricks(t) for t in ("fp32", "bf16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective"))
    times = rooflines(model, Setup(seq_len=4096), g, trick_sets, calibration_for("h100-sxm"))
    for t, time, kernels in zip(times, ONE_GPU["time"], ONE_GPU["roofline"], strict=True):
        for key in ("step_seconds", "tokens_per_second", "mfu", "hfu"):
            assert time[key] == pytest.approx(getattr(t, key), rel=1e-12), key
        assert time["mfu"] == pytest.approx(time["model_flops"] / (time["step_seconds"] * time["peak_flops"]), 1e-12)
        assert sum(time["breakdown"].values()) == pytest.approx(time["step_seconds"], rel=1e-12)
        assert not {"step_seconds", "tokens_per_second", "mfu", "hfu"} & set(kernels) and kernels["ops"]


def test_mfu_times_the_step_once():
    """--mfu X: the step is the executed FLOPs at X of peak (memcalc.memory.estimate.Compute), nothing else."""
    data = estimate_json("--mfu", "0.4")
    est = estimate(preset_model("llama3-8b"), Setup(seq_len=4096, mfu=0.4), gpu("h100-sxm"))
    assert data["time_model"] == "mfu" and data["roofline"] == [] and data["calibration"] is None
    for c, time in zip(est.compute, data["time"], strict=True):
        for key in ("step_seconds", "mfu", "hfu"):
            assert time[key] == pytest.approx(getattr(c, key), rel=1e-12), key
        assert sum(time["breakdown"].values()) == pytest.approx(c.step_seconds, rel=1e-12)


def test_layout_memory_is_its_peak_stage_and_time_the_job_s():
    """With a layout `memory` is the stage that peaks (so `fits` is the layout's), `stages` holds each
    stage, `time` the job's tokens over its GPUs with the traffic listed and its exposed part in the
    breakdown."""
    data = estimate_json("--tp", "2", "--pp", "4", "--dp", "2", "--zero", "1", "--tricks", "bf16,flash,ckpt")
    (stages,), (memory,), (time,) = data["stages"], data["memory"], data["time"]
    assert len(stages) == 4 and memory["total_bytes"] == max(st["total_bytes"] for st in stages)
    assert memory["fits"] == all(st["fits"] for st in stages)
    peak = max(stages, key=lambda st: st["total_bytes"])
    assert data["model_state"] == peak["state"]
    assert time["gpus"] == data["layout"]["world"] == 16
    assert time["tokens_per_step"] == 2 * 4096  # dp · b · m · s
    assert {c["group"] for c in time["comms"]} == {"tp", "pp", "dp×cp"}
    exposed = sum(c["exposed_seconds"] for c in time["comms"])
    assert sum(time["breakdown"].values()) == pytest.approx(time["step_seconds"], rel=1e-12)
    assert time["breakdown"]["tp"] + time["breakdown"]["pp"] + time["breakdown"]["dp×cp"] == pytest.approx(exposed)


def test_gpus_alone_is_data_parallelism_over_them():
    """Issue 18: --gpus N without a layout is the job --dp N is: the same JSON to the byte, its step timed with
    its traffic (ZeRO-3's gathers and reduce-scatters), its tokens N times one GPU's."""
    data = estimate_json("--gpus", "8", "--zero", "3", "--tricks", "bf16,flash")
    assert data == estimate_json("--dp", "8", "--zero", "3", "--tricks", "bf16,flash")
    (time,), (one,) = data["time"], estimate_json("--tricks", "bf16,flash")["time"]
    assert data["layout"]["dp"] == 8 and data["layout"]["zero"] == 3 and data["layout"]["world"] == 8
    assert time["tokens_per_step"] == 8 * one["tokens_per_step"] and {c["group"] for c in time["comms"]} == {"dp×cp"}
    # the same forward and backward on each GPU; the optimizer steps over an eighth of the parameters
    assert time["breakdown"]["compute"] == pytest.approx(one["breakdown"]["compute"], rel=1e-12)
    assert time["breakdown"]["optimizer"] < one["breakdown"]["optimizer"] / 4  # each launch costs its floor still
