"""The aten ops that reshape, split, join, slice or pad a tensor (memcalc.exact.aten): views, whose
backward views the gradient back (a copy where it arrives non-contiguous); reshape's copy; split and
chunk, whose backward is a cat; cat, whose backward narrows; a slice, whose backward writes zeros; a pad.
"""

from __future__ import annotations

from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .operands import autocast, made, promote, size


def view(g: Graph, t: Tensor, shape, grad_copies: bool = False) -> Tensor:
    """A view (view, reshape without copy, transpose, unsqueeze): backward reshapes the gradient back,
    a copy when it arrives non-contiguous (grad_copies)."""
    in_shape = t.shape

    def rule(gs):
        if not grad_copies:
            return [g.view(gs[0], in_shape)]
        return [made(g, in_shape, "clone", gs[0], dtype=gs[0].dtype)]

    node = g.begin("view", [t], rule)
    out = g.view(t, shape)
    g.end(node, [out])
    return out


def reshape_copy(g: Graph, t: Tensor, shape) -> Tensor:
    """reshape of a tensor that cannot be viewed: clone, then _unsafe_view (backward: views)."""
    in_shape = t.shape
    node = g.begin("clone", [t], lambda gs: [g.view(gs[0], in_shape)])
    out = made(g, shape, "clone", t, dtype=t.dtype)
    g.end(node, [out])
    return out


def expand(g: Graph, t: Tensor, shape) -> Tensor:
    """expand: a view; its backward formula sums over the expanded dims (at::sum_to, a new tensor)."""
    in_shape = t.shape

    def rule(gs):
        if gs[0].shape == in_shape:
            return [gs[0]]
        return [made(g, in_shape, "sum", gs[0], dtype=gs[0].dtype)]

    node = g.begin("expand", [t], rule)
    out = g.view(t, shape)
    g.end(node, [out])
    return out


def t(g: Graph, w: Tensor) -> Tensor:
    """w.t(): a view; its gradient is a view too (mm lays it out so that no copy is needed)."""
    shape = w.shape
    node = g.begin("t", [w], lambda gs: [g.view(gs[0], shape)])
    out = g.view(w, (w.shape[1], w.shape[0]))
    g.end(node, [out])
    return out


def chunk2(g: Graph, x: Tensor) -> tuple[Tensor, Tensor]:
    """x.chunk(2, -1): two views, split's."""
    half = x.shape[-1] // 2
    x1, x2 = split(g, x, [half, half], len(x.shape) - 1)
    return x1, x2


def split(g: Graph, x: Tensor, sizes: list, dim: int) -> list[Tensor]:
    """x.split(sizes, dim) (SplitWithSizesBackward0, SplitBackward0): views; backward cats every gradient into
    one x-shaped tensor. A size may be (n, copies): that many equal parts of n in a row, one view standing
    for them (memcalc.exact.sim.tensors.Region)."""
    shape = x.shape

    def rule(gs):
        return [made(g, shape, "cat", *tuple(gs), dtype=gs[0].dtype)]

    node = g.begin("split", [x], rule)
    each = [n if isinstance(n, tuple) else (n, 1) for n in sizes]
    parts = [Tensor(x.storage, shape[:dim] + (n,) + shape[dim + 1:], x.dtype, copies=c) for n, c in each]
    g.end(node, parts)
    return parts


def split_last(g: Graph, x: Tensor, size: int) -> list[Tensor]:
    """x.split(size, dim=-1) (SplitBackward0): views of `size` each, split's."""
    return split(g, x, [size for _ in range(x.shape[-1] // size)], len(x.shape) - 1)


def cat_last(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """torch.cat((a, b), -1) (CatBackward0): saves nothing; backward narrows the gradient (views)."""
    a, b = autocast(g, "cat", a, b)
    sa, sb = a.shape, b.shape
    node = g.begin("cat", [a, b], lambda gs: [g.view(gs[0], sa), g.view(gs[0], sb)])
    out = made(g, a.shape[:-1] + (a.shape[-1] + b.shape[-1],), "cat", a, b, dtype=promote((a.dtype, sa), (b.dtype, sb)))
    g.end(node, [out])
    return out


def cat(g: Graph, parts: list[Tensor], dim: int) -> Tensor:
    """torch.cat(parts, dim) (CatBackward0): saves nothing; backward narrows the gradient (views); a part
    standing for equal copies is that many parts in a row."""
    shapes = [(p.shape, p.copies) for p in parts]
    node = g.begin("cat", parts, lambda gs: [Tensor(gs[0].storage, s, gs[0].dtype, copies=c) for s, c in shapes])
    shape = parts[0].shape[:dim] + (sum(s[dim] * c for s, c in shapes),) + parts[0].shape[dim + 1:]
    out = made(g, shape, "cat", *tuple(parts), dtype=parts[0].dtype)
    g.end(node, [out])
    return out


def slice_last(g: Graph, x: Tensor, start: int, stop: int) -> Tensor:
    """x[..., start:stop] (SliceBackward0): a view of stop - start, as narrow_last's."""
    return narrow_last(g, x, stop - start)


def narrow_last(g: Graph, x: Tensor, width: int) -> Tensor:
    """x[..., :width] (SliceBackward0): a view; backward is slice_backward, a zero tensor of x's shape with the
    gradient copied into the slice."""
    shape = x.shape

    def rule(gs):
        return [made(g, shape, "slice_backward", gs[0], dtype=gs[0].dtype)]

    node = g.begin("slice", [x], rule)
    out = g.view(x, x.shape[:-1] + (width,))
    g.end(node, [out])
    return out


def pad_last(g: Graph, x: Tensor, width: int) -> Tensor:
    """F.pad(x, [0, width - d]), aten.constant_pad_nd (ConstantPadNdBackward0): saves nothing; backward pads
    the gradient back by the negative amount, a new x-shaped tensor."""
    shape = x.shape

    def rule(gs):
        return [made(g, shape, "constant_pad_nd", size(shape, gs[0].dtype), dtype=gs[0].dtype)]

    node = g.begin("constant_pad_nd", [x], rule)
    out = made(g, x.shape[:-1] + (width,), "constant_pad_nd", x, dtype=x.dtype)
    g.end(node, [out])
    return out
