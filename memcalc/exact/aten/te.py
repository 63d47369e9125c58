"""Transformer Engine's te.Linear under fp8_autocast with delayed scaling, in bytes and kernels.

As llm-foundry's MPT runs it for its FP8 benchmarks: scripts/train/benchmarking/submit_benchmarks.py @
b2a43a1477a45f40f4086a1c72f851b0ab42d0ac sets model.fc_type = 'te' for fp8 on H100 and installs
TransformerEngine v0.10; llmfoundry/models/layers/fc.py maps 'te' to te.Linear (Wqkv, out_proj, up_proj,
down_proj; the norms stay torch's); Composer's amp_fp8 (composer/core/precision.py @ v0.16.3,
c82da77fb5ea1908a0d659c181b97691f0b4b976) enters te.fp8_autocast with DelayedScaling(fp8_format=HYBRID,
amax_history_len=16, amax_compute_algo='max'), margin 0 and reduce_amax True by default
(transformer_engine/common/recipe.py @ v0.10, 96ed6fc69d99a9cff49637dbc58c837c8d921ad7). The modules are
called without is_first_microbatch, so the fp8 weights are cast afresh in every forward.

_Linear.forward (transformer_engine/pytorch/module/linear.py @ v0.10):
  fp8_cast_transpose_fused(inputmat): one kernel reads the 16-bit input and writes it in e4m3 and its e4m3
    transpose; the scale is the one the last step computed (delayed scaling: no amax pass before the cast),
    the amax is written by the same kernel into amax_history[0]
  get_fp8_weights_empty_tensors (module/base.py): weight_fp8 (out, in) and weight_t_fp8 (in, out), uint8,
    new each forward; fp8_cast_transpose_fused(weight) fills both in one kernel
  fp8_gemm(weight_fp8, inputmat): the output in the activation dtype, the bias fused (use_bias)
  ctx.save_for_backward(inputmat_t, weight, weight_t_fp8, scale_inv.clone()): the input is kept as its
    e4m3 transpose, one byte an element, not the 16-bit input; the fp8 forward copies (inputmat, weight_fp8)
    die as forward returns
_Linear.backward: grad_output_preprocess (module/base.py) casts the gradient to e5m2 with its transpose,
  fused with the bias gradient where there is a bias (fp8_cast_transpose_bgrad_fused; a bf16 gradient, which
  autograd casts to an fp32 bias's dtype); dgrad = fp8_gemm(weight_t_fp8, grad_output_c), wgrad =
  fp8_gemm(inputmat_t, grad_output_t), both to bf16.
Per module, once per forward (prepare_forward) and once per backward (_prepare_backward):
  amax_and_scale_update (pytorch/fp8.py fused_amax_and_scale_update, under torch.compile): the max over the
  history, the scale and its inverse from it, the history's roll (scale_update: two kernels).
Not replayed: the amax all-reduce at each fp8_autocast exit and in backward (global_amax_reduction), TE's
tensor-parallel paths, is_first_microbatch's cached fp8 weights, LayerNormLinear's fused norm and cast.
"""

from __future__ import annotations

import math

from memcalc.errors import InputError

from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .arithmetic import to
from .operands import made

E4M3, E5M2 = "fp8-e4m3", "fp8-e5m2"  # Format.HYBRID: e4m3 forward, e5m2 gradients (recipe.py @ v0.10)
AMAX_HISTORY_LEN = 16  # Composer's amp_fp8 recipe (precision.py @ v0.16.3); DelayedScaling's default is 1024
FORWARD_METAS, BACKWARD_METAS = 3, 2  # set_meta_tensor: input, weight, output per GEMM; grad_output, grad_input
CUBLAS_WORKSPACE = 33_554_432  # get_cublas_workspace_size_bytes (module/base.py @ v0.10): 32 MiB on Hopper


def meta_tensors(g: Graph) -> list[Tensor]:
    """One module's fp8_meta, allocated by its first forward and kept (module/base.py set_meta_tensor @ v0.10):
    scaling_fwd's scale, scale_inv (3 fp32 each) and amax_history (16 x 3 fp32), the non-weight mask (3
    bools); scaling_bwd's the same with 2."""
    out = []
    for n in (FORWARD_METAS, BACKWARD_METAS):
        out += [g.empty((n,), "fp32", "te scale", kind="buffer"), g.empty((n,), "fp32", "te scale_inv", kind="buffer"),
                g.empty((AMAX_HISTORY_LEN, n), "fp32", "te amax_history", kind="buffer"),
                g.empty((n,), "bool", "te non_weight_mask", kind="buffer")]  # fmt: skip
    return out


def workspace(g: Graph) -> Tensor:
    """get_workspace: the cuBLAS workspace every fp8_gemm is handed, one per process."""
    return g.empty((CUBLAS_WORKSPACE,), "uint8", "te cublas workspace", kind="buffer")


