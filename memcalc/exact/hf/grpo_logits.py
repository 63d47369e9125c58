"""TRL 1.9-1.13's GRPOTrainer step (--stack trl:1.9, trl:1.10, trl:1.12, trl:1.13 --rl grpo) where it differs from
1.16's (memcalc.exact.hf.grpo, whose _compute_loss it shares: the same code from 1.9.1 to 1.16): the log-probabilities
come from the logits. trl/trainer/grpo_trainer.py _get_per_token_logps_and_entropies as the 1.9.2, 1.10.0, 1.12.0 and
1.13.0 wheels ship it (verify/trl_grpo.py runs it), the whole micro-batch one chunk (1.14 runs its Triton kernel
instead: not replayed):
  logits     model(input_ids, attention_mask, logits_to_keep=C + 1, use_cache=False) through Accelerate's prepared
             forward: the head on each row's last C + 1 positions (a strided view of the hidden states, which matmul
             does not fold: a batched bmm, memcalc.exact.aten.linear's strided), then under autocast
             convert_to_fp32's copy of the 16-bit logits
  tempered   logits[:, :-1, :] then logits[:, -C:, :] (each a SliceBackward0, the second of every position: its
             backward still a zero tensor of the logits' size), then divided by the temperature: in place up to 1.9
             (logits.div_: CopySlices on the fp32 logits, which stay held through backward), a new tensor from 1.10
  log-probs  selective_log_softmax over the completion's ids (memcalc.exact.hf.dpo_logits: over fp32, gather and
             each row's logsumexp; over 16-bit, each row's log_softmax)
  entropy    under no_grad (no entropy bonus): entropy_from_logits in chunks of 128 rows (its reshape copies 1.9's
             strided view)
  cat        torch.cat of each list's one chunk: copies; the frame's locals (the output, the logits) go as it returns
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from memcalc.model.stacks import GRPO_DIV_IN_PLACE

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import trl
from .dpo_logits import model_logits, selective_log_softmax, shifted_logits

if TYPE_CHECKING:
    from .family import HFModel


def per_token_logps_and_entropies(g: Graph, m: HFModel, input_ids: Tensor, attention_mask: Tensor, C: int,
                                  causal_lm: Callable) -> tuple[Tensor, Tensor]:  # fmt: skip
    """_get_per_token_logps_and_entropies(compute_entropy=True) from the logits: the completion's log-probs (they
    require grad) and entropies (they do not)."""
    B, T = input_ids.shape
    outputs = model_logits(g, m, input_ids, causal_lm, keep=C + 1)  # outputs.logits: (B, C + 1, V)
    in_place = m.cfg.stack.trl in GRPO_DIV_IN_PLACE
    with g.scoped("loss"):
        if in_place:  # logits[:, :-1, :], then [:, -logits_to_keep:, :], then logits.div_(self.temperature)
            logits = tempered(g, outputs, C)
        else:  # logits = logits[:, :-1, :]; logits = logits[:, -logits_to_keep:, :]; logits = logits / temperature
            shifted = whole_slice(g, shifted_logits(g, outputs, copy=False))
            logits = aten.div_scalar(g, shifted)
            del shifted
        completion_ids = g.view(input_ids, (B, C))  # input_ids_batch[:, -logits_to_keep:]
        logps = selective_log_softmax(g, logits, completion_ids, m.cfg.watched)
        # under torch.no_grad(); 1.9's view of C of each row's C + 1 positions flattens without a copy only as one row
        # or one position (a size-1 dimension merges with any stride)
        entropies = trl.entropy_from_logits(g, logits, B * C, copy=in_place and B > 1 and C > 1)
        all_logps = aten.cat(g, [logps], 0)  # torch.cat(all_logps, dim=0) of one chunk: a copy
        all_entropies = made(g, (B, C), "cat", entropies)
        del outputs, logits, completion_ids, logps, entropies  # the frame's locals, as it returns
        return all_logps, all_entropies


def whole_slice(g: Graph, x: Tensor) -> Tensor:
    """x[:, -C:, :] of a tensor C long in that dimension: every position, yet autograd records it (SliceBackward0:
    backward slice_backward, a zero tensor of x's size with the gradient copied in)."""
    shape = x.shape  # the rule keeps the shape, not the tensor (which would hold its storage)
    node = g.begin("slice", [x], lambda gs: [made(g, shape, "slice_backward", gs[0], dtype=gs[0].dtype)])
    out = g.view(x, shape)
    g.end(node, [out])
    return out


def tempered(g: Graph, logits: Tensor, C: int) -> Tensor:
    """A (B, C, V) slice of the (B, T, V) logits divided by the temperature in place (PPOTrainer's logits[:, P - 1:-1]
    /= temperature + 1e-7, GRPOTrainer's logits[:, :-1, :].div_ up to 1.9): in place on a view of a tensor autograd
    tracks, so the base's node becomes CopySlices around DivBackward0 (backward: the base's gradient copied into a new
    one, the slice cloned and divided, copied back) and the view's AsStridedBackward0 (backward: a zero buffer the
    base's size)."""
    B, T, V = full = logits.shape
    dtype = logits.dtype

    def copy_slices(gs):
        result = made(g, full, "new_empty_strided", gs[0], dtype=dtype)
        sliced = made(g, (B, C, V), "clone", result, dtype=dtype)
        divided = made(g, (B, C, V), "div", sliced, dtype=dtype)
        del sliced, divided
        return [result]

    node = g.begin("div_", [logits], copy_slices)
    g.end(node, [logits])
    view = g.view(logits, (B, C, V))
    node = g.begin("as_strided", [logits], lambda gs: [made(g, full, "new_zeros", gs[0], dtype=dtype)])
    g.end(node, [view])
    return view
