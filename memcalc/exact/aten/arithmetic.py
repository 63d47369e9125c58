"""The aten ops of arithmetic (memcalc.exact.aten): casts, sums, products, quotients and powers,
broadcasting where their operands differ in shape, and the reductions (mean, sum) that RMSNorm and the router
run. What each saves is what its derivative formula reads: the other operand of a product, the base of a
power, the result of rsqrt.
"""

from __future__ import annotations

from ..sim.graph import Graph
from ..sim.tensors import Tensor, nbytes
from .operands import autocast, broadcast, made, promote, size


def to(g: Graph, x: Tensor, dtype: str) -> Tensor:
    """x.to(dtype): x itself when it has that dtype, else _to_copy (saves nothing)."""
    if x.dtype == dtype:
        return x
    src = x.dtype

    def rule(gs):
        return [made(g, gs[0].shape, "_to_copy", gs[0], dtype=src)]

    node = g.begin("_to_copy", [x], rule)
    out = made(g, x.shape, "_to_copy", x, dtype=dtype)
    g.end(node, [out])
    return out


def add(g: Graph, a: Tensor, b: Tensor, op: str = "add") -> Tensor:
    """a + b, broadcasting: saves nothing; the gradient passes through (summed where broadcast) to the
    inputs that need it (an additive mask needs none). op "sub": a - b (SubBackward0), b's gradient -grad."""
    sa, sb, ga, gb = a.shape, b.shape, a.requires_grad, b.requires_grad

    def rule(gs):
        db = None if not gb else gs[0] if op == "add" else made(g, gs[0].shape, "neg", gs[0], dtype=gs[0].dtype)
        return [(gs[0], sa) if ga else None, (db, sb) if gb else None]  # b's -grad made only where b needs it

    node = g.begin(op, [a, b], rule)
    out = made(g, broadcast(a.shape, b.shape), op, a, b, dtype=promote((a.dtype, sa), (b.dtype, sb)))
    g.end(node, [out])
    return out


