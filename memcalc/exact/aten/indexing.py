"""The aten ops that take an index tensor (memcalc.exact.aten): each saves its indices, and its backward
writes a dense gradient of the indexed tensor's shape. The embedding's row gather, nll_loss's pick of the
targets, and a mixture of experts' gather, index_select and index_add.
"""

from __future__ import annotations

from ..base.config import ITEMSIZE
from ..sim.graph import Graph
from ..sim.tensors import Tensor, nbytes
from .operands import autocast, made, size


def embedding(g: Graph, w: Tensor, idx: Tensor) -> Tensor:
    """F.embedding (EmbeddingBackward0): saves the indices; backward makes a dense (V, h) gradient.
    Forward gathers one row per index; backward writes the whole table's gradient and adds the rows in."""
    shape, idx_bytes = w.shape, nbytes(idx)

    def rule(gs):
        out = made(g, shape, "embedding_dense_backward", gs[0], idx_bytes, dtype=gs[0].dtype)
        return [out, None]

    node = g.begin("embedding", [w, idx], rule, [(idx, "indices")])
    out = g.empty(idx.shape + (w.shape[1],), w.dtype, "embedding")
    g.kernel("embedding", (idx, nbytes(out)), (out,))  # the rows gathered: as many bytes as written
    g.end(node, [out])
    return out


def nll_loss(g: Graph, logp: Tensor, target: Tensor) -> Tensor:
    """aten.nll_loss_forward, mean (NllLossBackward0): the loss and total_weight (fp32 scalars);
    saves self, target and total_weight, in that order (saved_tensors_hooks sees self first: its storage is the
    log_softmax's output, saved there already). Backward: a dense (N, V) gradient, -1/N at each target, 0 elsewhere."""
    logp, target = autocast(g, "nll_loss", logp, target)
    shape, target_bytes = logp.shape, nbytes(target)
    picked = shape[0] * ITEMSIZE[logp.dtype]  # forward reads one log-probability per row

    def rule(gs):
        out = made(g, shape, "nll_loss_backward", gs[0], target_bytes, dtype=gs[0].dtype)
        return [out, None]

    node = g.begin("nll_loss_forward", [logp, target], rule, [(logp, "self"), (target, "target")])
    loss = g.empty((), logp.dtype, "nll_loss_forward")
    total_weight = g.empty((), logp.dtype, "nll_loss_forward")
    g.kernel("nll_loss_forward", (target, picked), (loss, total_weight))
    g.end(node, [loss, total_weight], [(total_weight, "total_weight")])
    return loss


def gather(g: Graph, x: Tensor, index: Tensor) -> Tensor:
    """x.gather(1, index) (GatherBackward0): saves x (gather_backward takes it) and the index. Backward: a zero
    x-shaped tensor and scatter_add_ of the gradient into it (out of place where watched: indexed)."""
    return indexed(g, "gather", "scatter_add", x, index, index.shape, [(x, "self"), (index, "index")])


def index_select(g: Graph, x: Tensor, index: Tensor) -> Tensor:
    """x.index_select(0, index) (IndexSelectBackward0): saves the index. Backward: index_select_backward, a zero
    x-shaped tensor and index_add_ of the gradient into it (out of place where watched: indexed)."""
    return indexed(g, "index_select", "index_add", x, index, index.shape + x.shape[1:], [(index, "index")])


def indexed(g: Graph, op: str, backward_op: str, x: Tensor, index: Tensor, shape: tuple, saved: list) -> Tensor:
    """An op that picks x's elements at index into a new tensor of that shape, reading as many bytes as it
    writes; its node saves `saved`. Backward: a zero x-shaped tensor (new_zeros), then backward_op (scatter_add,
    index_add) of the gradient at index into it, in place (FunctionsManual.cpp gather_backward,
    index_select_backward_symint); where a dispatch mode watches (Graph.watched) the tensors are subclass-like and
    it runs out of place, into a second one, the zeros freed."""
    x_shape, index_bytes = x.shape, nbytes(index)

    def rule(gs):
        zeros = made(g, x_shape, "new_zeros", dtype=gs[0].dtype)
        if not g.watched:  # result.scatter_add_(dim, index, grad): nothing more allocated
            g.kernel(backward_op, (zeros, index_bytes, gs[0]), (zeros,))
            return [zeros, None]
        out = made(g, x_shape, backward_op, zeros, index_bytes, gs[0], dtype=gs[0].dtype)
        del zeros
        return [out, None]

    node = g.begin(op, [x, index], rule, saved)
    out = g.empty(shape, x.dtype, op)
    g.kernel(op, (index, nbytes(out)), (out,))  # the elements gathered: as many bytes as written
    g.end(node, [out])
    return out


def index_add_(g: Graph, out: Tensor, index: Tensor, source: Tensor) -> Tensor:
    """out.index_add_(0, index, source) on a tensor that needs no grad (IndexAddBackward0): saves the index and
    the source (its formula's expand_as(source) needs it); out takes the node. Backward: the source's
    gradient, grad.index_select(0, index)."""
    shape, index_bytes = source.shape, nbytes(index)

    def rule(gs):
        grad = made(g, shape, "index_select", index_bytes, size(shape, gs[0].dtype), dtype=gs[0].dtype)
        return [None, None, grad]

    node = g.begin("index_add", [out, index, source], rule, [(index, "index"), (source, "source")])
    g.kernel("index_add_", (out, index, source), (out,))
    g.end(node, [out])
    return out
