"""One FSDP2 rank through the caching allocator (memcalc.exact.reserved.fsdp2_reserved): the replay's allocations
on the streams FSDP2 makes them on (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
foreach_all_gather and foreach_reduce), a first step that makes AdamW's state as torch's does, and the result
kept on disk. Models are presets at full width with two layers (a second or less each)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memcalc.exact.allocator.replay import replay
from memcalc.exact.replay.fsdp2 import fsdp2_phases
from memcalc.exact.replay.fsdp2_units import ALL_GATHER_COPY_IN, DEFAULT, REDUCE_SCATTER
from memcalc.exact.reserved import allocator_events, fsdp2_reserved
from memcalc.model.presets import PRESETS
from memcalc.model.tricks import parse_tricks

SHAPE = replace(PRESETS["llama3-8b"], n_layers=2, vocab=2048)
TIED = replace(PRESETS["llama3.2-1b"], n_layers=2, vocab=2048)


@pytest.mark.parametrize("tricks", ["bf16,flash", "bf16,flash,sac", "bf16,flash,ckpt", "fp32"])
@pytest.mark.parametrize("shape", [SHAPE, TIED], ids=["untied", "tied"])
def test_a_first_step_leaves_the_measured_step_as_it_was(shape, tricks):
    """warm_up runs a step with no gradients before the measured one and makes AdamW's state in its optimizer
    step: the measured step holds the same bytes at every phase as with the state made up front."""
    t = parse_tricks(tricks)
    before, _ = fsdp2_phases(shape, 256, 2, t, 8, None)
    after, _ = fsdp2_phases(shape, 256, 2, t, 8, None, timeline=True, warm_up=True)
    assert after == before


def test_each_allocation_is_on_the_stream_fsdp2_makes_it_on():
    _, mem = fsdp2_phases(SHAPE, 256, 2, parse_tricks("bf16,flash"), 8, None, timeline=True, warm_up=True)
    streams: dict[str, set[int]] = {}
    for origin in mem.recording.origins.values():
        streams.setdefault(origin.op, set()).add(origin.stream)
    assert streams["FSDP2 all-gather input"] == streams["FSDP2 all-gather output"] == {ALL_GATHER_COPY_IN}
    assert streams["FSDP2 reduce-scatter output"] == {REDUCE_SCATTER}
    assert streams["FSDP2 reduce-scatter input"] == {DEFAULT}  # foreach_reduce: before its stream switch
    assert all(s == {DEFAULT} for op, s in streams.items() if op.startswith("FSDP2 unsharded "))
    assert streams["AdamW exp_avg"] == {DEFAULT}
    events, _ = allocator_events(mem.timeline, mem.recording)
    assert {stream for _, _, stream in events} == {DEFAULT, ALL_GATHER_COPY_IN, REDUCE_SCATTER}


def test_the_first_step_makes_adams_state_after_backward():
    """fused AdamW's _init_group: the state of each parameter in its first step, after the gradients exist."""
    _, mem = fsdp2_phases(SHAPE, 256, 2, parse_tricks("bf16,flash"), 8, None, timeline=True, warm_up=True)
    made = [i for i, o in mem.recording.origins.items() if o.op == "AdamW exp_avg"]
    assert made
    assert all(i > mem.recording.loaded and mem.recording.origins[i].stage == "optimizer" for i in made)
    stand_ins = [i for i, o in mem.recording.origins.items() if o.op.startswith("param ")]
    assert stand_ins and set(stand_ins) <= mem.recording.elsewhere  # the built weights are not on the GPU


def test_fsdp2_reserved_replays_the_events_and_is_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCALC_CACHE", str(tmp_path))
    fsdp2_reserved.cache_clear()
    t = parse_tricks("bf16,flash,sac")
    got = fsdp2_reserved(SHAPE, 256, 2, t, 8, None)
    _, mem = fsdp2_phases(SHAPE, 256, 2, t, 8, None, timeline=True, warm_up=True)
    events, names = allocator_events(mem.timeline, mem.recording)
    assert got == replay(events, None, False, names)
    assert got.reserved_bytes >= got.allocated_bytes >= got.requested_bytes > 0
    assert list(tmp_path.glob("fsdp2-reserved-*.json.zlib"))
    fsdp2_reserved.cache_clear()
    assert fsdp2_reserved(SHAPE, 256, 2, t, 8, None) == got  # read back from disk
    tight = fsdp2_reserved(SHAPE, 256, 2, t, 8, None, capacity=got.allocated_bytes // 2)
    assert tight.out_of_memory and tight.capacity_bytes == got.allocated_bytes // 2