def check_dims(rows: int, w: Tensor) -> None:
    """assert_dim_for_fp8_forward_exec (pytorch/utils.py @ v0.10): each 2-D operand's first dimension a multiple
    of 8, its second of 16; Transformer Engine asserts, it does not fall back to 16 bits."""
    for what, (m, n) in (("input", (rows, w.shape[1])), ("weight", w.shape)):
        if m % 8 or n % 16:
            raise InputError(f"fp8:te: Transformer Engine's fp8 GEMMs need each operand's rows a multiple of 8 and "
                             f"its columns of 16; the {what} is {m} x {n}")  # fmt: skip


def scale_update(g: Graph, n: int) -> None:
    """amax_and_scale_update over one direction's n fp8 tensors: fused_amax_and_scale_update is wrapped in
    jit_fuser, torch.compile on torch 2 (pytorch/jit.py @ v0.10), so Inductor's two kernels: the max over the
    history with the new scale and scale_inv computed from it (a reduction and its pointwise epilogue), and
    the history rolled by one row with its first row zeroed (update_amax_history: roll, fill_)."""
    history = AMAX_HISTORY_LEN * n * 4
    g.kernel("te_scale_update", (history, n * 4, n * 4, n), (n * 4, n * 4))  # history, scale, scale_inv, mask
    g.kernel("te_amax_roll", (history,), (history,))


def cast_transpose(g: Graph, x: Tensor | int, shape: tuple, fp8: str, bias: bool = False) -> tuple[Tensor, ...]:
    """fp8_cast_transpose_fused (with bgrad: fp8_cast_transpose_bgrad_fused): (bias gradient,) x in fp8, and
    its fp8 transpose; one kernel, which also writes the amax (4 bytes) into the history."""
    m, n = shape
    data = g.empty((m, n), fp8, "te cast")
    data_t = g.empty((n, m), fp8, "te cast_transpose")
    outs = (data, data_t)
    if bias:
        outs = (g.empty((n,), "bf16", "te bgrad"),) + outs
    g.kernel("te_cast_transpose_bgrad" if bias else "te_cast_transpose", (x, 4), outs + (4,))
    return outs


def fp8_gemm(g: Graph, a: Tensor | int, b: Tensor | int, out_shape: tuple, inner: int, dtype: str,
             extra: tuple = ()) -> Tensor:  # fmt: skip
    """cpp_extensions/gemm.py fp8_gemm: a cuBLASLt fp8 matmul to bf16 (extra: a fused bias it reads)."""
    out = g.empty(out_shape, "bf16", "te fp8_gemm")
    flops = 2 * out_shape[0] * inner * out_shape[1]
    g.kernel("te_fp8_gemm", (a, b) + extra, (out,), "tensor", flops, "linear", dtype=dtype)
    return out


def te_linear(g: Graph, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """te.Linear(x) for a (..., in) x and an (out, in) weight, inside fp8_autocast (module/linear.py @ v0.10)."""
    if g.autocast is not None and g.autocast.device == "cuda":  # cast_if_needed(inputmat, activation_dtype)
        x = to(g, x, "bf16")
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    rows = math.prod(lead)
    check_dims(rows, w)
    has_bias = b is not None

    def rule(gs):
        scale_update(g, BACKWARD_METAS)  # _prepare_backward: amax_and_scale_update(fp8_meta, False)
        go = g.view(gs[0], (rows, n))  # grad_output.contiguous().view(-1, out)
        casts = cast_transpose(g, go, (rows, n), E5M2, has_bias)
        grad_bias, go_c, go_t = casts if has_bias else (None, *casts)
        dgrad = fp8_gemm(g, k * n, go_c, (rows, k), n, E4M3)  # weight_t_fp8 · grad_output_c
        wgrad = fp8_gemm(g, rows * k, go_t, (n, k), rows, E4M3)  # inputmat_t · grad_output_t
        del go_c, go_t, go
        return [wgrad, g.view(dgrad, lead + (k,)), grad_bias]

    node = g.begin("_Linear", [w, x, b], rule)
    scale_update(g, FORWARD_METAS)  # prepare_forward: amax_and_scale_update(fp8_meta, True)
    inputmat, inputmat_t = cast_transpose(g, g.view(x, (rows, k)), (rows, k), E4M3)
    weight_fp8, weight_t_fp8 = cast_transpose(g, w, (n, k), E4M3)  # the weight's, read in its own dtype
    bias = b
    if b is not None and b.dtype != "bf16":  # cast_if_needed(bias, bias_dtype)
        bias = made(g, b.shape, "_to_copy", b, dtype="bf16")
    out = fp8_gemm(g, weight_fp8, inputmat, (rows, n), k, E4M3, () if bias is None else (bias,))
    del inputmat, weight_fp8, bias  # the forward's locals
    scale_inv = made(g, (FORWARD_METAS,), "clone", FORWARD_METAS * 4)  # scaling_fwd.scale_inv.clone()
    out = g.view(out, lead + (n,))  # out.view(-1, *inp.shape[1:-1], out_features), inside the Function
    g.end(node, [out], [(inputmat_t, "inputmat_t (fp8)"), (w, "weight"), (weight_t_fp8, "weight_t_fp8"),
                        (scale_inv, "scale_inv")])  # fmt: skip
    del inputmat_t, weight_t_fp8, scale_inv
    return out
