"""TRL 1.16's GRPOTrainer training step (--rl grpo), op by op in bytes: trl/trainer/grpo_trainer.py
GRPOTrainer._compute_loss and _get_per_token_logps_and_entropies (the trl 1.16.0 wheel; verify/trl_grpo.py runs it).

The step reads one slice of the generation batch _generate_and_score_completions buffered: views of tensors made
once per generation and held across the steps that read them (the ids and masks, the advantages, the token count,
and as configured the old log-probs with vLLM's ratio and the reference's log-probs). Every prompt and completion
position is taken to be real (no padding, no completion stopped early: the most the step holds). _compute_loss:
  ids, mask  torch.cat of the prompt's and the completion's: new (B, T) int64 each
  labels     input_ids.masked_fill(attention_mask == 0, -100), then labels[:, :-C] = -100: only the completion
             scored, so the fused LM head (memcalc.exact.hf.fused_head) runs on B x C rows, not B x (T - 1)
  policy     the model called with the attention mask and labels through its fused head (GRPO's outputs: log_probs,
             entropy), under accelerator.autocast() where the recipe has it; each output's last C columns
             concatenated (torch.cat of one chunk: a copy)
  loss       loss_type "dapo" (GRPOConfig's default), token-level importance sampling, epsilon 0.2: the ratio
             exp(logps - old), its clamp, the two products with the advantages, their minimum negated; times vLLM's
             ratio (use_vllm), plus beta x the k3 KL estimate (beta > 0); summed over the completion mask and divided
             by num_items_in_batch (already scaled for accumulation: loss_is_scaled_for_ga True, no division after)
  metrics    the entropy, the KL (beta > 0) and the clip ratios: (B, C) bool and fp32 temporaries, their .item()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from memcalc.model.stacks import FUSED_HEAD

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import grpo_logits
from .dpo import item_of, model_call
from .fused_head import sliced

if TYPE_CHECKING:
    from .family import HFModel


def buffered(g: Graph, m: HFModel, B: int, T: int) -> dict[str, Tensor]:
    """The generation batch's tensors beyond this micro-batch's ids and masks, made at the first step and held
    (verify/trl_grpo.py buffered), for every micro-batch of the optimizer step (steps_per_generation: GRPOConfig's
    default, gradient_accumulation_steps): advantages (fp32, a row each), num_items_in_batch (int64 0-d); with vLLM
    old_per_token_logps (B, C) and importance_sampling_ratio (B, 1) (vllm_importance_sampling_mode "sequence_mask");
    at beta > 0 ref_per_token_logps (B, C), fp32; and the other micro-batches' prompt and completion ids and masks."""
    if not m.batch:
        settings, C, A = m.cfg.stack.online, m.cfg.stack.online.completion_len, m.cfg.grad_accum
        rows = B * A
        m.batch["advantages"] = made(g, (rows,), "zeros")
        m.batch["num_items_in_batch"] = made(g, (), "ones", dtype="int64")
        if settings.vllm:
            m.batch["old_per_token_logps"] = made(g, (rows, C), "zeros")
            m.batch["importance_sampling_ratio"] = made(g, (rows, 1), "ones")
        if settings.beta:
            m.batch["ref_per_token_logps"] = made(g, (rows, C), "zeros")
        if A > 1:  # the ids and the masks (int64) of the micro-batches this one is not
            m.batch["others"] = made(g, (rows - B, 2 * T), "zeros", dtype="int64")
    return m.batch


