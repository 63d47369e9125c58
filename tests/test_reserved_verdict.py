"""The caching allocator in the verdict (issue 42): a replayed step is held to the allocator's room (the card
less the CUDA context, cuBLAS and NCCL; memcalc.model.headroom.allocator_room) and, where its peak comes close,
to what the replayed allocator reserves there; --headroom and FSDP2 keep the old share."""

import json
from dataclasses import asdict, replace

import pytest
from typer.testing import CliRunner

from memcalc import Setup, parse_tricks, preset_model
from memcalc.cli import app
from memcalc.exact.base.config import StepConfig
from memcalc.exact.growth import as_run
from memcalc.exact.replay.meta import simulate
from memcalc.exact.replay.zero import Sharding
from memcalc.exact.reserved import MICRO_BATCHES, reserved_over, step_reserved
from memcalc.model.gpus import find_gpu
from memcalc.model.headroom import allocator_room, headroom, usable_bytes
from memcalc.model.stacks import DEFAULT_STACK
from memcalc.parallel.verdict import REPLAY_BAND, gpu_verdict

GPT2 = preset_model("gpt2")
BF16 = parse_tricks("bf16,flash")
SETUP = Setup(seq_len=1024, micro_batch=16)


def card_with_room(room_bytes: int, expandable: bool = False):
    """An h100-sxm capped so that the allocator's room is room_bytes, give or take a MiB."""
    h100 = find_gpu("h100-sxm")
    fixed = h100.memory_bytes - allocator_room(h100)
    return find_gpu("h100-sxm", f"{(room_bytes + fixed) >> 20}MiB", None, expandable)


def test_far_below_the_room_the_peak_decides_and_no_share_is_kept():
    v = gpu_verdict(GPT2, Setup(seq_len=1024), find_gpu("h100-sxm"), BF16)
    assert v.peak_bytes < (1 - REPLAY_BAND) * v.usable_bytes
    assert v.reserved is None and not v.keeps_share and v.total_bytes == v.peak_bytes
    assert v.usable_bytes == allocator_room(find_gpu("h100-sxm")) > usable_bytes(find_gpu("h100-sxm"))


def test_near_the_room_the_replayed_reserve_decides():
    peak = gpu_verdict(GPT2, SETUP, find_gpu("h100-sxm"), BF16).peak_bytes
    v = gpu_verdict(GPT2, SETUP, card_with_room(int(peak * 1.25)), BF16)
    r = v.reserved
    assert r is not None and not r.out_of_memory
    assert r.requested_bytes == v.peak_bytes  # the allocator saw the step the verdict counts
    assert v.peak_bytes <= r.allocated_bytes <= r.reserved_bytes <= v.usable_bytes
    assert v.total_bytes == r.reserved_bytes and v.fits


def test_the_allocator_runs_out_though_the_tensors_fit():
    peak = gpu_verdict(GPT2, SETUP, find_gpu("h100-sxm"), BF16).peak_bytes
    v = gpu_verdict(GPT2, SETUP, card_with_room(peak + (2 << 20)), BF16)
    assert v.peak_bytes < v.usable_bytes and not v.fits
    assert v.reserved.out_of_memory and v.reserved.reserved_bytes > v.usable_bytes
    out = " ".join(
        CliRunner()
        .invoke(
            app,
            [
                "estimate",
                "--model",
                "gpt2",
                "--micro-batch",
                "16",
                "--gpu",
                "h100-sxm",
                "--gpu-memory",
                f"{(peak + (2 << 20) + 516 * 10**6) >> 20}MiB",
            ],
        )
        .stdout.split()
    )
    assert "the tensors fit, but the caching allocator runs out" in out


