"""Equal experts simulated once (memcalc.exact.sim.tensors.Region): the collapsed step equals the step that
replays every expert, to the byte, in every phase and segment, in its FLOPs, saved tensors and kernels;
under ZeRO and offload too, and at full width with uneven token counts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memcalc.exact.builder.model import expert_runs
from memcalc.exact.base.config import StepConfig
from memcalc.exact.replay.meta import simulate, trace
from memcalc.exact.step import to_terms
from memcalc.exact.sim.tensors import Region
from memcalc.exact.replay.zero import Sharding
from memcalc.model.presets import preset
from memcalc.model.tricks import parse_tricks
from tests.replay import launches
from tests.test_moe_verify import TINY

TRICKS = ("fp32", "fp16", "bf16,flash,ckpt", "bf16,selective", "bf16,ckpt:2", "bf16,flash,sac")
SHARDINGS = (Sharding(1, 4), Sharding(2, 4), Sharding(3, 4), Sharding(2, 4, True), Sharding(3, 4, True, True))


def config(shape, seq: int, batch: int, tricks: str, grad_accum: int = 2) -> StepConfig:
    t = parse_tricks(tricks)
    return StepConfig(shape, seq, batch, t, grad_accum=grad_accum)


def assert_same(cfg: StepConfig, sharding: Sharding | None = None) -> None:
    (pa, ga, ma), (pb, gb, mb) = simulate(cfg, sharding=sharding), simulate(replace(cfg, collapse=False), sharding=sharding)
    assert pa == pb
    assert ma.segments == mb.segments  # each block's peak in each phase: what the depth growth reads
    assert ga.flops == gb.flops and ga.rebuilt_bytes == gb.rebuilt_bytes
    assert to_terms(ga.saved_terms) == to_terms(gb.saved_terms)


MOE = [name for name, shape in TINY.items() if shape.n_experts]


@pytest.mark.parametrize("name", MOE)
def test_collapsed_step_equals_every_expert_replayed(name):
    """Seq 31: the slots do not divide among the experts (two runs); 32 (one run) on the default tricks."""
    for tricks in TRICKS:
        assert_same(config(TINY[name], 31, 2, tricks))
        cfg = config(TINY[name], 31, 1, tricks, 1)
        assert launches(trace(cfg)) == launches(trace(replace(cfg, collapse=False)))
    assert_same(config(TINY[name], 32, 1, "bf16"))


@pytest.mark.parametrize("name", ["deepseek-like", "gelu-experts-dropout"])
def test_collapsed_rank_equals_every_expert_replayed(name):
    """One ZeRO rank's step (gathers, reduce-scatters and offload over equal experts' tensors)."""
    for sharding in SHARDINGS:
        for tricks in ("bf16", "bf16,flash,ckpt"):
            assert_same(config(TINY[name], 31, 1, tricks), sharding)


def test_runs_of_equal_experts():
    """The balanced router's counts: a run of one more token first, then the rest; off, one expert a run."""
    shape = TINY["gelu-experts-dropout"]  # 8 experts, 2 per token
    assert expert_runs(config(shape, 31, 1, "bf16")) == [(0, 6, 8), (6, 2, 7)]  # 62 slots: 8 x 6 + 7 x 2
    assert expert_runs(config(shape, 32, 1, "bf16")) == [(0, 8, 8)]
    assert expert_runs(replace(config(shape, 32, 1, "bf16"), collapse=False)) == [(e, 1, 8) for e in range(8)]
    assert len(expert_runs(config(shape, 32, 1, "bf16,sac"))) == 8  # every second mm kept: neighbours differ


def test_region_peak_of_copies_in_turn():
    """Three copies, each +10 then -4 of its own and, for the last, -5 of a shared tensor: 0 -> 10 -> 6 ->
    16 -> 12 -> 22 -> 18 -> 13; the peak is the third copy's +10, at 22."""
    region = Region(3, 0, "before", [(10, 0, "a"), (-4, 0, "b"), (0, -5, "c")])
    assert max(region.peaks()) == (22, "a")
    shrinking = Region(3, 100, "before", [(5, 0, "a"), (-9, 0, "b")])  # net −4 a copy: the first peaks
    assert max(shrinking.peaks()) == (105, "a")


@pytest.mark.parametrize("model,seq,layers", [("qwen3-30b-a3b", 250, 2), ("deepseek-v3", 60, 4)])
def test_full_width_collapsed_equals_every_expert(model, seq, layers):
    """At full width: 128 experts of 8 per token and DeepSeek-V3's 256 of 8 (dense blocks first, shared
    expert, MTP), with uneven counts (250 · 8 slots over 128 experts; 60 · 8 over 256)."""
    shape = replace(preset(model), n_layers=layers)
    assert len(expert_runs(config(shape, seq, 1, "bf16"))) == 2
    assert_same(config(shape, seq, 1, "bf16,flash,ckpt"))
    assert_same(config(shape, seq, 1, "bf16,flash"), Sharding(3, 8))