def compute_loss(g: Graph, m: HFModel, idx: Tensor, attention_mask: Tensor, causal_lm: Callable) -> Tensor:
    """GRPOTrainer._compute_loss; locals live until it returns, as in its frame."""
    B, T = idx.shape
    settings = m.cfg.stack.online
    C = settings.completion_len
    inputs = buffered(g, m, B, T)
    input_ids, mask_2d, per_token_logps, entropies = scored(g, m, idx, attention_mask, causal_lm)
    with g.scoped("loss"):
        mask = g.view(attention_mask, (B, C))  # completion_mask
        advantages = g.view(inputs["advantages"], (B, 1))  # this micro-batch's rows, .unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = Tensor(per_token_logps.storage, (B, C), "fp32") if old is None else g.view(old, (B, C))  # or .detach()
        log_ratio = aten.sub(g, per_token_logps, old)
        coef_1 = aten.exp(g, log_ratio)
        per_token_kl = kl(g, per_token_logps, g.view(inputs["ref_per_token_logps"], (B, C))) if settings.beta else None
        coef_2 = clamp(g, coef_1)
        per_token_loss1 = aten.mul(g, coef_1, advantages)
        per_token_loss2 = aten.mul(g, coef_2, advantages)
        per_token_loss = aten.neg(g, minimum(g, per_token_loss1, per_token_loss2))
        if settings.vllm:  # vllm_importance_sampling_correction: * inputs["importance_sampling_ratio"]
            per_token_loss = aten.mul(g, per_token_loss, g.view(inputs["importance_sampling_ratio"], (B, 1)))
        if settings.beta:  # per_token_loss + self.beta * per_token_kl
            per_token_loss = aten.add(g, per_token_loss, aten.mul_scalar(g, per_token_kl))
        clamped = made(g, (), "clamp", inputs["num_items_in_batch"])  # .clamp(min=1.0) / num_processes: fp32
        normalizer = made(g, (), "div", clamped)
        del clamped
        scaled = made(g, (), "mul", normalizer)  # normalizer * current_gradient_accumulation_steps
        normalizer = made(g, (), "div", scaled)  # / steps_per_generation, the old one dropped as it is rebound
        del scaled
        masked = aten.mul(g, per_token_loss, mask)
        summed = aten.sum_all(g, masked)
        del masked
        loss = aten.div_tensor(g, summed, normalizer)
        del summed
        policy_loss = Tensor(loss.storage, (), loss.dtype)  # loss.detach()
        if settings.beta:
            global_masked_mean(g, per_token_kl, mask, m.cfg.device)
        global_masked_mean(g, entropies, mask, m.cfg.device)
        clip_metrics(g, coef_1, advantages, mask, m.cfg.device)
        del policy_loss, per_token_logps, entropies, old, log_ratio, coef_1, coef_2, per_token_kl  # the frame's
        del per_token_loss1, per_token_loss2, per_token_loss, normalizer, input_ids, mask_2d  # locals, as it returns
        return loss


def scored(g: Graph, m: HFModel, idx: Tensor, attention_mask: Tensor,
           causal_lm: Callable) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The start GRPOTrainer's and RLOOTrainer's _compute_loss share: the prompt's and the completion's ids and
    masks concatenated (new (B, T) int64 each, locals until it returns), then the completion's log-probs and
    entropies (per_token_logps_and_entropies; before 1.15 from the logits: memcalc.exact.hf.grpo_logits)."""
    B, T = idx.shape
    with g.scoped("loss"):
        input_ids = made(g, (B, T), "cat", idx, dtype="int64")  # torch.cat([prompt_ids, completion_ids], 1)
        mask_2d = made(g, (B, T), "cat", attention_mask, dtype="int64")
    C = m.cfg.stack.online.completion_len
    fused = m.cfg.stack.trl in FUSED_HEAD
    scoring = per_token_logps_and_entropies if fused else grpo_logits.per_token_logps_and_entropies
    return input_ids, mask_2d, *scoring(g, m, input_ids, mask_2d, C, causal_lm)


def per_token_logps_and_entropies(g: Graph, m: HFModel, input_ids: Tensor, attention_mask: Tensor, C: int,
                                  causal_lm: Callable) -> tuple[Tensor, Tensor]:  # fmt: skip
    """_get_per_token_logps_and_entropies with compute_entropy, batch_size the whole micro-batch (one chunk): the
    labels, the model, the outputs' last C columns concatenated; its locals (the outputs, the labels) go as it
    returns."""
    B, T = input_ids.shape
    with g.scoped("loss"):
        labels = completion_labels(g, input_ids, attention_mask)
        prompt_masked(g, m)
    outputs = model_call(g, m, input_ids, labels, causal_lm)
    with g.scoped("loss"):
        logps = aten.cat(g, [sliced(g, outputs.log_probs, (B, C))], 0)  # outputs.log_probs[:, -C:]
        entropies = aten.cat(g, [sliced(g, outputs.entropy, (B, C))], 0)  # a Function's output: it requires grad
        del outputs, labels
        return logps, entropies


def completion_labels(g: Graph, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """_get_per_token_logps_and_entropies' labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)."""
    padding = made(g, input_ids.shape, "eq", attention_mask, dtype="bool")
    labels = made(g, input_ids.shape, "masked_fill", input_ids, padding, dtype="int64")
    del padding
    return labels


