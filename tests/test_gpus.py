"""The GPU table, --gpu FILE.json, --gpu-memory and the headroom every fit verdict keeps back (docs/gpus.md)."""

import itertools
import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.model.gpus import GPUS, MIB, gpu
from memcalc.model.headroom import (ALLOCATOR_SHARE, CONTEXT_BYTES, NCCL_BUFFSIZE, allocator_room, cublas_workspace,
                                    headroom, usable_bytes)  # fmt: skip
from memcalc.model.presets import preset_model
from memcalc.parallel.plan import plan

RUN = CliRunner()


def cli(*args: str):
    return RUN.invoke(app, list(args), env={"COLUMNS": "100", "NO_COLOR": "1"})


@pytest.mark.parametrize("key", list(GPUS))
def test_every_card_answers_by_name(key):
    r = cli("estimate", "--model", "gpt2", "--seq", "512", "--gpu", key)
    assert r.exit_code == 0, r.output
    assert "Headroom" in r.stdout and key in r.stdout


@pytest.mark.parametrize("key", ["t4", "v100-16gb", "v100-32gb"])
@pytest.mark.parametrize("command", ["estimate", "fit"])
def test_bf16_refused_without_bf16_tensor_cores(key, command):
    r = cli(command, "--model", "gpt2", "--seq", "512", "--tricks", "bf16,flash", "--gpu", key)
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "bf16 needs bf16 tensor cores" in r.output and "use fp16" in r.output
    assert cli(command, "--model", "gpt2", "--seq", "512", "--tricks", "fp16,flash", "--gpu", key).exit_code == 0