def test_expandable_segments_reach_the_replay():
    """--expandable-segments replays the allocator with them (memcalc.exact.allocator.expandable): pages of 2 MiB
    (small pool) and 20 MiB (large pool), so the reserve is whole 2 MiB pages; which reserves less depends on the
    step's order of sizes, and both are shown as replayed."""
    peak = gpu_verdict(GPT2, SETUP, find_gpu("h100-sxm"), BF16).peak_bytes
    room = int(peak * 1.25)
    plain = gpu_verdict(GPT2, SETUP, card_with_room(room), BF16).reserved
    grown = gpu_verdict(GPT2, SETUP, card_with_room(room, expandable=True), BF16).reserved
    assert grown.expandable and not plain.expandable and grown != plain
    assert grown.reserved_bytes % (2 << 20) == 0 and grown.requested_bytes == plain.requested_bytes
    args = ["estimate", "--model", "gpt2", "--micro-batch", "16", "--gpu-memory", f"{int(peak * 1.25) >> 20}MiB"]
    text = " ".join(CliRunner().invoke(app, [*args, "--expandable-segments"]).stdout.split())
    assert "(expandable segments)" in text or "expandable segments)" in text


def test_headroom_keeps_the_share_and_replays_no_allocator():
    card = replace(find_gpu("h100-sxm", None, "10%"))
    peak = gpu_verdict(GPT2, SETUP, find_gpu("h100-sxm"), BF16).peak_bytes
    v = gpu_verdict(GPT2, SETUP, card, BF16)
    assert v.reserved is None and v.keeps_share and v.total_bytes == v.peak_bytes == peak
    assert v.usable_bytes == usable_bytes(card) == card.memory_bytes - headroom(card).total_bytes


def test_an_fsdp2_rank_replays_its_streams():
    """An FSDP2 rank near the room replays the allocator with FSDP2's streams (memcalc.exact.reserved.fsdp2_reserved);
    far from it, it keeps no share either."""
    args = ["estimate", "--model", "gpt2", "--gpus", "8", "--stack", "fsdp2", "--zero", "3", "--format", "json"]
    far = json.loads(CliRunner().invoke(app, args).stdout)["verdict"][0]
    assert not far["keeps_share"] and far["reserved"] is None
    near = json.loads(CliRunner().invoke(app, [*args, "--micro-batch", "8", "--gpu-memory", "25GB"]).stdout)
    v = near["verdict"][0]
    assert v["reserved"] is not None and v["total_bytes"] == v["reserved"]["reserved_bytes"] >= v["peak_bytes"]
    assert v["reserved"]["requested_bytes"] == v["peak_bytes"]


@pytest.mark.parametrize(
    "tricks, sharding, fraction, expandable",
    [
        ("bf16", None, 0.9, False),  # tight: each micro-batch releases the cache and asks the driver again
        ("bf16,flash,ckpt", Sharding(2, 4), None, False),
        ("bf16,flash", None, 0.97, True),
    ],
)
def test_the_allocator_replays_three_micro_batches_and_reserves_what_all_of_them_would(
    tricks, sharding, fraction, expandable
):
    """step_reserved replays MICRO_BATCHES of a step's micro-batches; every one of six replayed gives the same
    reserve, peaks and out-of-memory (only the count of the driver's segments may grow with each)."""
    shape = replace(GPT2.shape, n_layers=2)
    t = parse_tricks(tricks)

    def every(capacity: int | None) -> dict:
        cfg = StepConfig(shape, 256, 2, as_run(t, shape.n_layers), DEFAULT_STACK, "adamw", 6)
        _, g, mem = simulate(cfg, timeline=True, sharding=sharding)
        return asdict(reserved_over(mem.timeline, g.recording, capacity, expandable))

    capacity = fraction and int(fraction * every(None)["reserved_bytes"])
    capped = asdict(step_reserved(shape, 256, 2, t, 6, sharding=sharding, capacity=capacity, expandable=expandable))
    full = every(capacity)
    assert MICRO_BATCHES < 6 and capped.pop("segments") <= full.pop("segments")
    assert capped == full
