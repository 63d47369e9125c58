"""TRL's fused LM head (trl 1.15-1.16: trl/trainer/utils.py add_fused_lm_head, trl/kernels/chunked_logprob.py
ChunkedLogProbFunction), op by op in bytes on memcalc.exact.sim.graph.

SFTTrainer.__init__ patches the model PEFT wraps (add_fused_lm_head(outputs=("log_probs", "entropy", "is_top1"))):
called with fused_lm_head=True, its forward runs the backbone, drops the last position and the first label, and
scores only the positions whose label is not -100 (on CUDA: hidden_states[mask], labels[mask]) through
ChunkedLogProbFunction. That Function holds no logits: the head runs on (4096, 32768) tiles of one reused buffer,
each folded by a Triton kernel (which allocates nothing) into seven fp32 per-token statistics; its backward
recomputes each tile, turns it into the logits' gradient in place and accumulates the two gradient GEMMs into fp32
buffers (torch.addmm(..., out_dtype=torch.float32, out=acc) on CUDA). The per-token outputs are scattered back to
(B, T - 1) (new_zeros(...).masked_scatter(mask, x)). Every position is taken to be scored (no padding, no prompt
masked): the most the step holds. GRPOTrainer and RLOOTrainer mask the prompt: B x C completion positions scored.

watched (StepConfig.watched): the step as verify's TorchDispatchMode measures it, on meta or CPU tensors. With a
mode on, autograd takes every tensor as subclass-like (torch/csrc/autograd/FunctionsManual.cpp index_backward,
aten/src/ATen/TensorSubclassLikeUtils.h), so the boolean index's backward writes into a second buffer
(index_put) where CUDA accumulates into the zeros in place (_index_put_impl_); and what an op allocates inside
itself is not seen: the indices nonzero makes for a boolean index or masked_select (aten/src/ATen/native/cuda/
Nonzero.cu: (nnz, ndim) int64) and masked_scatter_'s prefix sum (cuda/IndexKernel.cpp: int64, the mask's size).
Not counted on CUDA either: cub's scratch in nonzero and masked_scatter_ (a few KiB, freed in the op) and the
int64 index vectors the accumulating index_put sorts (cuda/Indexing.cu index_put_with_sort_kernel: a few times
nnz x 8 bytes, freed in the op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.model.stacks import FUSED_HEAD

from .. import aten
from ..aten.operands import made
from ..base.config import ITEMSIZE
from ..sim.checkpoint import saved_of
from ..sim.graph import Graph
from ..sim.tensors import Tensor

if TYPE_CHECKING:
    from .family import HFModel

TOKEN_CHUNK = 4096  # chunked_logprob.py TOKEN_CHUNK_SIZE: the tile's rows
VOCAB_CHUNK = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE: the tile's columns
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")  # SFTTrainer.__init__'s add_fused_lm_head(outputs=...)
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")  # DPOTrainer.__init__'s
GRPO_OUTPUTS = ("log_probs", "entropy")  # GRPOTrainer.__init__'s
RL_OUTPUTS = {"dpo": DPO_OUTPUTS, "grpo": GRPO_OUTPUTS, "rloo": GRPO_OUTPUTS}  # by --rl (RLOOTrainer's as GRPO's)
STATISTICS = ("full", "zeros", "zeros", "zeros", "zeros", "full", "zeros")  # running_max ... target_logit


def not_replayed(cfg) -> str | None:
    """Why the replay cannot run TRL's fused LM head on this step, or None (no fused head: None): LoRA on the head or
    its trained copy (the head's weight is read as lm_head.weight, outside the module's forward)."""
    ft = cfg.finetune
    if cfg.stack.trl not in FUSED_HEAD or not ("lm_head" in ft.targets or "lm_head" in ft.modules_to_save):
        return None
    return ("TRL 1.15-1.16's SFTTrainer with LoRA on lm_head or lm_head in --modules-to-save: its fused LM head reads "
            "lm_head.weight outside the head's forward, which is not replayed")  # fmt: skip


@dataclass
class FusedOutput:
    """FusedCausalLMOutput as SFTTrainer reads it: the per-token fields, (B, T - 1) and zero where the label is -100,
    and the label mask."""

    loss: Tensor
    log_probs: Tensor
    entropy: Tensor | None  # None where not asked for (DPO's reference model: log_probs alone)
    is_top1: Tensor | None
    label_mask: Tensor
    mean_logits: Tensor | None = None  # DPOTrainer's outputs (memcalc.exact.hf.dpo)


def fused_forward(g: Graph, m: HFModel, hidden_states: Tensor, head: Tensor, labels: Tensor) -> FusedOutput:
    """add_fused_lm_head's _fused_forward after the backbone: last_hidden_state[:, :-1] and labels[:, 1:] (views),
    the mask, the compact rows and targets, ChunkedLogProbFunction, the outputs scattered back, and the model's own
    loss, -log_probs.sum() / mask.sum().clamp(min=1) (built, then left unused by SFTTrainer and DPOTrainer). The
    outputs are those the trainer asked add_fused_lm_head for (SFTTrainer's, DPOTrainer's)."""
    B, T, H = hidden_states.shape
    watched = m.cfg.watched
    with g.scoped("logits"):
        shifted = sliced(g, hidden_states, (B, T - 1, H))
        shifted_labels = g.view(labels, (B, T - 1))
        mask = made(g, (B, T - 1), "ne", shifted_labels, dtype="bool")
        online = m.cfg.stack.online  # GRPO's and RLOO's labels[:, :-C] = -100: the completion's positions alone
        kept = B * min(online.completion_len, T - 1) if online else None
        rows = index_rows(g, shifted, mask, watched, kept)
        targets = index_rows(g, shifted_labels, mask, watched, kept)
        compute = m.cfg.precision if m.autocast is not None else hidden_states.dtype
        del shifted, shifted_labels
        outputs = m.outputs or RL_OUTPUTS.get(m.cfg.stack.rl, SFT_OUTPUTS)
        per_token = chunked_logprob(g, rows, head, targets, compute, outputs)
        del rows, targets
        per_token = (None if x is None else scattered(g, x, mask, watched) for x in per_token)
        log_probs, entropy, mean_logits, is_top1 = per_token
    with g.scoped("loss"):  # num_items_in_batch: None, as SFTTrainer calls it (mask.sum().clamp(min=1) instead)
        summed = aten.sum_all(g, log_probs)
        negated = aten.neg(g, summed)
        del summed
        count = made(g, (), "sum", mask, dtype="int64")
        clamped = made(g, (), "clamp", count, dtype="int64")
        del count
        loss = aten.div_tensor(g, negated, clamped)
        del negated, clamped
    return FusedOutput(loss, log_probs, entropy, is_top1, mask, mean_logits)


def sliced(g: Graph, x: Tensor, shape: tuple) -> Tensor:
    """x[:, :-1] (SliceBackward0): a view; backward writes the gradient into a zero tensor of x's shape
    (slice_backward)."""
    full = x.shape

    def rule(gs):
        return [made(g, full, "slice_backward", gs[0], dtype=gs[0].dtype)]

    node = g.begin("slice", [x], rule)
    out = g.view(x, shape)
    g.end(node, [out])
    return out


def index_rows(g: Graph, x: Tensor, index: Tensor, watched: bool, kept: int | None = None) -> Tensor:
    """x[index] (aten.index; IndexBackward0: saves the index) over x's leading dims: a boolean mask's (nonzero's
    (nnz, mask.dim()) int64 indices made and dropped inside it on CUDA), every position kept; or an int64 index's
    first. Backward (index_backward): new_zeros of x's shape, the gradient accumulated into it at the index: in place
    on CUDA (_index_put_impl_), into a second buffer where a dispatch mode watches (index_put). kept: the positions a
    boolean mask keeps, where not all (GRPO's labels mask the prompt)."""
    n, dims = kept or index.numel, len(index.shape) if index.dtype == "bool" else 1
    shape, dtype, full = (n,) + tuple(x.shape[dims:]), x.dtype, x.shape

    def rule(gs):
        zeros = made(g, full, "new_zeros", dtype=gs[0].dtype)
        if not watched:
            g.kernel("index_put_", (gs[0], n * 8 * dims), (zeros,))
            return [zeros, None]
        out = made(g, full, "index_put", zeros, gs[0], dtype=gs[0].dtype)
        del zeros
        return [out, None]

    node = g.begin("index", [x, index], rule, [(index, "indices")])
    nonzero = None if watched or index.dtype != "bool" else made(g, (n, dims), "nonzero", index, dtype="int64")
    out = made(g, shape, "index", x, index if nonzero is None else nonzero, dtype=dtype)
    del nonzero
    g.end(node, [out])
    return out


def scattered(g: Graph, x: Tensor, mask: Tensor, watched: bool) -> Tensor:
    """x.new_zeros(mask.shape).masked_scatter(mask, x): the zeros, their clone (masked_scatter out of place: clone,
    then masked_scatter_ with its int64 prefix sum on CUDA), the zeros dropped (MaskedScatterBackward0: saves the
    mask). Backward: masked_scatter_backward, grad.masked_select(mask) (nonzero's indices inside it on CUDA)."""
    n, shape, mask_bytes = x.numel, mask.shape, mask.nbytes

    def rule(gs):
        indices = None if watched else made(g, (n, 2), "nonzero", mask_bytes, dtype="int64")
        out = made(g, (n,), "masked_scatter_backward", gs[0], 0 if indices is None else indices, dtype=gs[0].dtype)
        del indices
        return [None, None, out]

    zeros = made(g, shape, "new_zeros", dtype=x.dtype)
    node = g.begin("masked_scatter", [zeros, mask, x], rule, [(mask, "mask")])
    out = made(g, shape, "masked_scatter", zeros, dtype=x.dtype)
    prefix = None if watched else made(g, shape, "masked_scatter_", mask, dtype="int64")
    g.kernel("masked_scatter_", (mask, x), (out,))
    del prefix, zeros
    g.end(node, [out])
    return out


def chunked_logprob(g: Graph, hidden: Tensor, weight: Tensor, targets: Tensor, compute: str,
                    outputs: tuple[str, ...] = SFT_OUTPUTS) -> tuple[Tensor | None, ...]:  # fmt: skip
    """ChunkedLogProbFunction.forward with outputs (SFT's "log_probs", "entropy", "is_top1"; DPO's "mean_logits" too,
    z_sum / vocab; log_sum_sq_probs is not replayed), compute: autocast's dtype
    under autocast, else the rows' (torch.get_autocast_dtype or hidden.dtype). The seven fp32 statistics, the tile
    buffer (min(N, 4096), 32768); per token chunk its rows cast to compute (a copy where they are not in it, held
    until the next chunk's), per vocabulary chunk the head's rows cast (a copy for that mm where they are not), the
    tile by mm(out=) and folded; then log_z = running_max + log(sum_exp), log_probs, entropy = log_z -
    x_sum_exp / sum_exp, is_top1 = (target >= max) & (target > max_before_target). Saves hidden, weight, targets,
    log_z, entropy; the statistics and the buffer go as it returns."""
    (N, H), (V, _) = hidden.shape, weight.shape
    rows_dtype, weight_dtype, trains_head = hidden.dtype, weight.dtype, weight.requires_grad
    tile_rows = min(N, TOKEN_CHUNK)

    def rule(gs):
        return chunked_logprob_backward(g, saved_now(), gs[0], (N, H), (V, H), rows_dtype, weight_dtype, compute,
                                        trains_head)  # fmt: skip

    node = g.begin("ChunkedLogProbFunction", [hidden, weight, targets], rule, function=True)
    saved_now = saved_of(node)
    stats = [made(g, (N,), op, dtype="fp32") for op in STATISTICS]
    buffer = g.empty((tile_rows, VOCAB_CHUNK), compute, "empty")
    rows = None
    for start in range(0, N, TOKEN_CHUNK):
        n = min(TOKEN_CHUNK, N - start)
        rows = cast_rows(g, (n, H), rows_dtype, compute, rows)  # hidden[...].to(compute): the local rebound
        for first in range(0, V, VOCAB_CHUNK):
            c = min(VOCAB_CHUNK, V - first)
            w = cast_rows(g, (c, H), weight_dtype, compute, None)  # weight[start:end].to(compute), for the mm
            g.kernel("mm", (n * H * ITEMSIZE[compute], c * H * ITEMSIZE[compute]), (n * c * ITEMSIZE[compute],),
                     "tensor", 2 * n * H * c, "logits", dtype=compute)  # fmt: skip
            g.kernel("chunked_logprob_forward", (n * c * ITEMSIZE[compute],), (n * 4 * 7,))
            del w
    log = made(g, (N,), "log", stats[1])
    log_z = made(g, (N,), "add", stats[0], log)
    del log
    log_probs = made(g, (N,), "sub", stats[6], log_z)
    entropy = entropy_of(g, log_z, stats) if "entropy" in outputs else None
    mean_logits = made(g, (N,), "div", stats[4]) if "mean_logits" in outputs else None
    is_top1 = top1_of(g, stats) if "is_top1" in outputs else None
    g.end(node, [log_probs] + ([entropy] if entropy is not None else []),
          [(hidden, "hidden"), (weight, "weight"), (targets, "targets"), (log_z, "log_z"),
           (log_z if entropy is None else entropy, "entropy")])  # fmt: skip
    del stats, buffer, rows, log_z  # the frame's locals, in order
    return log_probs, entropy, mean_logits, is_top1


def entropy_of(g: Graph, log_z: Tensor, stats: list[Tensor]) -> Tensor:
    """entropy = log_z - x_sum_exp / sum_exp."""
    ratio = made(g, log_z.shape, "div", stats[2], stats[1])
    return made(g, log_z.shape, "sub", log_z, ratio)


def top1_of(g: Graph, stats: list[Tensor]) -> Tensor:
    """is_top1 = (target_logit >= running_max) & (target_logit > max_before_target)."""
    at_least = made(g, stats[6].shape, "ge", stats[6], stats[0], dtype="bool")
    above = made(g, stats[6].shape, "gt", stats[6], stats[5], dtype="bool")
    return made(g, stats[6].shape, "bitwise_and", at_least, above, dtype="bool")


def cast_rows(g: Graph, shape: tuple, dtype: str, compute: str, previous: Tensor | None) -> Tensor | None:
    """hidden[start:end].to(compute) bound to the chunk's local: a copy where the rows are in another dtype, made
    while the previous chunk's copy is still held; None where it is a view (no bytes)."""
    del previous
    return made(g, shape, "_to_copy", dtype=compute) if dtype != compute else None


def chunked_logprob_backward(g: Graph, saved: list, grad_log_probs: Tensor, rows_shape: tuple, head_shape: tuple,
                             rows_dtype: str, weight_dtype: str, compute: str,
                             trains_head: bool) -> list:  # fmt: skip
    """ChunkedLogProbFunction.backward (grad_entropy None: the loss reads log_probs alone): grad_logprobs is fp32
    and contiguous already; fp32 zeros for the rows' gradient (and the head's where it trains), the tile buffer;
    per token chunk the rows cast (held until the next chunk's), per vocabulary chunk the head's rows cast (the local
    w_chunk, held until the next one's), the tile recomputed, turned into the logits' gradient in place, and
    accumulated into the fp32 gradients by addmm(out_dtype=fp32, out=acc); returned cast back to the inputs'
    dtypes (a copy where they are not fp32)."""
    (N, H), (V, _) = rows_shape, head_shape
    del saved
    grad_rows = made(g, (N, H), "zeros", dtype="fp32")
    grad_head = made(g, (V, H), "zeros", dtype="fp32") if trains_head else None
    buffer = g.empty((min(N, TOKEN_CHUNK), VOCAB_CHUNK), compute, "empty")
    rows = w = None
    for start in range(0, N, TOKEN_CHUNK):
        n = min(TOKEN_CHUNK, N - start)
        rows = cast_rows(g, (n, H), rows_dtype, compute, rows)
        for first in range(0, V, VOCAB_CHUNK):
            c = min(VOCAB_CHUNK, V - first)
            w = cast_rows(g, (c, H), weight_dtype, compute, w)  # weight[start:end].to(compute): the local w_chunk
            tile = n * c * ITEMSIZE[compute]
            g.kernel("mm", (n * H * ITEMSIZE[compute], c * H * ITEMSIZE[compute]), (tile,), "tensor", 2 * n * H * c,
                     "logits", dtype=compute)  # fmt: skip
            g.kernel("chunked_logprob_backward", (tile, grad_log_probs), (tile,))
            g.kernel("addmm", (tile, c * H * ITEMSIZE[compute], grad_rows), (grad_rows,), "tensor", 2 * n * H * c,
                     "logits", dtype=compute)  # fmt: skip
            if grad_head is not None:
                g.kernel("addmm", (tile, n * H * ITEMSIZE[compute], grad_head), (grad_head,), "tensor",
                         2 * n * H * c, "logits", dtype=compute)  # fmt: skip
    d_rows = grad_rows if rows_dtype == "fp32" else made(g, (N, H), "_to_copy", grad_rows, dtype=rows_dtype)
    d_head = None
    if grad_head is not None:
        d_head = grad_head if weight_dtype == "fp32" else made(g, (V, H), "_to_copy", grad_head, dtype=weight_dtype)
    del grad_rows, grad_head, buffer, rows, w  # the frame's locals, in order
    return [d_rows, d_head, None]
