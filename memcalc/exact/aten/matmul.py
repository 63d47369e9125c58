"""The aten matmuls (memcalc.exact.aten): mm, addmm and bmm, each kernel with its FLOPs (2·m·k·n), and the
two ways PyTorch reaches them: F.linear (addmm with a bias, else mm on a fold) and torch.matmul on 4-D
operands (expand, reshape to 3-D, bmm, view back).
"""

from __future__ import annotations

import math

from ..sim.graph import Graph
from ..sim.tensors import Tensor, nbytes
from .operands import autocast
from .views import expand, reshape_copy, t, view


def mm(g: Graph, a: Tensor, b: Tensor, kind: str = "linear") -> Tensor:
    """a @ b, 2-D (MmBackward0): saves a when b needs grad and b when a does; backward makes b's
    gradient first, then a's."""
    sa, sb, ga, gb = a.shape, b.shape, a.requires_grad, b.requires_grad
    a_bytes, b_bytes, dt = nbytes(a), nbytes(b), a.dtype

    fl = 2 * sa[0] * sa[1] * sb[1]

    def rule(gs):
        db = da = None
        if gb:  # aᵀ · grad
            db = g.empty(sb, gs[0].dtype, "mm")
            g.kernel("mm", (a_bytes, gs[0]), (db,), "tensor", fl, kind, dtype=dt)
        if ga:  # grad · bᵀ
            da = g.empty(sa, gs[0].dtype, "mm")
            g.kernel("mm", (gs[0], b_bytes), (da,), "tensor", fl, kind, dtype=dt)
        return [da, db]

    def kernel():
        out = g.empty((a.shape[0], b.shape[1]), a.dtype, "mm")
        g.kernel("mm", (a, b), (out,), "tensor", fl, kind, dtype=dt)
        return (out,)

    # MmBackward0 packs mat2 before self (saved_tensors_hooks sees them in that order: tests/test_offload.py)
    node = g.begin("mm", [a, b], rule, ([(b, "mat2")] if ga else []) + ([(a, "self")] if gb else []))
    (out,) = g.outputs("mm", kernel)  # a selective checkpoint may keep it, or hand it back
    g.end(node, [out])
    return out


def addmm(g: Graph, bias: Tensor, a: Tensor, b: Tensor, kind: str = "linear") -> Tensor:
    """bias + a @ b (AddmmBackward0): saves a and b; backward: a's gradient, b's, then the bias's
    (the incoming gradient, summed over rows by validate_outputs). Autocast casts the three (GPT-2's
    Conv1D calls it directly; linear's are cast already)."""
    bias, a, b = autocast(g, "addmm", bias, a, b)
    sa, sb, sc = a.shape, b.shape, bias.shape
    ga, gb, gc = a.requires_grad, b.requires_grad, bias.requires_grad
    a_bytes, b_bytes, dt = nbytes(a), nbytes(b), a.dtype

    fl = 2 * sa[0] * sa[1] * sb[1]

    def rule(gs):
        da = db = None
        if ga:  # grad · bᵀ
            da = g.empty(sa, gs[0].dtype, "mm")
            g.kernel("mm", (gs[0], b_bytes), (da,), "tensor", fl, kind, dtype=dt)
        if gb:  # aᵀ · grad
            db = g.empty(sb, gs[0].dtype, "mm")
            g.kernel("mm", (a_bytes, gs[0]), (db,), "tensor", fl, kind, dtype=dt)
        return [(gs[0], sc) if gc else None, da, db]

    node = g.begin("addmm", [bias, a, b], rule, ([(a, "mat1")] if gb else []) + ([(b, "mat2")] if ga else []))
    out = g.empty((a.shape[0], b.shape[1]), a.dtype, "addmm")
    g.kernel("addmm", (bias, a, b), (out,), "tensor", fl, kind, dtype=dt)
    g.end(node, [out])
    return out


