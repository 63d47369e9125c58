"""TRL 1.3-1.13's DPOTrainer step (--stack trl:1.5 to trl:1.13 --rl dpo), op by op in bytes: trl/trainer/
dpo_trainer.py DPOTrainer._compute_loss and trl/trainer/utils.py selective_log_softmax and entropy_from_logits as the
1.3.0 to 1.13.0 wheels ship them (the same code in every line but 1.3-1.5's .contiguous() copies: DPO_COPIES;
verify/trl_dpo.py runs it). The batch, the reference, the sigmoid loss and the rewards are memcalc.exact.hf.dpo's;
what differs from 1.16 is where the log-probabilities come from: the full logits.
  logits     model(input_ids, use_cache=False) without labels: outputs.logits, every position's (2B, T, V) in the
             head's dtype; under the autocast recipe Accelerate's convert_to_fp32 copy (the 16-bit ones go)
  shifted    outputs.logits[..., :-1, :], input_ids[..., 1:], completion_mask[..., 1:]: views from 1.6, copies in
             1.3-1.5
  log-probs  selective_log_softmax: over fp32 logits torch.gather of each label's logit (GatherBackward0 saves the
             logits), each row's logsumexp (saves the row and its result), stacked, subtracted; over 16-bit ones
             each row's log_softmax (saved) and its gather, stacked. Then per_token_logps[mask == 0] = 0.0 (an
             in-place index_put_ on the squeezed view: CopySlices) and the sum over positions
  reference  the same under no_grad (its logits and their copy held until _compute_loss returns); its
             selective_log_softmax runs outside no_grad, on tensors that need no grad: nothing saved
  metrics    entropy_from_logits(shift_logits.detach()) (reshape: a copy of a strided view), each half's mean logit
             at its completion positions (a boolean index: a copy of those rows), the chosen half's argmax accuracy;
             then dpo's rewards and margins
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from memcalc.model.stacks import DPO_COPIES

from .. import aten
from ..aten.arithmetic import pointwise
from ..aten.operands import made
from ..aten.views import split
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import dpo, trl
from .fused_head import index_rows

if TYPE_CHECKING:
    from .family import HFModel


def compute_loss(g: Graph, m: HFModel, idx: Tensor, completion_mask: Tensor, causal_lm: Callable) -> Tensor:
    """DPOTrainer._compute_loss (loss_type sigmoid, reverse KL, no ld_alpha, no weighting) over the full logits, then
    training_step's loss / gradient_accumulation_steps. Locals live until it returns, as in its frame."""
    B2, T = idx.shape
    copies = m.cfg.stack.trl in DPO_COPIES
    outputs = model_logits(g, m, idx, causal_lm)
    with g.scoped("loss"):
        shift_logits = shifted_logits(g, outputs, copies)
        shift_labels, shift_mask = shifted(g, idx, copies), shifted(g, completion_mask, copies)
        per_token_logps = selective_log_softmax(g, shift_logits, shift_labels, m.cfg.watched)
        zero_masked(g, per_token_logps, shift_mask, m.cfg.device)  # per_token_logps[shift_completion_mask == 0] = 0.0
        logps = aten.sum_last(g, per_token_logps)
        chosen_logps, rejected_logps = split(g, logps, [B2 // 2, B2 // 2], 0)  # logps.chunk(2, dim=0)
    ref_outputs = ref_shift_logits = ref_per_token_logps = ref_logps = None
    if m.cfg.stack.precompute_ref:
        with g.scoped("loss"):
            ref_chosen_logps, ref_rejected_logps = made(g, (B2 // 2,), "zeros"), made(g, (B2 // 2,), "zeros")
    else:
        ref_outputs = dpo.reference_call(g, m, idx, None, causal_lm, model_logits)
        with g.scoped("loss"):
            ref_shift_logits = shifted_logits(g, ref_outputs, copies)
            ref_per_token_logps = selective_log_softmax(g, ref_shift_logits, shift_labels, m.cfg.watched)
            zero_masked(g, ref_per_token_logps, shift_mask, m.cfg.device)
            ref_logps = made(g, (B2,), "sum", ref_per_token_logps)
            ref_chosen_logps, ref_rejected_logps = g.view(ref_logps, (B2 // 2,)), g.view(ref_logps, (B2 // 2,))
    with g.scoped("loss"):
        loss, frame = dpo.sigmoid_loss(g, m, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
        held = metrics(g, shift_logits, shift_labels, shift_mask, copies, m.cfg.watched)
        held += dpo.reward_metrics(g, frame["chosen_logratios"], frame["rejected_logratios"], chosen_logps)
        del held, frame, outputs, ref_outputs, shift_logits, ref_shift_logits, shift_labels, shift_mask  # the frame's
        del per_token_logps, ref_per_token_logps, logps, ref_logps, chosen_logps, rejected_logps  # locals, as it
        del ref_chosen_logps, ref_rejected_logps  # returns
        return pointwise(g, loss, "div", "div")  # training_step: loss / current_gradient_accumulation_steps


def model_logits(g: Graph, m: HFModel, idx: Tensor, causal_lm: Callable, keep: int = 0) -> Tensor:
    """model(**model_kwargs).logits, through Accelerate's prepared forward where the recipe autocasts: the forward in
    the autocast region, then convert_to_fp32 (an fp32 copy; the model's own output goes as the wrapper returns).
    keep: logits_to_keep, the last positions the head runs on (0: all)."""
    if m.autocast is None:
        return causal_lm(g, m, idx, None, None, keep)[1]
    with m.autocast.region(g):
        half = causal_lm(g, m, idx, None, None, keep)[1]
    with g.scoped("logits"):
        logits = aten.to(g, half, "fp32")
    del half
    return logits


def shifted_logits(g: Graph, logits: Tensor, copy: bool) -> Tensor:
    """logits[..., :-1, :] (SliceBackward0: backward slice_backward, a zero logits-shaped gradient with this one
    copied in), .contiguous()'d where `copy` (a clone, CloneBackward0: the gradient passes through)."""
    B, T, V = logits.shape
    full = logits.shape

    def rule(gs):
        return [made(g, full, "slice_backward", gs[0], dtype=gs[0].dtype)]

    node = g.begin("slice", [logits], rule)
    out = g.view(logits, (B, T - 1, V))
    g.end(node, [out])
    if not copy:
        return out
    node = g.begin("clone", [out], lambda gs: [gs[0]])
    copied = made(g, out.shape, "clone", out, dtype=out.dtype)
    g.end(node, [copied])
    return copied


def shifted(g: Graph, x: Tensor, copy: bool) -> Tensor:
    """x[..., 1:] of the batch's int64 ids or mask: a view, or its .contiguous() copy."""
    B, T = x.shape
    return made(g, (B, T - 1), "clone", x, dtype=x.dtype) if copy else g.view(x, (B, T - 1))


def selective_log_softmax(g: Graph, logits: Tensor, labels: Tensor, watched: bool) -> Tensor:
    """trl/trainer/utils.py selective_log_softmax(logits, index): the index unsqueezed; fp32 logits: torch.gather of
    each label's logit, torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits]) (iterating unbinds the rows),
    their difference; 16-bit ones: for each row (zip unbinds both) log_softmax and its gather, stacked. The result
    squeezed (a view)."""
    B, T, V = logits.shape
    index = g.view(labels, (B, T, 1))
    if logits.dtype == "fp32":
        selected = aten.gather(g, logits, index)
        lse = stack(g, [logsumexp(g, row, watched) for row in unbind(g, logits)])
        per_token = aten.sub(g, selected, aten.view(g, lse, (B, T, 1)))
        del selected, lse
    else:
        picked, row_logps = [], None
        for row in unbind(g, logits):
            row_logps = aten.log_softmax(g, row)
            picked.append(aten.gather(g, row_logps, g.view(index, (T, 1))))
        per_token = stack(g, picked)
        del picked, row_logps
    return aten.view(g, per_token, (B, T))  # .squeeze(-1)


def unbind(g: Graph, x: Tensor) -> list[Tensor]:
    """x.unbind(0) (UnbindBackward0): a view of each row; backward stacks the rows' gradients (unbind_backward:
    at::stack) into one x-shaped tensor."""
    shape = x.shape
    node = g.begin("unbind", [x], lambda gs: [made(g, shape, "stack", *gs, dtype=gs[0].dtype)])
    rows = [g.view(x, shape[1:]) for _ in range(shape[0])]
    g.end(node, rows)
    return rows


def stack(g: Graph, parts: list[Tensor]) -> Tensor:
    """torch.stack(parts) (StackBackward0: saves nothing): one new tensor; backward unbinds the gradient (views)."""
    shape, n = parts[0].shape, len(parts)
    node = g.begin("stack", parts, lambda gs: [g.view(gs[0], shape) for _ in range(n)])
    out = made(g, (len(parts),) + shape, "stack", *parts, dtype=parts[0].dtype)
    g.end(node, [out])
    return out


def logsumexp(g: Graph, x: Tensor, watched: bool) -> Tensor:
    """torch.logsumexp(x, dim=-1) of a (rows, V) row block (LogsumexpBackward0: saves x and the result; backward
    grad.unsqueeze(-1) * (x - result.unsqueeze(-1)).exp(): the difference, its exp, the product). Its kernel
    (aten/src/ATen/native/ReduceOps.cpp logsumexp_out_impl) makes the max per row, its abs == inf test and x - max
    (exp_ in place) before the sum: on CUDA they count; a dispatch mode (watched) sees the op's output alone."""
    rows, V = shape = x.shape
    dtype, read = x.dtype, x.nbytes  # the rule reads the saved row, which it must not keep alive

    def rule(gs):
        diff = made(g, shape, "sub", read, dtype=dtype)
        exp = made(g, shape, "exp", diff, dtype=dtype)
        out = made(g, shape, "mul", gs[0], exp, dtype=dtype)
        del diff, exp  # the expression's temporaries go once it is done
        return [out]

    node = g.begin("logsumexp", [x], rule, [(x, "self")])
    if watched:
        out = made(g, (rows,), "logsumexp", x, dtype=x.dtype)
    else:
        maxes = made(g, (rows, 1), "amax", x, dtype=x.dtype)
        infinite = made(g, (rows,), "eq", made(g, (rows,), "abs", maxes, dtype=x.dtype), dtype="bool")
        del infinite  # maxes_squeezed.masked_fill_(maxes_squeezed.abs() == INFINITY, 0)
        shifted_exp = made(g, x.shape, "sub", x, maxes, dtype=x.dtype)  # (self - maxes).exp_()
        out = made(g, (rows,), "sum", shifted_exp, dtype=x.dtype)
        del shifted_exp, maxes
    g.end(node, [out], [(out, "result")])
    return out


def zero_masked(g: Graph, x: Tensor, mask: Tensor, device: str) -> None:
    """x[mask == 0] = 0.0 on the squeezed log-probabilities (every position a completion token: none selected): the
    bool test, the 0.0 as a 0-d tensor of x's dtype (python_variable_indexing.cpp valueToTensor: scalar_tensor on the
    device; on the CPU made outside the dispatcher, which first sees it from lift_fresh), index_put_ in place, which
    autograd records on the view's base (CopySlices around IndexPutBackward0, which saves the bool index) and
    regenerates the view's own node (AsStridedBackward0). Backward: the view's gradient into a zero buffer of the
    base's size (as_strided_backward), then CopySlices: the base's gradient copied into a new one, the slice's clone,
    index_put of a zero into it (out of place), copied back."""
    shape = x.shape

    def copy_slices(gs):
        result = made(g, shape, "new_empty_strided", gs[0], dtype=gs[0].dtype)
        sliced = made(g, shape, "clone", result, dtype=gs[0].dtype)
        zeros = made(g, (), "zeros", dtype=gs[0].dtype)
        put = made(g, shape, "index_put", sliced, zeros, dtype=gs[0].dtype)
        del sliced, zeros, put
        return [result]

    selected = made(g, shape, "eq", mask, dtype="bool")
    value = made(g, (), "lift_fresh" if device == "cpu" else "scalar_tensor", dtype=x.dtype)
    node = g.begin("index_put_", [x], copy_slices, [(selected, "indices")])
    g.end(node, [x])
    node = g.begin("as_strided", [x], lambda gs: [made(g, shape, "new_zeros", gs[0], dtype=gs[0].dtype)])
    g.end(node, [x])
    del selected, value


def metrics(g: Graph, shift_logits: Tensor, shift_labels: Tensor, shift_mask: Tensor, copies: bool,
            watched: bool) -> list[Tensor]:  # fmt: skip
    """_compute_loss's logged metrics from the logits, in its order (the rewards follow: dpo.reward_metrics); what
    stays bound in its frame until it returns is returned. copies: 1.3-1.5's shifted logits are their own copy, which
    entropy_from_logits reshapes as a view (a strided view's reshape copies)."""
    B2, T, V = shift_logits.shape
    half = (B2 // 2, T)
    per_token = trl.entropy_from_logits(g, shift_logits, B2 * T, copy=not copies)
    entropy_sum, total_tokens = trl.masked_entropy(g, g.view(per_token, (B2, T)), shift_mask)
    entropy_sum = made(g, (), "sum", entropy_sum, dtype=per_token.dtype)  # gather_for_metrics(...).sum()
    total_tokens = made(g, (), "sum", total_tokens, dtype="int64")
    trl.ratio(g, entropy_sum, total_tokens)
    trl.train_tokens(g, (B2, T + 1))  # gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
    chosen_logits = g.view(shift_logits, (B2 // 2, T, V))  # shift_logits.detach().chunk(2, dim=0)
    chosen_mask = g.view(shift_mask, half)  # shift_completion_mask.chunk(2, dim=0)
    totals = []
    for _half in ("chosen", "rejected"):  # logits[mask.bool()].mean(-1).sum(), then mask.sum()
        as_bool = made(g, half, "_to_copy", chosen_mask, dtype="bool")
        picked = index_rows(g, chosen_logits, as_bool, watched)
        del as_bool
        means = made(g, (B2 // 2 * T,), "mean", picked, dtype=picked.dtype)
        del picked
        totals.append(made(g, (), "sum", means, dtype=means.dtype))
        del means
        totals.append(made(g, (), "sum", chosen_mask, dtype="int64"))
    for i, total in enumerate(totals):  # gather_for_metrics(total).sum().item(), rebound to the float
        made(g, (), "sum", total, dtype=total.dtype)
        totals[i] = None
        del total
    predictions = made(g, half, "argmax", chosen_logits, dtype="int64")
    chosen_mask = made(g, half, "_to_copy", shift_mask, dtype="bool")  # shift_completion_mask[:B].bool()
    equal = made(g, half, "eq", predictions, shift_labels, dtype="bool")
    correct_predictions = made(g, half, "bitwise_and", equal, chosen_mask, dtype="bool")
    del equal
    total_tokens = made(g, (), "sum", chosen_mask, dtype="int64")
    correct_tokens = made(g, (), "sum", correct_predictions, dtype="int64")
    total_sum = made(g, (), "sum", total_tokens, dtype="int64")
    trl.accuracy(g, correct_tokens, total_sum)
    return [per_token, entropy_sum, predictions, chosen_mask, correct_predictions, total_tokens, correct_tokens,
            total_sum]  # fmt: skip

