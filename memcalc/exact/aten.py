"""The aten ops verify/builder.py runs, in bytes: what each allocates, what its autograd node saves,
and what its backward allocates, in order (derivatives.yaml's formulas, checked against the meta trace).

Each op is written as autograd runs it: g.begin() makes the node and packs the saved inputs, the
kernel allocates the outputs, g.end() attaches them and packs the saved outputs. Every begin/end
names the tensors its node saves: these are the terms memcalc.exact counts.
A backward rule returns one gradient per input; a (gradient, shape) pair is summed to the input's
shape after the rule returns, as autograd's validate_outputs does for broadcast inputs (and a gradient
of another dtype than its input is cast to it).

Under torch.autocast (memcalc.exact.autocast) the ops autocast wraps cast their inputs first, as its
wrapper does before the op records its node: autocast(g, op, ...) names the op whose list decides.
Ops whose inputs' dtypes differ compute in the wider one (promote).

Each kernel, forward and backward, is also written down with g.kernel(op, reads, writes): what it
reads and writes in HBM (each operand once) and, for matmuls, its FLOPs (2·m·k·n). Backward rules
keep byte counts of the tensors they read, never the tensors: a reference would change lifetimes.
"""

from __future__ import annotations

import math

from .config import ITEMSIZE
from .sim import Graph, Tensor, nbytes


def size(shape, dtype: str) -> int:
    """Bytes of a contiguous tensor of that shape and dtype."""
    return math.prod(shape) * ITEMSIZE[dtype]


def autocast(g: Graph, op: str, *tensors):
    """op's inputs as torch.autocast's wrapper of op passes them on: unchanged outside an autocast
    region, or when op is on none of its lists (memcalc.exact.autocast.Autocast.inputs)."""
    return tensors if g.autocast is None else g.autocast.inputs(g, op, tensors)


def promote(a: tuple[str, tuple], b: tuple[str, tuple]) -> str:
    """torch.result_type of two floating (dtype, shape) operands (c10/core/ScalarType.h promoteTypes):
    the wider (bf16 with fp16 is fp32); a 0-dim tensor gives way to a dimensioned one."""
    (da, sa), (db, sb) = a, b
    if da == db:
        return da
    if not sa and sb:
        return db
    if not sb and sa:
        return da
    return "fp32"

# -- views ----------------------------------------------------------------------------------------