def bmm(g: Graph, a: Tensor, b: Tensor, kind: str = "attention") -> Tensor:
    """Batched a @ b (BmmBackward0): saves both; backward makes b's gradient, then a's."""
    sa, sb, ga, gb = a.shape, b.shape, a.requires_grad, b.requires_grad
    a_bytes, b_bytes, dt = nbytes(a), nbytes(b), a.dtype

    fl = 2 * sa[0] * sa[1] * sa[2] * sb[2]

    def rule(gs):
        db = da = None
        if gb:  # aᵀ · grad
            db = g.empty(sb, gs[0].dtype, "bmm")
            g.kernel("bmm", (a_bytes, gs[0]), (db,), "tensor", fl, kind, dtype=dt)
        if ga:  # grad · bᵀ
            da = g.empty(sa, gs[0].dtype, "bmm")
            g.kernel("bmm", (gs[0], b_bytes), (da,), "tensor", fl, kind, dtype=dt)
        return [da, db]

    # BmmBackward0 packs mat2 before self, as MmBackward0 does
    node = g.begin("bmm", [a, b], rule, ([(b, "mat2")] if ga else []) + ([(a, "self")] if gb else []))
    out = g.empty((a.shape[0], a.shape[1], b.shape[2]), a.dtype, "bmm")
    g.kernel("bmm", (a, b), (out,), "tensor", fl, kind, dtype=dt)
    g.end(node, [out])
    return out


def linear(g: Graph, x: Tensor, w: Tensor, b: Tensor | None, kind: str = "linear", strided: bool = False) -> Tensor:
    """F.linear on a contiguous (B, T, in) x: with a bias, reshape to 2-D + addmm + view
    (_flatten_nd_linear); without, matmul's fold: reshape (a view) + mm + _unsafe_view. strided: x is a view with
    gaps between its rows (logits_to_keep's last positions of each sequence), which matmul does not fold
    (LinearAlgebra.cpp should_fold: not without a copy) unless autocast cast it (a cast of such a view is laid out
    anew, contiguous): x and w.t() expanded to a batch (views), bmm, _unsafe_view; no bias then."""
    dtype = x.dtype
    x, w, b = autocast(g, "linear", x, w, b)
    lead = x.shape[:-1]
    if b is None and strided and x.dtype == dtype:
        wt = t(g, w)
        batched = expand(g, wt, (lead[0],) + wt.shape)  # tensor2.expand(batch, in, out): the batch's stride 0
        y3 = bmm(g, expand(g, x, x.shape), batched, kind)
        return view(g, y3, lead + (w.shape[0],))
    if b is None:  # matmul(x, w.t()): w.t() is made first, then x folds inside matmul
        wt = t(g, w)
        x2 = view(g, x, (math.prod(lead), x.shape[-1]))
        y2 = mm(g, x2, wt, kind)
    else:  # _flatten_nd_linear: x reshaped first, then addmm(b, x2, w.t())
        x2 = view(g, x, (math.prod(lead), x.shape[-1]))
        wt = t(g, w)
        y2 = addmm(g, b, x2, wt, kind)
    return view(g, y2, lead + (w.shape[0],))


def matmul4(g: Graph, a: Tensor, b: Tensor, a_copies: bool, b_copies: bool, grad_copies: bool) -> Tensor:
    """a @ b on 4-D (B, H, m, k) @ (B, H, k, n): torch.matmul expands both, reshapes each to 3-D
    (a copy where (B, H) cannot merge), bmm, and views the result back to 4-D. (A cast keeps its
    input's strides, so autocast's copies do not change where the reshapes copy.)"""
    a, b = autocast(g, "matmul", a, b)
    B, H = a.shape[0], a.shape[1]
    a3 = (reshape_copy if a_copies else view)(g, expand(g, a, a.shape), (B * H,) + a.shape[2:])
    b3 = (reshape_copy if b_copies else view)(g, expand(g, b, b.shape), (B * H,) + b.shape[2:])
    y3 = bmm(g, a3, b3)
    del a3, b3
    return view(g, y3, (B, H, a.shape[2], b.shape[3]), grad_copies)
