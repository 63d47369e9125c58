"""PPOTrainer's rollout (--rl ppo): the start of each update, replayed beside what the previous update left
(memcalc.exact.hf.ppo_rollout); memcalc.exact.hf.ppo replays the PPO epochs after it, as meta.simulate runs them.
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.records import record

from ..base.config import StepConfig
from ..hf import model as hf
from ..hf import ppo_rollout
from ..sim.graph import Graph
from ..sim.tensors import LiveBytes
from .meta import build, micro_step, recipe_for, replayed


@record(frozen=True)
class PpoRollout:
    """One GPU's rollout in bytes: live as it starts, and its peaks."""

    rows: int  # the local batch: per_device_train_batch_size x gradient_accumulation_steps
    chunk: int  # local_rollout_forward_batch_size's rows at once (the local batch where it is smaller)
    start_bytes: int  # the trainer's state and what the previous update left (its scores, its last chunk's locals)
    generate_bytes: int  # the peak of batch_generation (the cache, the kept scores, their stack and padding)
    score_bytes: int  # the peak of the scoring loop and what follows it (the reference's logits, the backbones)

    @property
    def peak_bytes(self) -> int:
        return max(self.generate_bytes, self.score_bytes)


@lru_cache(maxsize=64)  # the answer and fit ask for the same job's
def rollout_peaks(cfg: StepConfig) -> PpoRollout:
    """The rollout at the model's depth, the decode steps between the second and the last grown, not replayed (the
    last holds the most: tests/test_ppo.py holds the two equal)."""
    return simulate_rollout(cfg, every_step=False)[0]


def simulate_rollout(cfg: StepConfig, timeline: bool = False, every_step: bool = True) -> tuple[PpoRollout, LiveBytes]:
    """The previous update's PPO epoch (its optimizer state made; one epoch stands for all), its closing `del`s,
    the loader's next batch, then the rollout: its start and peaks, and the LiveBytes (every allocation under
    timeline)."""
    g = Graph(LiveBytes(timeline=[] if timeline else None))
    model = build(g, cfg)
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")  # the harness's inputs (PPO's loop picks its own rows)
    targets = g.empty((B, T), "int64", "input", kind="input")
    recipe = recipe_for(g, model)  # its optimizer state lives on through the rollout
    micro_step(g, model, recipe, idx, targets, replayed(cfg.grad_accum, cfg))
    del idx, targets
    ppo_rollout.update_end(g, model)
    ppo_rollout.next_batch(g, model)
    mem = g.mem
    start, mem.phase = mem.live_bytes, "rollout"
    mem.reset_peak()
    ppo_rollout.generate_all(g, model, every_step)
    generated, mem.phase = mem.peak_bytes, "scoring"
    mem.reset_peak()
    ppo_rollout.score_all(g, model, hf.causal_lm)
    ppo_rollout.process(g, model)
    mem.phase = ""
    del recipe
    rows = B * cfg.grad_accum
    return PpoRollout(rows, min(cfg.stack.ppo.rollout_batch, rows), start, generated, mem.peak_bytes), mem