def test_mfu_and_plan_refuse_bf16_on_volta():
    """A bf16 named is refused; their default runs in fp16 there (tests/test_trick_rules.py)."""
    mfu = cli("mfu", "--model", "gpt2", "--tokens-per-sec", "1000", "--gpu", "v100-32gb", "--tricks", "bf16")
    assert mfu.exit_code == 2 and "bf16 needs bf16 tensor cores" in mfu.output
    p = cli("plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "64", "--gpu", "t4", "--tricks", "bf16,flash")
    assert p.exit_code == 2 and p.output.count("\n") == 1 and "use fp16" in p.output
    assert cli("mfu", "--model", "gpt2", "--tokens-per-sec", "1000", "--gpu", "v100-32gb").exit_code == 0


def test_consumer_peaks_are_fp32_accumulate():
    """Ada whitepaper: RTX 4090 FP16 tensor with FP32 accumulate 165.2 dense, half the 330.3 of FP16 accumulate."""
    assert gpu("rtx4090").bf16_tflops == 165.2 and gpu("rtx3090").bf16_tflops == 71


A40 = {"key": "a40", "name": "NVIDIA A40 48GB", "memory_mib": 46068, "bandwidth_gbps": 696, "bf16_tflops": 149.7,
       "fp16_tflops": 149.7, "tf32_tflops": 74.8, "fp32_tflops": 37.4, "source": "A40 datasheet"}  # fmt: skip


def write(tmp_path, data) -> str:
    path = tmp_path / "card.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_card_from_a_file(tmp_path):
    r = cli("estimate", "--model", "gpt2", "--seq", "512", "--gpu", write(tmp_path, A40), "--format", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["gpu"]["key"] == "a40" and data["gpu"]["memory_bytes"] == 46068 * MIB
    room = data["headroom"]["total_bytes"] - data["headroom"]["allocator_bytes"]  # a replayed step: no share kept
    assert data["verdict"][0]["usable_bytes"] == 46068 * MIB - room


MINIMAL = {"name": "NVIDIA A40 48GB", "memory_mib": 46068, "bf16_tflops": 149.7}  # what a datasheet's first lines say
MINIMAL_SAYS = ("warning: a40 (NVIDIA A40 48GB): fp16_tflops = bf16_tflops (every bf16 card's datasheet gives one "
                "figure for both); no fp32_tflops, bandwidth_gbps: step time by --mfu end to end (0.4 unless given), "
                "not the roofline; fp32 refused")  # fmt: skip


def test_a_minimal_file_is_a_card(tmp_path):
    """name, memory and one peak rate: the key is the file's stem, the source the file; fp16 runs at the bf16
    rate; what the roofline needs and the file lacks is unknown, and the step is timed end to end instead."""
    path = tmp_path / "a40.json"
    path.write_text(json.dumps(MINIMAL))
    r = cli("estimate", "--model", "gpt2", "--seq", "512", "--gpu", str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [MINIMAL_SAYS]
    data = json.loads(r.stdout)
    g = data["gpu"]
    assert (g["key"], g["source"], g["fp16_tflops"], g["fp32_tflops"], g["bandwidth_gbps"]) == ("a40", str(path),
                                                                                                 149.7, 0, 0)
    assert [v["tricks"][0] for v in data["verdict"]] == ["bf16"] * 4  # the progression without its fp32 row
    table = cli("estimate", "--model", "gpt2", "--seq", "512", "--gpu", str(path))
    assert "step time: hardware FLOPs at 40.0% of peak (the card's file gives no fp32_tflops, bandwidth_gbps " \
           "for the roofline)" in " ".join(table.stdout.split())  # fmt: skip
    for args in (["plan", "--gpus", "8", "--global-batch", "8"], ["fit"], ["mfu", "--tokens-per-sec", "1000"]):
        done = cli(*args, "--model", "gpt2", "--gpu", str(path))
        assert done.exit_code == 0 and done.stderr.splitlines() == [MINIMAL_SAYS], done.output
    for args, says in ((["--tricks", "fp32"], "fp32 needs the card's fp32_tflops, which "),
                       (["--calibration", "matmul=0.5"], "--calibration tunes the roofline, which needs ")):
        refused = cli("estimate", "--model", "gpt2", "--gpu", str(path), *args)
        assert refused.exit_code == 2 and refused.output.count("\n") == 1 and says in refused.output, refused.output


def test_a_file_without_a_16_bit_rate_times_fp32_alone(tmp_path):
    """The default leaves out the sets the card has no peak for (and says nothing of Volta); the roofline,
    asked of a card whose file lacks its rates from Python, is one InputError rather than a division by 0."""
    from memcalc import Job, Layout, Setup, answer, parse_tricks
    from memcalc.errors import InputError
    from memcalc.model.gpu_file import load_gpu

    old = write(tmp_path, {"name": "Old card", "memory_mib": 16000, "fp32_tflops": 10, "bandwidth_gbps": 500})
    r = cli("estimate", "--model", "gpt2", "--seq", "512", "--gpu", old, "--format", "json")
    assert r.exit_code == 0 and r.stderr.splitlines() == ["warning: card (Old card): no fp16_tflops: fp16 refused"]
    assert [v["tricks"] for v in json.loads(r.stdout)["verdict"]] == [["fp32"]]
    minimal = load_gpu(write(tmp_path, MINIMAL))
    with pytest.raises(InputError, match="the roofline needs the card's fp32_tflops and bandwidth_gbps"):
        answer(Job(preset_model("gpt2"), Setup(seq_len=512), minimal, Layout(), (parse_tricks("bf16"),), None))


@pytest.mark.parametrize("change, says", [
    ({"memory_mib": None}, "missing field 'memory_mib'"),
    ({"bf16_tflops": None, "fp16_tflops": None, "fp32_tflops": None},
     "needs a peak rate: bf16_tflops, fp16_tflops or fp32_tflops"),
    ({"name": None}, "missing field 'name'"),
    ({"fp32_tflops": 0}, "fp32_tflops must be a positive number"),
    ({"fp16_tflops": 0}, "fp16_tflops must be a positive number"),
    ({"bf16_tflops": -1}, "bf16_tflops must be a positive number"),
    ({"colour": "green"}, "unknown field 'colour'"),
    ({"key": "h100-sxm"}, "is a card in memcalc's table"),
    ({"intra": "carrier-pigeon"}, "unknown intra link"),
    ({"memory_mib": 2.5}, "memory_mib must be a whole number"),
])  # fmt: skip
def test_a_bad_file_is_one_line(tmp_path, change, says):
    data = {k: v for k, v in {**A40, **change}.items() if v is not None}
    r = cli("estimate", "--model", "gpt2", "--gpu", write(tmp_path, data))
    assert r.exit_code == 2 and r.output.count("\n") == 1 and says in r.output, r.output


def test_gpu_memory_caps_the_card():
    r = cli("fit", "--model", "gpt2", "--gpu", "h100-sxm", "--gpu-memory", "24GB", "--format", "json")
    assert r.exit_code == 0, r.output
    limits = json.loads(r.stdout)
    fixed = limits["headroom"]["total_bytes"] - limits["headroom"]["allocator_bytes"]
    assert limits["usable_bytes"] == 24 * 10**9 - fixed  # the allocator's room: its reserve is replayed
    over = cli("estimate", "--model", "gpt2", "--gpu", "rtx4090", "--gpu-memory", "25GiB")
    assert over.exit_code == 2 and "more than the NVIDIA GeForce RTX 4090" in over.output
    assert cli("estimate", "--model", "gpt2", "--gpu-memory", "lots").exit_code == 2


def test_headroom_is_its_parts():
    """Context + two threads' cuBLAS workspaces (32 MiB + 1 MiB each on sm90, CublasHandlePool.cpp) + NCCL per
    communicator + the allocator's 5% of what is left; on screen and in JSON alike."""
    h = headroom(gpu("h100-sxm"), (2, 1, 1, 4, 1))
    assert (h.communicators, h.cublas_bytes, h.nccl_bytes) == (2, 2 * 33 * MIB, 2 * 16 * 2 * NCCL_BUFFSIZE)
    fixed = CONTEXT_BYTES + h.cublas_bytes + h.nccl_bytes
    assert h.allocator_bytes == int((gpu("h100-sxm").memory_bytes - fixed) * ALLOCATOR_SHARE)
    assert h.total_bytes == fixed + h.allocator_bytes
    assert cublas_workspace("sm80") == 8 * MIB + 128 * 1024 + MIB and cublas_workspace("gfx942") == 204 * MIB
    r = cli("estimate", "--model", "gpt2", "--gpus", "8", "--zero", "1", "--format", "json")
    room = json.loads(r.stdout)["headroom"]
    parts = ("context_bytes", "cublas_bytes", "nccl_bytes", "allocator_bytes")
    assert room["total_bytes"] == sum(room[k] for k in parts)
    text = " ".join(cli("estimate", "--model", "gpt2", "--gpus", "8", "--zero", "1").stdout.split())  # wrapped
    assert "Headroom 0.650 GB" in text and "NCCL 0.134 GB" in text and "the rest the caching allocator's, replayed" in text
    assert "expandable_segments" not in text and "a default" not in text  # replayed: no share kept back
    kept = " ".join(cli("estimate", "--model", "gpt2", "--gpus", "8", "--zero", "1", "--headroom", "5%").stdout.split())
    assert "Headroom 4.894 GB" in kept and "allocator 5% 4.244 GB (--headroom 5%)" in kept
    at_the_limit = " ".join(cli("fit", "--model", "gpt2", "--headroom", "5%").stdout.split())  # the edge
    assert "within the allocator's 5% of the limit: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in at_the_limit
    replayed = " ".join(cli("fit", "--model", "gpt2").stdout.split())
    assert "at seq 1,024 x micro-batch 80: the caching allocator reserves" in replayed


@pytest.mark.parametrize("spec, total", [("2GB", 2 * 10**9), ("0", 0)])
def test_headroom_flag(spec, total):
    r = cli("estimate", "--model", "gpt2", "--headroom", spec, "--format", "json")
    data = json.loads(r.stdout)
    assert data["headroom"]["total_bytes"] == total
    assert data["verdict"][0]["usable_bytes"] == data["gpu"]["memory_bytes"] - total
    share = json.loads(cli("estimate", "--model", "gpt2", "--headroom", "15%", "--format", "json").stdout)["headroom"]
    assert share["allocator_share"] == 0.15 and share["context_bytes"] == CONTEXT_BYTES
    for bad in ("150%", "-1GB", "-2GiB", "90GB"):
        r = cli("estimate", "--model", "gpt2", "--headroom", bad)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and bad in r.output, (bad, r.output)  # as typed


QUICK_PLANS = {("llama3-8b", 8, "rtx4090"), ("gpt2", 16, "h100-sxm")}  # a 24 GB card an 8B barely fits; a wide search


@pytest.mark.parametrize("name,gpus,key", [
    p if p in QUICK_PLANS else pytest.param(*p, marks=pytest.mark.slow(f"the same for {sorted(QUICK_PLANS)}"))
    for p in itertools.product(["gpt2", "llama3-8b"], [8, 16], ["h100-sxm", "rtx4090"])])  # fmt: skip
def test_plan_never_ranks_a_layout_over_usable_less_headroom(name, gpus, key):
    card = gpu(key)
    p = plan(preset_model(name), card, gpus, 1024, 64, top=3)
    for est in p.best:
        room = headroom(card, est.layout.groups)
        assert est.headroom == room
        v = est.verdict  # the allocator's share kept back, or its room with its reserve replayed near the limit
        usable = usable_bytes(card, est.layout.groups) if v.keeps_share else allocator_room(card, est.layout.groups)
        assert v.total_bytes <= usable == v.usable_bytes
        assert usable == card.memory_bytes - room.total_bytes + (0 if v.keeps_share else room.allocator_bytes)