def broadcast(a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(y if y > x or (y == x and type(x) is int) else x for x, y in zip(a, b))  # a named size kept


def view(g: Graph, t: Tensor, shape, grad_copies: bool = False) -> Tensor:
    """A view (view, reshape without copy, transpose, unsqueeze): backward reshapes the gradient back,
    a copy when it arrives non-contiguous (grad_copies)."""
    in_shape = t.shape

    def rule(gs):
        if not grad_copies:
            return [g.view(gs[0], in_shape)]
        out = g.empty(in_shape, gs[0].dtype, "clone")
        g.kernel("clone", (gs[0],), (out,))
        return [out]

    node = g.begin("view", [t], rule)
    out = g.view(t, shape)
    g.end(node, [out])
    return out


def reshape_copy(g: Graph, t: Tensor, shape) -> Tensor:
    """reshape of a tensor that cannot be viewed: clone, then _unsafe_view (backward: views)."""
    in_shape = t.shape
    node = g.begin("clone", [t], lambda gs: [g.view(gs[0], in_shape)])
    out = g.empty(shape, t.dtype, "clone")
    g.kernel("clone", (t,), (out,))
    g.end(node, [out])
    return out


def expand(g: Graph, t: Tensor, shape) -> Tensor:
    """expand: a view; its backward formula sums over the expanded dims (at::sum_to, a new tensor)."""
    in_shape = t.shape

    def rule(gs):
        if gs[0].shape == in_shape:
            return [gs[0]]
        out = g.empty(in_shape, gs[0].dtype, "sum")
        g.kernel("sum", (gs[0],), (out,))
        return [out]

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


# -- elementwise ----------------------------------------------------------------------------------


def to(g: Graph, x: Tensor, dtype: str) -> Tensor:
    """x.to(dtype): x itself when it has that dtype, else _to_copy (saves nothing)."""
    if x.dtype == dtype:
        return x
    src = x.dtype

    def rule(gs):
        out = g.empty(gs[0].shape, src, "_to_copy")
        g.kernel("_to_copy", (gs[0],), (out,))
        return [out]

    node = g.begin("_to_copy", [x], rule)
    out = g.empty(x.shape, dtype, "_to_copy")
    g.kernel("_to_copy", (x,), (out,))
    g.end(node, [out])
    return out


def add(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a + b, broadcasting: saves nothing; the gradient passes through (summed where broadcast) to the
    inputs that need it (an additive mask needs none)."""
    sa, sb, ga, gb = a.shape, b.shape, a.requires_grad, b.requires_grad
    node = g.begin("add", [a, b], lambda gs: [(gs[0], sa) if ga else None, (gs[0], sb) if gb else None])
    out = g.empty(broadcast(a.shape, b.shape), promote((a.dtype, sa), (b.dtype, sb)), "add")
    g.kernel("add", (a, b), (out,))
    g.end(node, [out])
    return out


def add_scalar(g: Graph, a: Tensor) -> Tensor:
    """a + eps: saves nothing; the gradient passes through."""
    node = g.begin("add", [a], lambda gs: [gs[0]])
    out = g.empty(a.shape, a.dtype, "add")
    g.kernel("add", (a,), (out,))
    g.end(node, [out])
    return out


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
            da = g.empty(so, promote((gs[0].dtype, so), tb), "mul")
            g.kernel("mul", (gs[0], b_bytes), (da,))
            da = (da, sa)
        if gb:  # grad · a
            db = g.empty(so, promote((gs[0].dtype, so), ta), "mul")
            g.kernel("mul", (gs[0], a_bytes), (db,))
            db = (db, sb)
        return [da, db]

    node = g.begin("mul", [a, b], rule, ([(b, "other")] if ga else []) + ([(a, "self")] if gb else []))
    out = g.empty(so, promote(ta, tb), "mul")
    g.kernel("mul", (a, b), (out,))
    g.end(node, [out])
    return out


def mul_scalar(g: Graph, a: Tensor) -> Tensor:
    """a * c for a Python number: saves nothing; backward makes grad · c."""
    return pointwise(g, a, "mul", "mul")


def pointwise(g: Graph, a: Tensor, op: str, backward_op: str) -> Tensor:
    """An elementwise op that saves nothing: its backward reads the gradient and writes one."""

    def rule(gs):
        out = g.empty(gs[0].shape, gs[0].dtype, backward_op)
        g.kernel(backward_op, (gs[0],), (out,))
        return [out]

    node = g.begin(op, [a], rule)
    out = g.empty(a.shape, a.dtype, op)
    g.kernel(op, (a,), (out,))
    g.end(node, [out])
    return out


def neg(g: Graph, a: Tensor) -> Tensor:
    return pointwise(g, a, "neg", "neg")


def pow2(g: Graph, x: Tensor) -> Tensor:
    """x.pow(2): pow_scalar with e = 2 (its backward's x.pow(1), 2 · that, grad · that)."""
    return pow_scalar(g, x, 2)


def mean_last(g: Graph, x: Tensor) -> Tensor:
    """x.mean(-1, keepdim=True): saves nothing; backward: grad.expand(x) / n, a full-size div."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "div")
        g.kernel("div", (gs[0],), (out,))
        return [out]

    node = g.begin("mean", [x], rule)
    out = g.empty(x.shape[:-1] + (1,), x.dtype, "mean")
    g.kernel("mean", (x,), (out,))
    g.end(node, [out])
    return out


def power_backward(g: Graph, shape: tuple, dtype: str, grad: Tensor) -> Tensor:
    """grad · (c · y.pow(k)), as rsqrt's and pow's backwards run it: a pow, a scaling mul and the product,
    three allocations, the first two freed."""
    p = g.empty(shape, dtype, "pow")
    g.kernel("pow", (size(shape, dtype),), (p,))
    scaled = g.empty(shape, dtype, "mul")
    g.kernel("mul", (p,), (scaled,))
    out = g.empty(shape, dtype, "mul")
    g.kernel("mul", (grad, scaled), (out,))
    del p, scaled
    return out


def rsqrt(g: Graph, x: Tensor) -> Tensor:
    """rsqrt (RsqrtBackward0): saves its result. Backward: -0.5 · grad · result.pow(3), three allocations."""
    (x,) = autocast(g, "rsqrt", x)
    shape, dtype = x.shape, x.dtype

    def rule(gs):
        return [power_backward(g, shape, dtype, gs[0])]

    node = g.begin("rsqrt", [x], rule)
    out = g.empty(x.shape, x.dtype, "rsqrt")
    g.kernel("rsqrt", (x,), (out,))
    g.end(node, [out], [(out, "result")])
    return out


def unary(g: Graph, x: Tensor, op: str, backward_op: str, saves: str, out_dtype: str = "") -> Tensor:
    """An elementwise op whose node saves its input ('self') or its output ('result'); its backward
    reads the gradient and what was saved (same size), and writes the input's gradient (in the
    input's dtype, where the output's differs: softmax's half_to_float)."""
    saved_bytes, in_dtype = nbytes(x), x.dtype

    def rule(gs):
        out = g.empty(gs[0].shape, in_dtype if out_dtype else gs[0].dtype, backward_op)
        g.kernel(backward_op, (gs[0], saved_bytes), (out,))
        return [out]

    node = g.begin(op, [x], rule, [(x, "self")] if saves == "self" else [])
    out = g.empty(x.shape, out_dtype or x.dtype, op)
    g.kernel(op, (x,), (out,))
    g.end(node, [out], [(out, "result")] if saves == "result" else [])
    return out


def gelu(g: Graph, x: Tensor) -> Tensor:
    """F.gelu(approximate='tanh') (GeluBackward0): saves its input."""
    return unary(g, x, "gelu", "gelu_backward", "self")


def silu(g: Graph, x: Tensor) -> Tensor:
    """F.silu (SiluBackward0): saves its input."""
    return unary(g, x, "silu", "silu_backward", "self")


def softmax(g: Graph, x: Tensor) -> Tensor:
    """F.softmax(x, -1), aten._softmax (SoftmaxBackward0): saves its output. In fp32 where autocast
    passes dtype=float (fp32_set_opt_dtype): aten/src/ATen/native/SoftMax.cpp softmax() runs a CUDA
    fp16 input through the half_to_float kernel (fp32 out, the gradient back in fp16), and copies any
    other input to fp32 first."""
    return in_fp32(g, x, "softmax.int", "_softmax", "_softmax_backward_data")


def log_softmax(g: Graph, x: Tensor) -> Tensor:
    """aten._log_softmax(x, 1) (LogSoftmaxBackward0): saves its output. F.cross_entropy calls it with
    the input's own dtype (aten/src/ATen/native/LossNLL.cpp cross_entropy_loss), which CUDA's
    fp32_set_opt_dtype respects: autocast leaves it as it is."""
    return unary(g, x, "_log_softmax", "_log_softmax_backward_data", "result")


def in_fp32(g: Graph, x: Tensor, wrapped: str, op: str, backward_op: str) -> Tensor:
    """softmax(x, dim, dtype): dtype is float when autocast's list sets it."""
    dtype = None if g.autocast is None else g.autocast.opt_dtype(wrapped, x)
    if dtype is None or x.dtype == dtype:
        return unary(g, x, op, backward_op, "result")
    if x.dtype == "fp16" and g.autocast.device == "cuda":  # at::_softmax(input, dim, half_to_float=true)
        return unary(g, x, op, backward_op, "result", out_dtype=dtype)
    return unary(g, to(g, x, dtype), op, backward_op, "result")


def native_dropout(g: Graph, x: Tensor) -> Tensor:
    """aten.native_dropout, what F.dropout runs on CUDA (NativeDropoutBackward0): output and a
    bool mask; saves the mask. Backward reads the gradient and the mask."""
    mask_bytes = size(x.shape, "bool")

    def rule(gs):
        out = g.empty(gs[0].shape, gs[0].dtype, "native_dropout_backward")
        g.kernel("native_dropout_backward", (gs[0], mask_bytes), (out,))
        return [out]

    node = g.begin("native_dropout", [x], rule)
    out = g.empty(x.shape, x.dtype, "native_dropout")
    mask = g.empty(x.shape, "bool", "native_dropout")
    g.kernel("native_dropout", (x,), (out, mask))
    g.end(node, [out, mask], [(mask, "mask")])
    return out


def masked_fill(g: Graph, x: Tensor, mask: Tensor) -> Tensor:
    """x.masked_fill(mask, -inf) (MaskedFillBackward0): saves the mask (a view of the causal buffer).
    The (T, T) mask broadcasts over batch and heads: read once (see memcalc.exact.sim.nbytes)."""
    mask_bytes = nbytes(mask)

    def rule(gs):
        out = g.empty(gs[0].shape, gs[0].dtype, "masked_fill")
        g.kernel("masked_fill", (gs[0], mask_bytes), (out,))
        return [out]

    node = g.begin("masked_fill", [x], rule, [(mask, "mask")])
    out = g.empty(x.shape, x.dtype, "masked_fill")
    g.kernel("masked_fill", (x, mask), (out,))
    g.end(node, [out])
    return out


def cat_last(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """torch.cat((a, b), -1) (CatBackward0): saves nothing; backward narrows the gradient (views)."""
    a, b = autocast(g, "cat", a, b)
    sa, sb = a.shape, b.shape
    node = g.begin("cat", [a, b], lambda gs: [g.view(gs[0], sa), g.view(gs[0], sb)])
    out = g.empty(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), promote((a.dtype, sa), (b.dtype, sb)), "cat")
    g.kernel("cat", (a, b), (out,))
    g.end(node, [out])
    return out


def chunk2(g: Graph, x: Tensor) -> tuple[Tensor, Tensor]:
    """x.chunk(2, -1): two views; backward concatenates both gradients (a new tensor)."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "cat")
        g.kernel("cat", tuple(gs), (out,))
        return [out]

    node = g.begin("split", [x], rule)
    half = x.shape[:-1] + (x.shape[-1] // 2,)
    x1, x2 = g.view(x, half), g.view(x, half)
    g.end(node, [x1, x2])
    return x1, x2


# -- matmuls --------------------------------------------------------------------------------------


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

    node = g.begin("mm", [a, b], rule, ([(a, "self")] if gb else []) + ([(b, "mat2")] if ga else []))
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


def bmm(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """Batched a @ b (BmmBackward0): saves both; backward makes b's gradient, then a's."""
    sa, sb, ga, gb = a.shape, b.shape, a.requires_grad, b.requires_grad
    a_bytes, b_bytes, dt = nbytes(a), nbytes(b), a.dtype

    fl = 2 * sa[0] * sa[1] * sa[2] * sb[2]

    def rule(gs):
        db = da = None
        if gb:  # aᵀ · grad
            db = g.empty(sb, gs[0].dtype, "bmm")
            g.kernel("bmm", (a_bytes, gs[0]), (db,), "tensor", fl, "attention", dtype=dt)
        if ga:  # grad · bᵀ
            da = g.empty(sa, gs[0].dtype, "bmm")
            g.kernel("bmm", (gs[0], b_bytes), (da,), "tensor", fl, "attention", dtype=dt)
        return [da, db]

    node = g.begin("bmm", [a, b], rule, ([(a, "self")] if gb else []) + ([(b, "mat2")] if ga else []))
    out = g.empty((a.shape[0], a.shape[1], b.shape[2]), a.dtype, "bmm")
    g.kernel("bmm", (a, b), (out,), "tensor", fl, "attention", dtype=dt)
    g.end(node, [out])
    return out


def linear(g: Graph, x: Tensor, w: Tensor, b: Tensor | None, kind: str = "linear") -> Tensor:
    """F.linear on a contiguous (B, T, in) x: with a bias, reshape to 2-D + addmm + view
    (_flatten_nd_linear); without, matmul's fold: reshape (a view) + mm + _unsafe_view."""
    x, w, b = autocast(g, "linear", x, w, b)
    lead = x.shape[:-1]
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


# -- layers ---------------------------------------------------------------------------------------


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


def layer_norm(g: Graph, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """aten.native_layer_norm (NativeLayerNormBackward0): output, and fp32 mean and rstd (B, T, 1);
    saves input, weight, bias, mean, rstd. Backward: grad input, grad weight, grad bias."""
    x, w, b = autocast(g, "layer_norm", x, w, b)
    sx, sw = x.shape, w.shape
    stat = x.shape[:-1] + (1,)
    read = nbytes(x) + nbytes(w) + 2 * size(stat, "fp32")  # input, weight, mean, rstd

    def rule(gs):
        op = "native_layer_norm_backward"
        dx, dw, db = g.empty(sx, gs[0].dtype, op), g.empty(sw, gs[0].dtype, op), g.empty(sw, gs[0].dtype, op)
        g.kernel(op, (gs[0], read), (dx, dw, db))
        return [dx, dw, db]

    node = g.begin("native_layer_norm", [x, w, b], rule, [(x, "input"), (w, "weight"), (b, "bias")])
    out = g.empty(x.shape, x.dtype, "native_layer_norm")
    mean = g.empty(stat, "fp32", "native_layer_norm")
    rstd = g.empty(stat, "fp32", "native_layer_norm")
    g.kernel("native_layer_norm", (x, w, b), (out, mean, rstd))
    g.end(node, [out, mean, rstd], [(mean, "mean"), (rstd, "rstd")])
    return out


def flash_attention(g: Graph, q: Tensor, k: Tensor, v: Tensor, cpu: bool = False) -> Tensor:
    """aten._scaled_dot_product_flash_attention (ScaledDotProductFlashAttentionBackward0): output
    (laid out as q), logsumexp (B, nh, T) fp32, the Philox seed (2 x uint64) and offset (uint64);
    saves q, k, v, output, logsumexp, seed, offset. Backward: grad q, k, v. On CPU, SDPA's flash
    backend is aten._scaled_dot_product_flash_attention_for_cpu: no dropout, so no seed or offset.
    Autocast wraps SDPA (and CUDA's flash op): q, k, v cast to 16 bits, value first.

    HBM traffic is Q, K, V, O and the logsumexp (forward), and Q, K, V, O, dO, logsumexp in, dQ, dK,
    dV out (backward): the s×s scores stay on chip (Dao et al. 2022, sec. 3.1). The kernel is causal
    (verify/builder.py): it skips the masked blocks, so it executes half the FLOPs FlopCounterMode counts."""
    q, k, v = autocast(g, "scaled_dot_product_attention", q, k, v)
    sq, sk, sv = q.shape, k.shape, v.shape
    B, nh, Tq, d = q.shape
    one = 2 * B * nh * Tq * k.shape[2] * d  # one (B·nh) x Tq x Tk matmul over d (GQA heads broadcast)
    name = "_scaled_dot_product_flash_attention" + ("_for_cpu" if cpu else "")
    op = name + "_backward"
    qkv_bytes, dt = nbytes(q) + nbytes(k) + nbytes(v), q.dtype
    o_bytes, lse_bytes = size(q.shape, q.dtype), size(q.shape[:3], "fp32")

    def rule(gs):
        grads = [g.empty(sq, gs[0].dtype, op), g.empty(sk, gs[0].dtype, op), g.empty(sv, gs[0].dtype, op)]
        # QKᵀ recomputed, dP, dV, dQ, dK: FlopCounterMode counts 5 matmuls; the causal kernel runs half
        g.kernel(op, (qkv_bytes, o_bytes, gs[0], lse_bytes), tuple(grads), "flash", 5 * one // 2, "attention",
                 5 * one, dt)  # fmt: skip
        return grads

    def kernel():
        out = g.empty(q.shape, q.dtype, name)
        lse = g.empty(q.shape[:3], "fp32", name)
        g.kernel(name, (q, k, v), (out, lse), "flash", one, "attention", 2 * one, dt)  # QKᵀ and PV, causal half
        return (out, lse) if cpu else (out, lse, g.empty((2,), "uint64", name), g.empty((), "uint64", name))

    node = g.begin(name, [q, k, v], rule, [(q, "query"), (k, "key"), (v, "value")])
    if cpu:
        out, lse = g.outputs(name, kernel, ("output", "logsumexp"))
        g.end(node, [out, lse], [(out, "output"), (lse, "logsumexp")])
        return out
    out, lse, seed, offset = g.outputs(name, kernel, ("output", "logsumexp", "philox_seed", "philox_offset"))
    g.end(node, [out, lse], [(out, "output"), (lse, "logsumexp"), (seed, "philox_seed"), (offset, "philox_offset")])
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


# -- mixture of experts and latent attention (verify/builder.py MoE, LatentAttention) ---------------------


def sigmoid(g: Graph, x: Tensor) -> Tensor:
    """x.sigmoid() (SigmoidBackward0): saves its result."""
    return unary(g, x, "sigmoid", "sigmoid_backward", "result")


def sum_keepdim(g: Graph, x: Tensor) -> Tensor:
    """x.sum(-1, keepdim=True) (SumBackward1): saves nothing; backward expands the gradient (a view)."""
    shape = x.shape
    node = g.begin("sum", [x], lambda gs: [g.view(gs[0], shape)])
    out = g.empty(x.shape[:-1] + (1,), x.dtype, "sum")
    g.kernel("sum", (x,), (out,))
    g.end(node, [out])
    return out


def div(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a / b, b broadcast (DivBackward0): saves both. Backward makes b's gradient first, -grad·((a/b)/b) (four
    allocations, three freed), then a's, grad / b; b's is summed to its shape (derivatives.yaml
    div_tensor_other_backward, div_tensor_self_backward)."""
    so, sa, sb = broadcast(a.shape, b.shape), a.shape, b.shape
    a_bytes, b_bytes = nbytes(a), nbytes(b)

    def rule(gs):
        dt = gs[0].dtype
        ab = g.empty(so, dt, "div")  # a / b
        g.kernel("div", (a_bytes, b_bytes), (ab,))
        abb = g.empty(so, dt, "div")  # (a / b) / b
        g.kernel("div", (ab, b_bytes), (abb,))
        neg = g.empty(so, dt, "neg")  # -grad
        g.kernel("neg", (gs[0],), (neg,))
        db = g.empty(so, dt, "mul")
        g.kernel("mul", (neg, abb), (db,))
        del ab, abb, neg
        da = g.empty(so, dt, "div")  # grad / b
        g.kernel("div", (gs[0], b_bytes), (da,))
        return [(da, sa), (db, sb)]

    node = g.begin("div", [a, b], rule, [(a, "self"), (b, "other")])
    out = g.empty(so, a.dtype, "div")
    g.kernel("div", (a, b), (out,))
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


def split(g: Graph, x: Tensor, sizes: list[int], dim: int) -> list[Tensor]:
    """x.split(sizes, dim) (SplitWithSizesBackward0, SplitBackward0): views; backward cats every gradient into
    one x-shaped tensor."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "cat")
        g.kernel("cat", tuple(gs), (out,))
        return [out]

    node = g.begin("split", [x], rule)
    parts = [g.view(x, shape[:dim] + (n,) + shape[dim + 1:]) for n in sizes]
    g.end(node, parts)
    return parts


def cat(g: Graph, parts: list[Tensor], dim: int) -> Tensor:
    """torch.cat(parts, dim) (CatBackward0): saves nothing; backward narrows the gradient (views)."""
    shapes = [p.shape for p in parts]
    node = g.begin("cat", parts, lambda gs: [g.view(gs[0], s) for s in shapes])
    shape = parts[0].shape[:dim] + (sum(s[dim] for s in shapes),) + parts[0].shape[dim + 1:]
    out = g.empty(shape, parts[0].dtype, "cat")
    g.kernel("cat", tuple(parts), (out,))
    g.end(node, [out])
    return out


def pad_last(g: Graph, x: Tensor, width: int) -> Tensor:
    """F.pad(x, [0, width - d]), aten.constant_pad_nd (ConstantPadNdBackward0): saves nothing; backward pads
    the gradient back by the negative amount, a new x-shaped tensor."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "constant_pad_nd")
        g.kernel("constant_pad_nd", (size(shape, gs[0].dtype),), (out,))
        return [out]

    node = g.begin("constant_pad_nd", [x], rule)
    out = g.empty(x.shape[:-1] + (width,), x.dtype, "constant_pad_nd")
    g.kernel("constant_pad_nd", (x,), (out,))
    g.end(node, [out])
    return out


def narrow_last(g: Graph, x: Tensor, width: int) -> Tensor:
    """x[..., :width] (SliceBackward0): a view; backward slice_backward, a zero x-shaped tensor the gradient
    is copied into."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "slice_backward")
        g.kernel("slice_backward", (gs[0],), (out,))
        return [out]

    node = g.begin("slice", [x], rule)
    out = g.view(x, x.shape[:-1] + (width,))
    g.end(node, [out])
    return out


# -- ops of Hugging Face Transformers' models (memcalc.exact.hf) -----------------------------------


def slice_last(g: Graph, x: Tensor, start: int, stop: int) -> Tensor:
    """x[..., start:stop] (SliceBackward0): a view; backward is slice_backward, a zero tensor of x's
    shape with the gradient copied into the slice."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "slice_backward")
        g.kernel("slice_backward", (gs[0],), (out,))
        return [out]

    node = g.begin("slice", [x], rule)
    out = g.view(x, x.shape[:-1] + (stop - start,))
    g.end(node, [out])
    return out


def split_last(g: Graph, x: Tensor, size: int) -> list[Tensor]:
    """x.split(size, dim=-1) (SplitBackward0): views; backward concatenates the gradients (a new tensor)."""
    shape = x.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "cat")
        g.kernel("cat", tuple(gs), (out,))
        return [out]

    node = g.begin("split", [x], rule)
    parts = [g.view(x, x.shape[:-1] + (size,)) for _ in range(x.shape[-1] // size)]
    g.end(node, parts)
    return parts


def pow_scalar(g: Graph, x: Tensor, exponent: int) -> Tensor:
    """torch.pow(x, e) (PowBackward0): saves x. Backward (pow_backward): grad · (e · x.pow(e - 1)),
    three allocations. CUDA's autocast runs it in fp32 (pow.Tensor_Scalar)."""
    (x,) = autocast(g, "pow.Tensor_Scalar", x)
    shape, dtype = x.shape, x.dtype

    def rule(gs):
        return [power_backward(g, shape, dtype, gs[0])]

    node = g.begin("pow", [x], rule, [(x, "self")])
    out = g.empty(x.shape, x.dtype, "pow")
    g.kernel("pow", (x,), (out,))
    g.end(node, [out])
    return out


def tanh(g: Graph, x: Tensor) -> Tensor:
    """torch.tanh (TanhBackward0): saves its output."""
    return unary(g, x, "tanh", "tanh_backward", "result")


def div_tensor(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a / b where b needs no gradient (DivBackward0): saves b; backward: grad / b."""
    shape, b_bytes = a.shape, nbytes(b)

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "div")
        g.kernel("div", (gs[0], b_bytes), (out,))
        return [out, None]

    node = g.begin("div", [a, b], rule, [(b, "other")])
    out = g.empty(broadcast(a.shape, b.shape), a.dtype, "div")
    g.kernel("div", (a, b), (out,))
    g.end(node, [out])
    return out


def mul_scalar_(g: Graph, a: Tensor) -> Tensor:
    """a *= c in place for a Python number (MulBackward0 on a's rebased history): no bytes in forward;
    backward makes grad · c."""
    shape = a.shape

    def rule(gs):
        out = g.empty(shape, gs[0].dtype, "mul")
        g.kernel("mul", (gs[0],), (out,))
        return [out]

    node = g.begin("mul", [a], rule)
    g.kernel("mul_", (a,), (a,))
    g.end(node, [a])
    return a
