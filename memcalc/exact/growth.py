"""A step at full depth grown from two short ones: what exact_step and step_phases replay instead of every
block (memcalc.exact.step).

A unit is one block, or with ckpt:N a group of N; the lead units, which may differ from the rest, are in
both short steps, one unit more after them in the shorter, two in the longer (Growth, growth). What a
step holds is affine in the units past the lead (grow), and a phase's peak is the highest of its
segments' grown (grown_phases, candidates). dense_first says whether the blocks come in a pattern that
grows; layer_blocks which blocks per-layer terms are taken from; as_run the trick set as the blocks run it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memcalc.model.moe_mla import is_moe_layer, moe_layer_count
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks

from .base.config import Phases


@dataclass(frozen=True)
class Growth:
    """How a step of n_layers blocks grows from two short ones. A unit is one block, or with ckpt:N a
    group of N blocks (N − 1 plain, the Nth checkpointed: torchtitan counts from 1); the L mod N blocks
    left over come last, plain, and every step ends with them. The lead units may differ from the rest,
    so both short steps hold them: the first unit (Transformers builds its masks in its first block), or
    with d dense blocks before MoE ones (DeepSeek-V3's first_k_dense_replace) as many units as hold
    them. The shorter step has one unit more, the longer two; and as many tail units as differ at the end
    (under ZeRO-3 the last block prefetches the head, not a block: memcalc.exact.replay.zero), in both; under
    ZeRO-3 the first MoE unit after dense ones is a lead unit too (its backward prefetches a dense one)."""

    unit: int  # blocks per unit
    lead: int  # units before those that repeat
    units: int  # units at full depth
    left: int  # blocks left over after the units
    dense: int  # dense blocks before MoE ones; 0 when every block's MLP is alike
    tail: int = 0  # units at the end that differ from the middle ones

    @property
    def n_layers(self) -> int:
        return self.units * self.unit + self.left

    @property
    def short(self) -> int:
        """The shorter step's depth: the lead units, one more and the blocks left over."""
        return (self.lead + 1 + self.tail) * self.unit + self.left

    @property
    def long(self) -> int:
        return self.short + self.unit

    @property
    def whole(self) -> bool:
        """No deeper than the shorter step: the full depth is replayed as it is."""
        return self.units <= self.lead + 1 + self.tail

    @property
    def first_blocks(self) -> int:
        """Blocks whose saved bytes exact counts outside the layers: with dense blocks first, all those of
        the shorter step (or of the whole depth, replayed whole); else none (the first block's extras)."""
        return min(self.short, self.n_layers) if self.dense else 0


def growth(tricks: Tricks, shape: ModelShape, tail: int = 0, first: int = 0) -> Growth | None:
    """How the step grows (Growth); None for blocks in a pattern it does not grow (MoE every other
    block, or dense blocks among MoE ones past the first: replayed whole). tail: end units that differ;
    first: blocks at the start that run otherwise (frozen ones: memcalc.model.finetune.Finetune.lead_blocks),
    grown past as dense blocks before MoE ones are."""
    L, dense = shape.n_layers, dense_first(shape)
    if dense is None:
        return None
    dense = min(max(dense, first), L)
    run = as_run(tricks, L)
    unit = run.ckpt_every if run.mixed else 1
    units, left = divmod(L, unit)
    lead = max(1, -(-dense // unit)) + (1 if tail and dense else 0)  # under prefetch the first MoE unit fetches a dense one
    return Growth(unit, lead, units, left, dense, tail)


def dense_first(shape: ModelShape) -> int | None:
    """How many dense blocks come before the MoE ones: 0 when every block is alike (all dense or all MoE);
    d when d dense blocks come before MoE ones only (DeepSeek-V3's first_k_dense_replace); None for any
    other pattern, and for windowed layers among global ones."""
    L, moe = shape.n_layers, moe_layer_count(shape)
    if shape.sliding_window and any(i < L for i in shape.global_layers):
        return None  # windowed and global layers (Gemma 2/3): their attention differs past the window
    if moe in (0, L):
        return 0
    d = shape.first_dense_layers
    if moe == L - d and all(is_moe_layer(shape, i) for i in range(d, L)):
        return d
    return None


def layer_blocks(grown: Growth, run: Tricks) -> tuple[int | None, int | None]:
    """With dense blocks first: the MoE blocks exact's per-layer terms are taken from, one plain and (ckpt:N)
    one checkpointed: the first of each kind past the shorter step in the longer, or past the dense blocks
    when the whole depth is replayed (verify/meta.py measures the same blocks); None where there is none."""
    lo, hi = (grown.dense, grown.n_layers) if grown.whole else (grown.short, grown.long)
    if not run.mixed:
        return lo, None
    plain = next((b for b in range(lo, hi) if not run.checkpointed(b)), None)
    return plain, next((b for b in range(lo, hi) if run.checkpointed(b)), None)


def as_run(tricks: Tricks, layers: int) -> Tricks:
    """The trick set as the blocks run it: ckpt:N over fewer than N blocks checkpoints none."""
    return replace(tricks, recompute="none", ckpt_every=1) if tricks.mixed and layers < tricks.ckpt_every else tricks


def grown_phases(short: Phases, long: Phases, m2, m3, grown: Growth) -> Phases:
    """A step's phases at grown.units units of blocks (see Growth) from its two short steps. What a step
    holds is affine in the units once the lead units, which may do what later ones do not, are in both;
    a phase's peak is the highest of its segments' (memcalc.exact.sim.tensors.LiveBytes): its start, before the
    blocks, after them, and inside a block, where past the lead the live bytes are affine in how many
    units the phase has done (each frees a unit's activations, or keeps them, and adds its gradients) for
    a block at a given place in its unit. So across the units each place peaks in a lead unit, the first
    after them or the last; the blocks left over after the units are a fixed tail. Each grows affinely
    with the units; the peak is the highest grown, named by the first segment to reach it. At 8B with
    checkpointing this finds the backward peak moving, with depth, from the loss into the last block's
    recompute, where the gradients of the blocks done outgrow the activations they freed."""
    grown_fields = {f: grow(getattr(short, f), getattr(long, f), grown) for f in STATE_FIELDS}
    for phase in ("forward", "backward", "optimizer"):
        peak, at_op = -1, ""
        pairs = candidates(m2.segments[phase], m3.segments[phase], grown)  # in the order the phase runs them
        if phase == "forward" and "reference" in m3.segments:  # DPO's reference forward: its blocks apart
            pairs += candidates(m2.segments["reference"], m3.segments["reference"], grown)
        for a, (b, op) in pairs:
            if grow(a, b, grown) > peak:  # the first to reach the peak names it, as LiveBytes's running peak does
                peak, at_op = grow(a, b, grown), op
        grown_fields[f"{phase}_peak_bytes"], grown_fields[f"{phase}_peak_at"] = peak, at_op
    return replace(long, **grown_fields)


STATE_FIELDS = ("weights_bytes", "inputs_bytes", "state_bytes", "retained_bytes", "grads_bytes", "offloaded_bytes",
                "reloaded_bytes", "load_bytes")


def grow(at_short: int, at_long: int, grown: Growth) -> int:
    """An affine count at the shorter step and the longer (one unit more), at grown.units units."""
    return at_short + (grown.units - grown.lead - 1 - grown.tail) * (at_long - at_short)


def candidates(short: tuple, long: tuple, grown: Growth) -> list[tuple[int, tuple[int, str]]]:
    """The segments a phase's peak can be in, in the order it runs them in the longer step, as (bytes in the
    shorter, (bytes in the longer, the op there)): its start, before the blocks, every block of the longer
    step (the lead units', the first unit's after them, the last's and the tail's) each beside the block
    in the same place in the shorter, and after the blocks. Block b of the longer step is in the place of
    block b, or b − unit past the first unit after the lead, of the shorter."""
    (p2, _), (p3, seen3) = short, long
    pairs = [(p2[k][0], p3[k]) for k in ("start", "before") if k in p2 and k in p3]
    past = (grown.lead + 1) * grown.unit
    like = {b: b if b < past else b - grown.unit for b in seen3}
    pairs += [(p2[like[b]][0], p3[b]) for b in seen3 if like[b] in p2]
    return pairs + ([(p2["after"][0], p3["after"])] if "after" in p2 and "after" in p3 else [])