def prompt_masked(g: Graph, m: HFModel) -> None:
    """Then labels[:, :-logits_to_keep] = -100: copied from a 0-d tensor on the device (indexing.h scalarToTensor;
    CPU lifts its own)."""
    made(g, (), "lift_fresh" if m.cfg.device == "cpu" else "scalar_tensor", dtype="int64")


def kl(g: Graph, logps: Tensor, ref: Tensor) -> Tensor:
    """torch.exp(ref - logps) - (ref - logps) - 1: the k3 estimate of the KL to the reference."""
    diff = aten.sub(g, ref, logps)
    ratio = aten.exp(g, diff)
    del diff
    diff = aten.sub(g, ref, logps)
    out = aten.sub(g, ratio, diff)
    del ratio, diff
    return aten.add_scalar(g, out, "sub")


def clamp(g: Graph, x: Tensor) -> Tensor:
    """torch.clamp(x, 1 - epsilon_low, 1 + epsilon_high) (ClampBackward1): saves x; backward: grad where x lies
    inside the bounds (clamp_backward: where((x >= min).logical_and_(x <= max), grad, zeros({})))."""
    shape = x.shape

    def rule(gs):
        zero = made(g, (), "scalar_tensor", dtype=gs[0].dtype)
        above = made(g, shape, "ge", dtype="bool")
        below = made(g, shape, "le", dtype="bool")  # and_ into above, in place
        out = made(g, shape, "where", above, gs[0], zero, dtype=gs[0].dtype)
        del zero, above, below
        return [out]

    node = g.begin("clamp", [x], rule, [(x, "self")])
    out = made(g, shape, "clamp", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def minimum(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """torch.min(a, b) (MinimumBackward0): saves both; backward: each gradient where its input is the smaller."""
    return extremum(g, a, b, "minimum")


def extremum(g: Graph, a: Tensor, b: Tensor, op: str) -> Tensor:
    """torch.min(a, b) or torch.max(a, b) (op minimum or maximum; MinimumBackward0, MaximumBackward0): saves both;
    backward (min_max_other_backward): other's gradient first, where(a == b, grad / 2, grad) masked where a is the
    one kept, then a's the same way."""
    shape = a.shape
    compares = ("lt", "gt") if op == "minimum" else ("gt", "lt")

    def rule(gs):
        grads = []
        for compare in compares:
            half = made(g, shape, "div", gs[0], dtype=gs[0].dtype)
            tie = made(g, shape, "eq", dtype="bool")
            grads.append(made(g, shape, "where", tie, half, gs[0], dtype=gs[0].dtype))
            kept = made(g, shape, compare, dtype="bool")
            del half, tie, kept
        return grads[::-1]

    node = g.begin(op, [a, b], rule, [(a, "self"), (b, "other")])
    out = made(g, shape, op, a, b, dtype=a.dtype)
    g.end(node, [out])
    return out


def global_masked_mean(g: Graph, x: Tensor, mask: Tensor, device: str) -> None:
    """_compute_loss's global_masked_mean: (x * mask).sum(), mask.sum().float(), stacked, reduced (one process: the
    same), totals[0] / totals[1].clamp(min=1.0), .item(); of a (B, 1) x (one value per sequence: a one-token
    completion too) x.sum() and torch.tensor(float(B), device=...) instead. Where x requires grad (the fused head's
    entropy, the KL) autograd records it all, never run: the clamp saves the stacked totals, the division its two
    operands."""
    if x.shape[1] == 1:
        local_sum = aten.sum_all(g, x) if x.requires_grad else made(g, (), "sum", x)
        local_count = made(g, (), "lift_fresh" if device == "cpu" else "_to_copy")
    else:
        if x.requires_grad:
            local_sum = aten.sum_all(g, aten.mul(g, x, mask))
        else:
            product = made(g, x.shape, "mul", x, mask)
            local_sum = made(g, (), "sum", product)
            del product
        counted = made(g, (), "sum", mask, dtype="int64")
        local_count = made(g, (), "_to_copy", counted)
        del counted
    totals = stack(g, local_sum, local_count)  # the locals live until it returns
    if totals.requires_grad:
        first, second = selected(g, totals), selected(g, totals)
        item_of(aten.div(g, first, clamp(g, second)))
    else:
        clamped = made(g, (), "clamp", totals)
        item_of(made(g, (), "div", totals, clamped))
        del clamped
    del totals, local_sum, local_count


def stack(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """torch.stack([a, b]) of two 0-d tensors (StackBackward0: saves nothing)."""
    node = g.begin("stack", [a, b], lambda gs: [g.view(gs[0], ()), g.view(gs[0], ())])
    out = made(g, (2,), "stack", a, b)
    g.end(node, [out])
    return out


def selected(g: Graph, x: Tensor) -> Tensor:
    """x[i] of a 1-D x (SelectBackward0: a view; backward scatters into zeros of x's shape)."""
    shape = x.shape
    node = g.begin("select", [x], lambda gs: [made(g, shape, "select_backward", gs[0], dtype=gs[0].dtype)])
    out = g.view(x, ())
    g.end(node, [out])
    return out


def clip_metrics(g: Graph, coef_1: Tensor, advantages: Tensor, mask: Tensor, device: str) -> None:
    """The clip ratios dapo logs: is_low_clipped and is_high_clipped ((B, C) bool), their union, the global masked
    mean of each as a float, and each row's masked mean of the first two, gathered, nanmin / nanmax'd, .item()."""
    shape = coef_1.shape
    clipped = []
    for compare in ("lt", "gt"):  # (coef_1 < 1 - epsilon_low) & (advantages < 0), then > 1 + epsilon_high, > 0
        outside = made(g, shape, compare, coef_1, dtype="bool")
        signed = made(g, advantages.shape, compare, advantages, dtype="bool")
        clipped.append(made(g, shape, "bitwise_and", outside, signed, dtype="bool"))
        del outside, signed
    region = made(g, shape, "bitwise_or", *clipped, dtype="bool")
    for x in (*clipped, region):
        as_float = made(g, shape, "_to_copy", x)
        global_masked_mean(g, as_float, mask, device)
        del as_float
    gathered = []  # gathered_low_clip, gathered_high_clip: the frame's locals
    for x, extreme in zip(clipped, ("min", "max")):
        as_float = made(g, shape, "_to_copy", x)
        gathered.append(masked_seq_mean(g, as_float, mask))
        del as_float
        nan_extreme(g, gathered[-1], extreme)
    del region, clipped, gathered


def masked_seq_mean(g: Graph, x: Tensor, mask: Tensor) -> Tensor:
    """(x * mask).sum(-1) / mask.sum(-1): one value per row; of a (B, 1) x, x.squeeze(1) (a view)."""
    B = x.shape[0]
    if x.shape[1] == 1:
        return g.view(x, (B,))
    product = made(g, x.shape, "mul", x, mask)
    sums = made(g, (B,), "sum", product)
    del product
    counts = made(g, (B,), "sum", mask, dtype="int64")
    out = made(g, (B,), "div", sums, counts)
    del sums, counts
    return out


def nan_extreme(g: Graph, x: Tensor, extreme: str) -> None:
    """trl.trainer.utils nanmin / nanmax of the gathered rows: torch.isnan(x).all() (false), then
    torch.min (max) of x[~torch.isnan(x)], and .item()."""
    B = x.shape[0]
    isnan = made(g, (B,), "isnan", x, dtype="bool")
    every = made(g, (), "all", isnan, dtype="bool")
    del isnan, every
    isnan = made(g, (B,), "isnan", x, dtype="bool")
    kept = made(g, (B,), "bitwise_not", isnan, dtype="bool")
    del isnan
    picked = made(g, (B,), "index", x, kept)
    del kept
    item_of(made(g, (), extreme, picked))
    del picked
