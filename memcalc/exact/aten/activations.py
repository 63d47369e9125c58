"""The aten ops that save their input or their output for an elementwise backward (memcalc.exact.aten):
the activations (GELU, SiLU, tanh, sigmoid), softmax and log-softmax (in fp32 where autocast says so), and
the two that save a mask: dropout's and masked_fill's.
"""

from __future__ import annotations

from ..sim.graph import Graph
from ..sim.tensors import Tensor, nbytes
from .arithmetic import to
from .operands import made, size


def unary(g: Graph, x: Tensor, op: str, backward_op: str, saves: str, out_dtype: str = "") -> Tensor:
    """An elementwise op whose node saves its input ('self') or its output ('result'); its backward
    reads the gradient and what was saved (same size), and writes the input's gradient (in the
    input's dtype, where the output's differs: softmax's half_to_float)."""
    saved_bytes, in_dtype = nbytes(x), x.dtype

    def rule(gs):
        return [made(g, gs[0].shape, backward_op, gs[0], saved_bytes, dtype=in_dtype if out_dtype else gs[0].dtype)]

    node = g.begin(op, [x], rule, [(x, "self")] if saves == "self" else [])
    out = made(g, x.shape, op, x, dtype=out_dtype or x.dtype)
    g.end(node, [out], [(out, "result")] if saves == "result" else [])
    return out


def gelu(g: Graph, x: Tensor) -> Tensor:
    """F.gelu(approximate='tanh') (GeluBackward0): saves its input."""
    return unary(g, x, "gelu", "gelu_backward", "self")


def silu(g: Graph, x: Tensor) -> Tensor:
    """F.silu (SiluBackward0): saves its input."""
    return unary(g, x, "silu", "silu_backward", "self")


def tanh(g: Graph, x: Tensor) -> Tensor:
    """torch.tanh (TanhBackward0): saves its output."""
    return unary(g, x, "tanh", "tanh_backward", "result")


def exp(g: Graph, x: Tensor) -> Tensor:
    """torch.exp (ExpBackward0): saves its output; backward is grad * result."""
    return unary(g, x, "exp", "mul", "result")


def sigmoid(g: Graph, x: Tensor) -> Tensor:
    """x.sigmoid() (SigmoidBackward0): saves its result."""
    return unary(g, x, "sigmoid", "sigmoid_backward", "result")


def softmax(g: Graph, x: Tensor) -> Tensor:
    """F.softmax(x, -1), aten._softmax (SoftmaxBackward0): saves its output. In fp32 where autocast
    passes dtype=float (fp32_set_opt_dtype): aten/src/ATen/native/SoftMax.cpp softmax() runs a CUDA
    fp16 input through the half_to_float kernel (fp32 out, the gradient back in fp16), and copies any
    other input to fp32 first."""
    return in_fp32(g, x, "softmax.int", "_softmax", "_softmax_backward_data")


def safe_softmax(g: Graph, x: Tensor) -> Tensor:
    """aten._safe_softmax(x, -1) (SafeSoftmaxBackward0: _softmax_backward_data of its result), which SDPA's
    math path runs: saves its output."""
    return unary(g, x, "_safe_softmax", "_softmax_backward_data", "result")


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
        return [made(g, gs[0].shape, "native_dropout_backward", gs[0], mask_bytes, dtype=gs[0].dtype)]

    node = g.begin("native_dropout", [x], rule)
    out = g.empty(x.shape, x.dtype, "native_dropout")
    mask = g.empty(x.shape, "bool", "native_dropout")
    g.kernel("native_dropout", (x,), (out, mask))
    g.end(node, [out, mask], [(mask, "mask")])
    return out


def masked_fill(g: Graph, x: Tensor, mask: Tensor) -> Tensor:
    """x.masked_fill(mask, -inf) (MaskedFillBackward0): saves the mask (a view of the causal buffer).
    The (T, T) mask broadcasts over batch and heads: read once (see memcalc.exact.sim.tensors.nbytes)."""
    mask_bytes = nbytes(mask)

    def rule(gs):
        return [made(g, gs[0].shape, "masked_fill", gs[0], mask_bytes, dtype=gs[0].dtype)]

    node = g.begin("masked_fill", [x], rule, [(mask, "mask")])
    out = made(g, x.shape, "masked_fill", x, mask, dtype=x.dtype)
    g.end(node, [out])
    return out
