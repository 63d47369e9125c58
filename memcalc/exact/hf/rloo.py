"""TRL 1.16's RLOOTrainer training step (--rl rloo), op by op in bytes: trl/trainer/rloo_trainer.py
RLOOTrainer._compute_loss (the trl 1.16.0 wheel; verify/trl_grpo.py runs it). Its generation, buffering and scoring
are GRPOTrainer's (memcalc.exact.hf.grpo: the same _get_per_token_logps_and_entropies, fused head and prompt mask);
the step differs in what the batch holds and in the loss:
  batch      the ids and masks, one advantage and the old sequence log-probability per completion (old_logps:
             always computed in the scoring pass; the reference's KL enters the rewards there, not the step)
  loss       sequence level: logps = (per_token_logps * completion_mask).sum(1), the ratio exp(logps - old_logps),
             its clamp (epsilon 0.2), the two products with the advantages, their minimum negated, the mean; the
             Trainer then divides it by the accumulation steps (loss_is_scaled_for_ga False)
  metrics    the entropy over the completion, the (B,) clip flags gathered, their nanmean, nanmin and nanmax
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .. import aten
from ..aten.arithmetic import pointwise
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .dpo import item_of, mean_all
from .grpo import clamp, minimum, nan_extreme, scored, selected, stack

if TYPE_CHECKING:
    from .family import HFModel


def buffered(g: Graph, m: HFModel, B: int, T: int) -> dict[str, Tensor]:
    """The generation batch beyond this micro-batch's ids and masks, made at the first step and held for every
    micro-batch of the optimizer step (steps_per_generation: gradient_accumulation_steps by default): old_logps and
    advantages, fp32, one per completion; the other micro-batches' ids and masks."""
    if not m.batch:
        rows = B * m.cfg.grad_accum
        m.batch["old_logps"] = made(g, (rows,), "zeros")
        m.batch["advantages"] = made(g, (rows,), "zeros")
        if rows > B:  # the ids and the masks (int64) of the micro-batches this one is not
            m.batch["others"] = made(g, (rows - B, 2 * T), "zeros", dtype="int64")
    return m.batch


def compute_loss(g: Graph, m: HFModel, idx: Tensor, attention_mask: Tensor, causal_lm: Callable) -> Tensor:
    """RLOOTrainer._compute_loss, then training_step's loss / gradient_accumulation_steps; locals live until it
    returns, as in its frame."""
    B, T = idx.shape
    C = m.cfg.stack.online.completion_len
    inputs = buffered(g, m, B, T)
    input_ids, mask_2d, per_token_logps, entropies = scored(g, m, idx, attention_mask, causal_lm)
    with g.scoped("loss"):
        completion_mask = g.view(attention_mask, (B, C))
        masked = aten.mul(g, per_token_logps, completion_mask)
        logps = aten.sum_last(g, masked)  # .sum(1)
        del masked
        old_logps, advantages = g.view(inputs["old_logps"], (B,)), g.view(inputs["advantages"], (B,))
        log_ratio = aten.sub(g, logps, old_logps)
        coef_1 = aten.exp(g, log_ratio)
        coef_2 = clamp(g, coef_1)
        per_sequence_loss1 = aten.mul(g, coef_1, advantages)
        per_sequence_loss2 = aten.mul(g, coef_2, advantages)
        per_sequence_loss = aten.neg(g, minimum(g, per_sequence_loss1, per_sequence_loss2))
        loss = mean_all(g, per_sequence_loss)
        entropy_stats = entropy_metric(g, entropies, completion_mask)
        clip_metrics(g, coef_1, advantages)
        del per_token_logps, entropies, logps, old_logps, log_ratio, coef_1, coef_2, entropy_stats  # the frame's
        del per_sequence_loss1, per_sequence_loss2, per_sequence_loss, input_ids, mask_2d  # as it returns
        return pointwise(g, loss, "div", "div")  # training_step: loss / current_gradient_accumulation_steps


def entropy_metric(g: Graph, entropies: Tensor, mask: Tensor) -> Tensor:
    """entropy_stats = reduce(torch.stack([(entropies * mask).sum(), mask.sum().float()])), then stats[0] /
    stats[1].clamp(min=1.0) and .item(): autograd records it around the entropy (a Function's output), never run.
    The stats are returned: a local of _compute_loss."""
    local_sum = aten.sum_all(g, aten.mul(g, entropies, mask))
    counted = made(g, (), "sum", mask, dtype="int64")
    local_count = made(g, (), "_to_copy", counted)
    del counted
    stats = stack(g, local_sum, local_count)
    del local_sum, local_count  # temporaries of the expression
    item_of(aten.div(g, selected(g, stats), clamp(g, selected(g, stats))))
    return stats


def clip_metrics(g: Graph, coef_1: Tensor, advantages: Tensor) -> None:
    """is_low_clipped, is_high_clipped ((B,) bool) and their union; each as a float gathered (one process: itself),
    its nanmean .item()'d, the first two's nanmin and nanmax too. The gathered floats are the frame's locals."""
    shape = coef_1.shape
    clipped = []
    for compare in ("lt", "gt"):  # (coef_1 < 1 - epsilon_low) & (advantages < 0), then > 1 + epsilon_high, > 0
        outside = made(g, shape, compare, coef_1, dtype="bool")
        signed = made(g, shape, compare, advantages, dtype="bool")
        clipped.append(made(g, shape, "bitwise_and", outside, signed, dtype="bool"))
        del outside, signed
    region = made(g, shape, "bitwise_or", *clipped, dtype="bool")
    gathered = []
    for x, extreme in zip(clipped, ("min", "max")):
        gathered.append(made(g, shape, "_to_copy", x))  # .float(), gathered
        item_of(nanmean(g, gathered[-1]))
        nan_extreme(g, gathered[-1], extreme)
    gathered.append(made(g, shape, "_to_copy", region))
    item_of(nanmean(g, gathered[-1]))
    del clipped, region, gathered


def nanmean(g: Graph, x: Tensor) -> Tensor:
    """torch.nanmean(x) (ReduceOps.cpp nanmean: nansum(x) / (x == x).sum()): the kept count of a (B,) bool, then the
    NaN-skipping sum, then the quotient."""
    kept = made(g, x.shape, "ne", x, dtype="bool")
    count = made(g, (), "sum", kept, dtype="int64")
    del kept
    total = made(g, (), "nansum", x)
    out = made(g, (), "div", total, count)
    del total, count
    return out
