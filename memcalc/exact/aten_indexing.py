"""The aten ops that take an index tensor (memcalc.exact.aten): each saves its indices, and its backward
writes a dense gradient of the indexed tensor's shape. The embedding's row gather, nll_loss's pick of the
targets, and a mixture of experts' gather, index_select and index_add.
"""

from __future__ import annotations

from .aten_operands import autocast, size
from .config import ITEMSIZE
from .sim import Graph, Tensor, nbytes


def embedding(g: Graph, w: Tensor, idx: Tensor) -> Tensor:
    """F.embedding (EmbeddingBackward0): saves the indices; backward makes a dense (V, h) gradient.
    Forward gathers one row per index; backward writes the whole table's gradient and adds the rows in."""
    shape, idx_bytes = w.shape, nbytes(idx)

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "embedding_dense_backward")
        g.kernel("embedding_dense_backward", (gs[0], idx_bytes), (out,))
        return [out, None]

    node = g.begin("embedding", [w, idx], rule, [(idx, "indices")])
    out = g.empty(idx.shape + (w.shape[1],), w.dtype, "embedding")
    g.kernel("embedding", (idx, nbytes(out)), (out,))  # the rows gathered: as many bytes as written
    g.end(node, [out])
    return out


def nll_loss(g: Graph, logp: Tensor, target: Tensor) -> Tensor:
    """aten.nll_loss_forward, mean (NllLossBackward0): the loss and total_weight (fp32 scalars);
    saves target and total_weight. Backward: a dense (N, V) gradient, -1/N at each target, 0 elsewhere."""
    logp, target = autocast(g, "nll_loss", logp, target)
    shape, target_bytes = logp.shape, nbytes(target)
    picked = shape[0] * ITEMSIZE[logp.dtype]  # forward reads one log-probability per row

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "nll_loss_backward")
        g.kernel("nll_loss_backward", (gs[0], target_bytes), (out,))
        return [out, None]

    node = g.begin("nll_loss_forward", [logp, target], rule, [(target, "target")])
    loss = g.empty((), logp.dtype, "nll_loss_forward")
    total_weight = g.empty((), logp.dtype, "nll_loss_forward")
    g.kernel("nll_loss_forward", (target, picked), (loss, total_weight))
    g.end(node, [loss, total_weight], [(total_weight, "total_weight")])
    return loss


def gather(g: Graph, x: Tensor, index: Tensor) -> Tensor:
    """x.gather(1, index) (GatherBackward0): saves x (gather_backward takes it) and the index. Backward: a zero
    x-shaped tensor and an out-of-place scatter_add into a second one."""
    shape, index_bytes = x.shape, nbytes(index)

    def rule(gs):
        return [added_into_zeros(g, shape, "scatter_add", index_bytes, gs[0]), None]

    node = g.begin("gather", [x, index], rule, [(x, "self"), (index, "index")])
    out = g.empty(index.shape, x.dtype, "gather")
    g.kernel("gather", (index, nbytes(out)), (out,))
    g.end(node, [out])
    return out


def index_select(g: Graph, x: Tensor, index: Tensor) -> Tensor:
    """x.index_select(0, index) (IndexSelectBackward0): saves the index. Backward: index_select_backward, a zero
    x-shaped tensor and an out-of-place index_add into a second one."""
    shape, index_bytes = x.shape, nbytes(index)

    def rule(gs):
        return [added_into_zeros(g, shape, "index_add", index_bytes, gs[0]), None]

    node = g.begin("index_select", [x, index], rule, [(index, "index")])
    out = g.empty(index.shape + x.shape[1:], x.dtype, "index_select")
    g.kernel("index_select", (index, nbytes(out)), (out,))  # the rows gathered: as many bytes as written
    g.end(node, [out])
    return out


def added_into_zeros(g: Graph, shape: tuple, op: str, index_bytes: int, grad: Tensor) -> Tensor:
    """gather's and index_select's backward: a zero x-shaped tensor (new_zeros), then an out-of-place
    scatter_add or index_add of the gradient into a second one; the zeros freed."""
    zeros = g.empty(shape, grad.dtype, "new_zeros")
    g.kernel("new_zeros", (), (zeros,))
    out = g.empty(shape, grad.dtype, op)
    g.kernel(op, (zeros, index_bytes, grad), (out,))
    del zeros
    return out


def index_add_(g: Graph, out: Tensor, index: Tensor, source: Tensor) -> Tensor:
    """out.index_add_(0, index, source) on a tensor that needs no grad (IndexAddBackward0): saves the index and
    the source (its formula's expand_as(source) needs it); out takes the node. Backward: the source's
    gradient, grad.index_select(0, index)."""
    shape, index_bytes = source.shape, nbytes(index)

    def rule(gs):
        grad = g.empty(shape, gs[0].dtype, "index_select")
        g.kernel("index_select", (index_bytes, size(shape, gs[0].dtype)), (grad,))
        return [None, None, grad]

    node = g.begin("index_add", [out, index, source], rule, [(index, "index"), (source, "source")])
    g.kernel("index_add_", (out, index, source), (out,))
    g.end(node, [out])
    return out
