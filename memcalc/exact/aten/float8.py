"""torchao's float8 training linear (torchao.float8, convert_to_float8_training), in bytes and kernels.

Float8Linear.forward runs matmul_with_hp_or_float8_args (torchao/float8/float8_linear.py @ torchao 0.18.0):
an autograd.Function that saves its high-precision input and the weight's transpose, casts both to float8
on the fly, and multiplies them with torch._scaled_mm; its backward casts the gradient, the weight and the
input again (each matmul its own cast) for the two backward matmuls. So the saved activations are the
16-bit recipe's: float8 adds only temporaries, which this module replays in torchao's order, with the
lifetimes its Python locals give them (tests/test_float8.py holds it to torchao on meta):

  a cast (hp_tensor_to_float8_dynamic): amax = max(abs(x)) (rowwise: amax over one dim, keepdim), the scale
  448/amax in float64 then float32 (float8_utils.amax_to_scale; rowwise rounds it down to a power of two:
  log2, floor, exp2), then _ToFloat8ConstrFunc: x.to(float32) * scale, clamp (to_fp8_saturated), .to(float8);
  the float32 product lives until the float8 copy is made.
  a float8 matmul (float8_ops.float8_mm, preprocess_addmm): operand a row-major and b column-major, each
  copied (.contiguous()) where it is not; the inverse scales (reciprocal); rowwise without fast accumulation
  (the two backward matmuls, Float8LinearConfig's gemm_config_grad_*) multiplies by the outer product of
  the inverse scales afterwards, a float32 tensor of the output's shape (addmm_float8_unwrapped).

Recipes (Float8LinearConfig.from_recipe_name): tensorwise casts the input and weight to e4m3 and the
gradient to e5m2 with one scale each; rowwise casts all three to e4m3, scaled along the matmul's
contraction dimension, with power-of-two scales.
"""

from __future__ import annotations

import math

from ..sim.graph import Graph
from ..sim.tensors import Tensor, nbytes
from .arithmetic import add, to
from .operands import made
from .views import t as transpose

E4M3, E5M2 = "fp8-e4m3", "fp8-e5m2"


def scale_of(g: Graph, x: Tensor | tuple, rowwise: bool, dim: int) -> Tensor:
    """tensor_to_scale: the float32 scale of a tensor (or its (shape, dtype, bytes)), one per tensor or
    (rowwise) one per slice along dim, with the temporaries of torchao's eager ops."""
    shape, dtype, read = shape_of(x)
    amax_shape = tuple(1 if i == dim % len(shape) else n for i, n in enumerate(shape)) if rowwise else ()
    a = made(g, shape, "abs", read, dtype=dtype)
    op = "amax" if rowwise else "max"

    def reduce(a=a):  # bound now: `a` is deleted below, once the reduction has read it
        return (made(g, amax_shape, op, a, dtype=dtype),)

    (amax,) = g.outputs(op, reduce)  # torchtitan's per-op SAC keeps aten.max's output (float8's amax)
    del reduce, a  # abs's output dies with the expression: torch.max(torch.abs(x))
    wide = made(g, amax_shape, "_to_copy", amax, dtype="fp64")  # amax_to_scale: float64, as compile and eager agree
    clamped = made(g, amax_shape, "clamp", wide, dtype="fp64")
    del wide
    inverse = made(g, amax_shape, "reciprocal", clamped, dtype="fp64")  # finfo.max / clamp(amax): reciprocal, mul
    del clamped
    scaled = made(g, amax_shape, "mul", inverse, dtype="fp64")
    del inverse
    scale = made(g, amax_shape, "_to_copy", scaled, dtype="fp32")
    del scaled, amax
    if rowwise:  # _round_scale_down_to_power_of_2: exp2(floor(log2(scale)))
        for op in ("log2", "floor", "exp2"):
            scale = made(g, amax_shape, op, scale, dtype="fp32")
    return scale


def shape_of(x: Tensor | tuple) -> tuple[tuple, str, Tensor | int]:
    """(shape, dtype, what a kernel reads) of a tensor, or of a saved one a backward rule knows by its bytes."""
    return x if isinstance(x, tuple) else (x.shape, x.dtype, x)


def to_float8(g: Graph, x: Tensor | tuple, fp8: str, rowwise: bool, dim: int) -> tuple[Tensor, Tensor]:
    """hp_tensor_to_float8_dynamic: (float8 data, scale)."""
    scale = scale_of(g, x, rowwise, dim)
    shape, dtype, read = shape_of(x)
    # tensor.to(torch.float32): no copy when it is float32 already
    wide = made(g, shape, "_to_copy", read, dtype="fp32") if dtype != "fp32" else None
    scaled = made(g, shape, "mul", read if wide is None else wide, scale, dtype="fp32")  # x * scale
    del wide
    clamped = made(g, shape, "clamp", scaled, dtype="fp32")  # to_fp8_saturated: clamp to its range, then cast
    data = made(g, shape, "_to_copy", clamped, dtype=fp8)
    del clamped, scaled  # to_fp8_saturated's local, then _ToFloat8ConstrFunc's
    return data, scale


