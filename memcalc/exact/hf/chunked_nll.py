"""TRL's chunked_nll loss (SFTConfig(loss_type="chunked_nll"): the default from 1.7 to 1.14, offered from 1.4), op
by op in bytes on memcalc.exact.sim.graph (huggingface/trl trl/trainer/sft_trainer.py _patch_chunked_ce_lm_head,
_chunked_cross_entropy_loss and _chunk, as the trl 1.6.0 to 1.14.2 wheels ship them).

SFTTrainer.__init__ patches the forward of the model PEFT wraps: with labels, it runs the backbone (use_cache=False)
and scores the shifted positions 256 at a time, each chunk's head and loss under torch.utils.checkpoint
(use_reentrant=False), so no (B, T, V) logits are made. What each release allocates differs in three ways:
  which rows   1.4-1.7 keep the positions whose label is not -100 (hidden[valid], a boolean index: nonzero's
               indices inside it on CUDA); from 1.8 every position, ordered by the mask (valid.to(int8).argsort(
               stable=True), hidden[order]), the chunk count rounded up on the device (1.8-1.10 test it against 0
               first; 1.11 clamps it to one chunk at least)
  the matmul   up to 1.12 h.float() @ w.float().t(): an fp32 copy of the whole head per chunk where it is 16-bit
               (LoRA's frozen base: 2.1 GB for Llama-3-8B's), which torch.autocast then casts back to 16 bits for
               the matmul (another copy, saved by it); from 1.13 (h @ w.to(h.dtype).t()).float(): no copy of the
               head where it is in the rows' dtype, the chunk's logits upcast once
  the count    1.4-1.7 torch.tensor(n_valid) from the host; from 1.8 valid.sum()
Every chunk returns its loss sum, its top-1 count and its entropy sum (0-d); the patched forward divides the loss by
num_items_in_batch, and SFTTrainer.compute_loss logs the entropy and accuracy from the counts (chunked_metrics), with
no logits. Every position is taken to be scored (no padding, no prompt masked): the most the step holds.

watched: as in memcalc.exact.hf.fused_head, the index's backward writes into a second buffer where a dispatch mode
watches, and nonzero's indices inside a boolean index are not seen. Not counted on CUDA either: the sort's scratch
(cub's radix sort, freed in the op) and the int64 vectors the accumulating index_put sorts (freed in the op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.model.stacks import CHUNKED_FP32

from .. import aten
from ..aten.activations import in_fp32
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .fused_head import index_rows, sliced

if TYPE_CHECKING:
    from .family import HFModel

CHUNK = 256  # sft_trainer.py _CHUNKED_LM_HEAD_CHUNK_SIZE
DROPPED = ("1.6", "1.7")  # 1.4-1.7: hidden[valid], n_valid on the host
TESTED = ("1.8", "1.9", "1.10")  # 1.8-1.10: `if n_valid_tensor == 0`, a 0-d bool on the device


def not_replayed(cfg) -> str | None:
    """Why the replay cannot run chunked_nll on this step, or None: SFTTrainer refuses LoRA on lm_head ("not supported
    when lm_head is wrapped by a PEFT adapter"), and the head's trained copy (modules_to_save) is read as
    lm_head.weight through PEFT's wrapper, which is not replayed."""
    ft = cfg.finetune
    if cfg.stack.loss != "chunked_nll" or not ("lm_head" in ft.targets or "lm_head" in ft.modules_to_save):
        return None
    return ("loss_type chunked_nll with LoRA on lm_head (which SFTTrainer refuses) or lm_head in --modules-to-save "
            "(read through PEFT's wrapper) is not replayed: --loss nll")  # fmt: skip


@dataclass
class ChunkedOutput:
    """_ChunkedCELMHeadOutput as compute_loss reads it: the loss and the three 0-d counts (no logits)."""

    loss: Tensor
    num_correct_tokens: Tensor
    entropy_sum: Tensor
    num_valid_tokens: Tensor


def chunked_forward(g: Graph, m: HFModel, hidden_states: Tensor, head: Tensor, labels: Tensor,
                    num_items_in_batch: Tensor) -> ChunkedOutput:  # fmt: skip
    """_chunked_ce_forward after the backbone: _chunked_cross_entropy_loss(hidden_states, lm_head.weight, 256,
    labels=labels, num_items_in_batch=...), as the stack's release writes it."""
    line = m.cfg.stack.trl
    B, T, H = hidden_states.shape
    n = B * (T - 1)
    with g.scoped("logits"):
        hidden = sliced(g, hidden_states, (B, T - 1, H))  # hidden_states[..., :-1, :].reshape(-1, H)
        hidden = aten.view(g, hidden, (n, H)) if B == 1 else aten.reshape_copy(g, hidden, (n, H))
        shifted = g.view(labels, (n,)) if B == 1 else made(g, (n,), "clone", labels, dtype="int64")
        valid = made(g, (n,), "ne", shifted, dtype="bool")
        if line in DROPPED:  # hidden[valid], labels[valid]: each rebinds its name (a copy made by reshape goes)
            hidden = index_rows(g, hidden, valid, m.cfg.watched)
            shifted = index_rows(g, shifted, valid, m.cfg.watched)
            correct, entropy_sum = made(g, (), "new_zeros"), made(g, (), "new_zeros")
            count = host_tensor(g, m.cfg.watched and m.cfg.device != "cpu")  # torch.tensor(n_valid, device=...)
            held = []
        else:
            count, correct, entropy_sum, order = ordering(g, line, valid)
            hidden = index_rows(g, hidden, order, m.cfg.watched)  # hidden[order]
            shifted = made(g, (n,), "index", shifted, order, dtype="int64")  # labels[order]
            held = [order, padded_count(g, line, count)]  # the locals order and n_padded
        loss = made(g, (), "new_zeros")
        chunk_loss = chunk_correct = chunk_entropy = None
        for start in range(0, -(-n // CHUNK) * CHUNK, CHUNK):  # every position kept: n_valid rounded up to chunks
            rows = min(CHUNK, n - start)
            h_chunk = sliced(g, hidden, (rows, H))  # hidden[start:start + 256]
            lbl_chunk = g.view(shifted, (rows,))
            chunk_loss, chunk_correct, chunk_entropy = g.checkpoint(
                lambda h, w, lbl: chunk(g, m, line, h, w, lbl), h_chunk, head, lbl_chunk)
            loss = aten.add(g, loss, chunk_loss)
            correct = made(g, (), "add", correct, chunk_correct)
            entropy_sum = aten.add(g, entropy_sum, chunk_entropy)
            del h_chunk, lbl_chunk
    with g.scoped("loss"):
        loss = aten.div_tensor(g, loss, num_items_in_batch)  # loss / num_items_in_batch
    del shifted, hidden, valid, held, chunk_loss, chunk_correct, chunk_entropy  # the frame's locals, in order
    return ChunkedOutput(loss, correct, entropy_sum, count)


def host_tensor(g: Graph, unseen: bool) -> Tensor:
    """torch.tensor(n_valid, device=...): a 0-d int64 from the host (torch/csrc/utils/tensor_new.cpp
    internal_new_from_data, then aten.lift_fresh). unseen: where verify's dispatch mode watches meta tensors, which
    it does not see made (the copy to the device runs with the Python dispatch key excluded, and lift_fresh hands
    back the tensor it is given): a tensor of no bytes stands in. On CPU lift_fresh's tensor is new to it."""
    if unseen:
        return g.view(g.empty((0,), "int64", "tensor"), ())
    return made(g, (), "lift_fresh", dtype="int64")


def ordering(g: Graph, line: str, valid: Tensor) -> tuple:
    """From 1.8: n_valid_tensor = valid.sum(), the two fp32 zeros, (1.8-1.10) the `== 0` test, and order =
    valid.to(int8).argsort(descending=True, stable=True) (aten.sort.stable: int8 values and int64 indices, the
    values and the int8 copy gone)."""
    n = valid.numel
    count = made(g, (), "sum", valid, dtype="int64")
    correct, entropy_sum = made(g, (), "new_zeros"), made(g, (), "new_zeros")
    if line in TESTED:
        test = made(g, (), "eq", count, dtype="bool")
        del test
    flags = made(g, (n,), "_to_copy", valid, dtype="int8")
    values = made(g, (n,), "sort", flags, dtype="int8")
    order = made(g, (n,), "sort", flags, dtype="int64")
    del values, flags
    return count, correct, entropy_sum, order


def padded_count(g: Graph, line: str, count: Tensor) -> Tensor:
    """n_padded = (n_valid_tensor / 256).ceil() (.clamp(min=1) from 1.11).to(int64) * 256: each step a 0-d tensor,
    the one before it gone; range() reads the last on the host."""
    padded = made(g, (), "div", count)
    for op in ("ceil",) + (() if line in TESTED else ("clamp",)):
        padded = made(g, (), op, padded)
    padded = made(g, (), "_to_copy", padded, dtype="int64")
    return made(g, (), "mul", padded, dtype="int64")


def chunk(g: Graph, m: HFModel, line: str, h: Tensor, w: Tensor, lbl: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """_chunk(h, w, None, lbl, logit_scale=1.0, final_logit_softcapping), inside its checkpoint: the chunk's logits
    (up to 1.12 from fp32 copies of the rows and the head, which autocast casts back for the matmul; from 1.13 in the
    rows' dtype, then .float()), Gemma 2's softcap, F.log_softmax (fp32 under autocast), F.nll_loss(reduction="sum"),
    the top-1 count (argmax == lbl, from 1.8 & valid, .sum().float()) and the entropy sum (-(log_p.exp() *
    log_p).sum(-1), from 1.8 * valid, .sum()), built with grad on (its nodes die unused with compute_loss's
    outputs)."""
    rows = h.shape[0]
    if line in CHUNKED_FP32:
        a = aten.to(g, h, "fp32")
        b = aten.t(g, aten.to(g, w, "fp32"))
    else:
        a, b = h, aten.t(g, aten.to(g, w, h.dtype))
    a_cast, b_cast = aten.autocast(g, "matmul", a, b)
    logits = aten.mm(g, a_cast, b_cast, "logits")
    del a_cast, b_cast, a, b  # the wrapper's casts, then the expression's temporaries
    if line not in CHUNKED_FP32:
        logits = aten.to(g, logits, "fp32")
    if m.cfg.shape.logit_softcap:  # softcap * torch.tanh(logits / softcap)
        logits = aten.mul_scalar(g, aten.tanh(g, aten.div_scalar(g, logits)))
    log_p = in_fp32(g, logits, "log_softmax", "_log_softmax", "_log_softmax_backward_data")
    chunk_loss = aten.nll_loss(g, log_p, lbl)
    valid = None if line in DROPPED else made(g, (rows,), "ne", lbl, dtype="bool")  # every row is labelled in 1.4-1.7
    top1 = made(g, (rows,), "argmax", logits, dtype="int64")
    hits = made(g, (rows,), "eq", top1, lbl, dtype="bool")
    del top1
    if valid is not None:
        hits = made(g, (rows,), "bitwise_and", hits, valid, dtype="bool")
    count = made(g, (), "sum", hits, dtype="int64")
    del hits
    chunk_correct = made(g, (), "_to_copy", count)
    del count
    product = aten.mul(g, aten.exp(g, log_p), log_p)
    per_row = aten.sum_last(g, product)
    del product
    if valid is None:  # -(log_p.exp() * log_p).sum(dim=-1).sum()
        total = aten.sum_all(g, per_row)
        del per_row
        chunk_entropy = aten.neg(g, total)
    else:  # (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
        total = aten.neg(g, per_row)
        del per_row
        total = aten.mul(g, total, valid)
        chunk_entropy = aten.sum_all(g, total)
    del total, logits, log_p, valid  # the last temporary, then the frame's locals
    return chunk_loss, chunk_correct, chunk_entropy