def sub(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    return add(g, a, b, "sub")


def add_scalar(g: Graph, a: Tensor, op: str = "add") -> Tensor:
    """a + c (or a - c, op "sub") for a Python number: saves nothing; the gradient passes through."""
    node = g.begin(op, [a], lambda gs: [gs[0]])
    out = made(g, a.shape, op, a, dtype=a.dtype)
    g.end(node, [out])
    return out


def sub_scalar(g: Graph, a: Tensor) -> Tensor:
    return add_scalar(g, a, "sub")


def vector_norm_rows(g: Graph, w: Tensor) -> Tensor:
    """torch.linalg.norm(w, dim=1) of a 2-D w no gradient reaches (linalg_vector_norm): one value per row, in
    w's dtype; the reduction needs no workspace of its own."""
    assert w.grad_fn is None, "vector_norm_rows: replayed only where no gradient flows"
    return made(g, (w.shape[0],), "linalg_vector_norm", w, dtype=w.dtype)


def mul(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a * b (MulBackward0): saves b when a needs grad and a when b does; each gradient is made at
    the broadcast shape, in the dtype of grad · the other operand (mul_tensor_backward), and summed
    to its input's shape (and cast to its dtype)."""
    so = broadcast(a.shape, b.shape)
    sa, sb, ga, gb = a.shape, b.shape, a.requires_grad, b.requires_grad
    a_bytes, b_bytes, ta, tb = nbytes(a), nbytes(b), (a.dtype, sa), (b.dtype, sb)

    def rule(gs):
        da = db = None
        if ga:  # grad · b
            da = made(g, so, "mul", gs[0], b_bytes, dtype=promote((gs[0].dtype, so), tb))
            da = (da, sa)
        if gb:  # grad · a
            db = made(g, so, "mul", gs[0], a_bytes, dtype=promote((gs[0].dtype, so), ta))
            db = (db, sb)
        return [da, db]

    node = g.begin("mul", [a, b], rule, ([(b, "other")] if ga else []) + ([(a, "self")] if gb else []))
    out = made(g, so, "mul", a, b, dtype=promote(ta, tb))
    g.end(node, [out])
    return out


def mul_scalar(g: Graph, a: Tensor) -> Tensor:
    """a * c for a Python number: saves nothing; backward makes grad · c."""
    return pointwise(g, a, "mul", "mul")


def mul_scalar_(g: Graph, a: Tensor) -> Tensor:
    """a *= c in place for a Python number (MulBackward0 on a's rebased history): no bytes in forward;
    backward makes grad · c."""
    shape = a.shape

    def rule(gs):
        return [made(g, shape, "mul", gs[0], dtype=gs[0].dtype)]

    node = g.begin("mul", [a], rule)
    g.kernel("mul_", (a,), (a,))
    g.end(node, [a])
    return a


def div_scalar(g: Graph, a: Tensor) -> Tensor:
    """a / c for a Python number (DivBackward0 of a wrapped number: nothing on the device saved);
    backward makes grad / c."""
    return pointwise(g, a, "div", "div")


def pointwise(g: Graph, a: Tensor, op: str, backward_op: str) -> Tensor:
    """An elementwise op that saves nothing: its backward reads the gradient and writes one."""

    def rule(gs):
        return [made(g, gs[0].shape, backward_op, gs[0], dtype=gs[0].dtype)]

    node = g.begin(op, [a], rule)
    out = made(g, a.shape, op, a, dtype=a.dtype)
    g.end(node, [out])
    return out


def neg(g: Graph, a: Tensor) -> Tensor:
    return pointwise(g, a, "neg", "neg")


def div(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a / b, b broadcast (DivBackward0): saves both. Backward makes b's gradient first, -grad·((a/b)/b) (four
    allocations, three freed), then a's, grad / b; b's is summed to its shape (derivatives.yaml
    div_tensor_other_backward, div_tensor_self_backward)."""
    so, sa, sb = broadcast(a.shape, b.shape), a.shape, b.shape
    a_bytes, b_bytes = nbytes(a), nbytes(b)

    def rule(gs):
        dt = gs[0].dtype
        ab = made(g, so, "div", a_bytes, b_bytes, dtype=dt)  # a / b
        abb = made(g, so, "div", ab, b_bytes, dtype=dt)  # (a / b) / b
        neg = made(g, so, "neg", gs[0], dtype=dt)  # -grad
        db = made(g, so, "mul", neg, abb, dtype=dt)
        del ab, abb, neg
        da = made(g, so, "div", gs[0], b_bytes, dtype=dt)  # grad / b
        return [(da, sa), (db, sb)]

    node = g.begin("div", [a, b], rule, [(a, "self"), (b, "other")])
    out = made(g, so, "div", a, b, dtype=a.dtype)
    g.end(node, [out])
    return out


def div_tensor(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a / b where b needs no gradient (DivBackward0): saves b; backward: grad / b."""
    shape, b_bytes = a.shape, nbytes(b)

    def rule(gs):
        out = made(g, shape, "div", gs[0], b_bytes, dtype=gs[0].dtype)
        return [out, None]

    node = g.begin("div", [a, b], rule, [(b, "other")])
    out = made(g, broadcast(a.shape, b.shape), "div", a, b, dtype=a.dtype)
    g.end(node, [out])
    return out


def pow2(g: Graph, x: Tensor) -> Tensor:
    """x.pow(2): pow_scalar with e = 2 (its backward's x.pow(1), 2 · that, grad · that)."""
    return pow_scalar(g, x, 2)


def pow_scalar(g: Graph, x: Tensor, exponent: int) -> Tensor:
    """torch.pow(x, e) (PowBackward0): saves x. Backward (pow_backward): grad · (e · x.pow(e - 1)),
    three allocations. CUDA's autocast runs it in fp32 (pow.Tensor_Scalar)."""
    (x,) = autocast(g, "pow.Tensor_Scalar", x)
    shape, dtype = x.shape, x.dtype

    def rule(gs):
        return [power_backward(g, shape, dtype, gs[0])]

    node = g.begin("pow", [x], rule, [(x, "self")])
    out = made(g, x.shape, "pow", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def power_backward(g: Graph, shape: tuple, dtype: str, grad: Tensor) -> Tensor:
    """grad · (c · y.pow(k)), as rsqrt's and pow's backwards run it: a pow, a scaling mul and the product,
    three allocations, the first two freed."""
    p = made(g, shape, "pow", size(shape, dtype), dtype=dtype)
    scaled = made(g, shape, "mul", p, dtype=dtype)
    out = made(g, shape, "mul", grad, scaled, dtype=dtype)
    del p, scaled
    return out


def rsqrt(g: Graph, x: Tensor) -> Tensor:
    """rsqrt (RsqrtBackward0): saves its result. Backward: -0.5 · grad · result.pow(3), three allocations."""
    (x,) = autocast(g, "rsqrt", x)
    shape, dtype = x.shape, x.dtype

    def rule(gs):
        return [power_backward(g, shape, dtype, gs[0])]

    node = g.begin("rsqrt", [x], rule)
    out = made(g, x.shape, "rsqrt", x, dtype=x.dtype)
    g.end(node, [out], [(out, "result")])
    return out


def mean_last(g: Graph, x: Tensor) -> Tensor:
    """x.mean(-1, keepdim=True): saves nothing; backward: grad.expand(x) / n, a full-size div."""
    shape = x.shape

    def rule(gs):
        return [made(g, shape, "div", gs[0], dtype=gs[0].dtype)]

    node = g.begin("mean", [x], rule)
    out = made(g, x.shape[:-1] + (1,), "mean", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def sum_all(g: Graph, x: Tensor) -> Tensor:
    """x.sum() (SumBackward0): saves x's sizes alone; backward expands the gradient to them (a view)."""
    shape = x.shape
    node = g.begin("sum", [x], lambda gs: [g.view(gs[0], shape)])
    out = made(g, (), "sum", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def sum_last(g: Graph, x: Tensor) -> Tensor:
    """x.sum(-1) (SumBackward1): saves nothing; backward unsqueezes and expands the gradient (views)."""
    shape = x.shape
    node = g.begin("sum", [x], lambda gs: [g.view(gs[0], shape)])
    out = made(g, x.shape[:-1], "sum", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def sum_keepdim(g: Graph, x: Tensor) -> Tensor:
    """x.sum(-1, keepdim=True) (SumBackward1): saves nothing; backward expands the gradient (a view)."""
    shape = x.shape
    node = g.begin("sum", [x], lambda gs: [g.view(gs[0], shape)])
    out = made(g, x.shape[:-1] + (1,), "sum", x, dtype=x.dtype)
    g.end(node, [out])
    return out