def scaled_mm(g: Graph, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], out_shape: tuple, inner: int,
              copies: tuple, post_scale: bool) -> Tensor:  # fmt: skip
    """float8_mm of (data, scale) operands over an inner dimension: the operands laid out (copies: whether a,
    b are copied), the inverse scales, torch._scaled_mm to bf16, and rowwise's float32 post-scale without
    fast accumulation."""
    (a_data, a_scale), (b_data, b_scale) = a, b
    # .contiguous() of an operand in the other layout: a copy of its bytes
    laid = [made(g, t.shape, "clone", t, dtype=t.dtype) if copy else t
            for t, copy in zip((a_data, b_data), copies)]  # fmt: skip
    a_inverse = made(g, a_scale.shape, "reciprocal", a_scale)
    b_inverse = made(g, b_scale.shape, "reciprocal", b_scale)
    post = None
    if post_scale:  # a_inverse_scale * b_inverse_scale: (rows, 1) x (1, cols), the output's shape
        post = made(g, out_shape, "mul", a_inverse, b_inverse)
        a_inverse = made(g, (), "new_ones")  # a_inverse_scale.new_ones(()), then b's: the scaling done after
        b_inverse = made(g, (), "new_ones")
    out = g.empty(out_shape, "bf16", "_scaled_mm")
    flops = 2 * out_shape[0] * inner * out_shape[1]
    g.kernel("_scaled_mm", (laid[0], laid[1], a_inverse, b_inverse), (out,), "tensor", flops, "linear", dtype=laid[0].dtype)
    if post is not None:  # output *= post_inverse_scale
        g.kernel("mul_", (out, post), (out,))
    return out


def float8_linear(g: Graph, x: Tensor, w: Tensor, b: Tensor | None, recipe: str) -> Tensor:
    """Float8Linear(x) for a (..., in) x and an (out, in) weight: matmul_with_hp_or_float8_args(x, w.t()),
    then + bias.to(dtype). Under torch.autocast the input is cast to bf16 first and the weight is cast from
    its fp32 (no autocast cache: F.linear is never called)."""
    # Float8Linear.forward: input.to(torch.get_autocast_gpu_dtype()) where torch.is_autocast_enabled(), which asks
    # of CUDA's autocast only (CPU's leaves the input as it is); the weight stays fp32
    if g.autocast is not None and g.autocast.device == "cuda":
        x = to(g, x, "bf16")
    rowwise = recipe == "rowwise"
    grad_fp8 = E4M3 if rowwise else E5M2
    wt = transpose(g, w)  # self.weight.t(): the Function's second input, (in, out), column-major
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    rows = math.prod(lead)
    wt_seen = (wt.shape, wt.dtype, nbytes(wt))
    x2_seen = ((rows, k), x.dtype, nbytes(x))

    def rule(gs):
        go = gs[0]
        go2 = g.view(go, (rows, n))  # grad_output.reshape(-1, out)
        go_fp8 = to_float8(g, go2, grad_fp8, rowwise, -1)
        w_fp8 = to_float8(g, wt_seen, E4M3, rowwise, -1)
        # grad_input = go · (w_t)ᵀ: (w_t)ᵀ is row-major, so preprocess_addmm copies it column-major
        grad_input = scaled_mm(g, go_fp8, w_fp8, (rows, k), n, (False, True), rowwise)
        grad_input = g.view(grad_input, lead + (k,))
        go_fp8_w = to_float8(g, go2, grad_fp8, rowwise, 0)  # grad_output again, scaled along the rows
        x_fp8 = to_float8(g, x2_seen, E4M3, rowwise, 0)
        # grad_weight = goᵀ · x: goᵀ is column-major and x row-major: both copied
        grad_weight = scaled_mm(g, go_fp8_w, x_fp8, (n, k), rows, (True, True), rowwise)
        del go_fp8, w_fp8, go_fp8_w, x_fp8, go2  # the backward's locals, released as it returns
        return [grad_input, g.view(grad_weight, (k, n))]

    node = g.begin("matmul_with_hp_or_float8_args", [x, wt], rule)
    x_fp8 = to_float8(g, x, E4M3, rowwise, -1)
    wt_fp8 = to_float8(g, wt, E4M3, rowwise, 0)
    x2 = (g.view(x_fp8[0], (rows, k)), x_fp8[1])
    # aten.mm on the float8 subclass is the op a selective checkpoint sees (and may keep); _scaled_mm runs inside
    (out,) = g.outputs("mm", lambda a=x2, b=wt_fp8: (scaled_mm(g, a, b, (rows, n), k, (False, False), False),))
    del x_fp8, wt_fp8, x2  # the forward's locals
    out = g.view(out, lead + (n,))
    # a custom Function's saved tensors are packed as apply() returns, after its forward ran
    g.end(node, [out], [(x, "input_hp"), (wt, "weight_hp_t")])
    del wt
    return out if b is None else add(g, out, to(g, b, out.dtype))  # output + self.bias.to(output.dtype)
