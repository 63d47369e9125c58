"""The fused aten kernels that keep statistics for their backward (memcalc.exact.aten): native_layer_norm
(its mean and rstd), the flash attention kernel (logsumexp, and on CUDA the Philox seed and offset) and the
memory-efficient one that SDPA runs with a mask.
"""

from __future__ import annotations

from ..sim.graph import Graph
from ..sim.tensors import Tensor, nbytes
from .operands import autocast, size


def layer_norm(g: Graph, x: Tensor, w: Tensor, b: Tensor, cpu: bool = False) -> Tensor:
    """aten.native_layer_norm (NativeLayerNormBackward0): output, and mean and rstd (B, T, 1), fp32 on CUDA
    (layer_norm_kernel.cu: the accumulate type); on CPU tensors (cpu) in the input's dtype unless the
    weight's differs (layer_norm.cpp layer_norm_cpu: param_scalar_type(input, mixed_type)); saves input,
    weight, bias, mean, rstd. Backward: grad input, grad weight, grad bias, each where it requires grad
    (output_mask: a frozen LayerNorm under LoRA makes its input's alone)."""
    x, w, b = autocast(g, "layer_norm", x, w, b)
    sx, sw = x.shape, w.shape
    stat, stat_dtype = x.shape[:-1] + (1,), x.dtype if cpu and x.dtype == w.dtype else "fp32"
    read = nbytes(x) + nbytes(w) + 2 * size(stat, stat_dtype)  # input, weight, mean, rstd
    mask = (x.requires_grad, w.requires_grad, b.requires_grad)

    def rule(gs):
        op = "native_layer_norm_backward"
        grads = [g.empty(shape, gs[0].dtype, op) if needed else None for shape, needed in zip((sx, sw, sw), mask)]
        g.kernel(op, (gs[0], read), tuple(t for t in grads if t is not None))
        return grads

    node = g.begin("native_layer_norm", [x, w, b], rule, [(x, "input"), (w, "weight"), (b, "bias")])
    out = g.empty(x.shape, x.dtype, "native_layer_norm")
    mean = g.empty(stat, stat_dtype, "native_layer_norm")
    rstd = g.empty(stat, stat_dtype, "native_layer_norm")
    g.kernel("native_layer_norm", (x, w, b), (out, mean, rstd))
    g.end(node, [out, mean, rstd], [(mean, "mean"), (rstd, "rstd")])
    return out


def flash_attention(g: Graph, q: Tensor, k: Tensor, v: Tensor, cpu: bool = False, mask: Tensor | None = None) -> Tensor:
    """aten._scaled_dot_product_flash_attention (ScaledDotProductFlashAttentionBackward0): output
    (laid out as q), logsumexp (B, nh, T) fp32, the Philox seed (2 x uint64) and offset (uint64);
    saves q, k, v, output, logsumexp, seed, offset. Backward: grad q, k, v. On CPU, SDPA's flash
    backend is aten._scaled_dot_product_flash_attention_for_cpu: no dropout, so no seed or offset; it takes
    an additive mask (attn_mask, saved), where CUDA's flash kernel takes none. Autocast wraps SDPA (and CUDA's flash op): q, k, v cast to 16 bits, value first.

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
        g.kernel(name, (q, k, v, mask), (out, lse), "flash", one, "attention", 2 * one, dt)  # QKᵀ and PV, causal half
        return (out, lse) if cpu else (out, lse, g.empty((2,), "uint64", name), g.empty((), "uint64", name))

    inputs = [(q, "query"), (k, "key"), (v, "value")] + ([(mask, "attn_mask")] if mask is not None else [])
    if not cpu:  # its CUDA/meta node packs key, query, value, then logsumexp, output (saved_tensors_hooks sees so)
        inputs = [(k, "key"), (q, "query"), (v, "value")] + inputs[3:]
    node = g.begin(name, [q, k, v], rule, inputs)
    if cpu:
        out, lse = g.outputs(name, kernel, ("output", "logsumexp"))
        g.end(node, [out, lse], [(out, "output"), (lse, "logsumexp")])
        return out
    out, lse, seed, offset = g.outputs(name, kernel, ("output", "logsumexp", "philox_seed", "philox_offset"))
    g.end(node, [out, lse], [(lse, "logsumexp"), (out, "output"), (seed, "philox_seed"), (offset, "philox_offset")])
    return out


def efficient_attention(g: Graph, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """aten._scaled_dot_product_efficient_attention with compute_log_sumexp, given an additive bias (not
    causal), or without one causal (is_causal: fp32, which the flash kernel refuses)
    (ScaledDotProductEfficientAttentionBackward0): output (B, nh, T, d) laid out (B, T, nh, d), logsumexp
    (B, nh, T rounded up to 32) fp32, the Philox seed and offset (0-d int64 each); saves q, k, v, the bias,
    output, logsumexp, seed, offset. Backward: grad q, k, v, each laid out (B, T, nh, d) (the meta function's
    empty_permuted; CUDA's kernel lays them out as its inputs and adds an fp32 (B, nh, T) delta), none for
    the bias. With dropout CUDA makes the seed and offset on the CPU. K and V come in with every head
    (repeat_kv, or MHA). With a bias the kernel reads it block by block and skips none: it executes every
    FLOP FlopCounterMode counts; causal, it skips the blocks above the diagonal: half."""
    q, k, v = autocast(g, "scaled_dot_product_attention", q, k, v)
    sq, sk, sv = q.shape, k.shape, v.shape
    B, nh, Tq, d = q.shape
    one = 2 * B * nh * Tq * k.shape[2] * d  # one (B·nh) x Tq x Tk matmul over d
    name, op = "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"
    lse_shape = (B, nh, -(-Tq // 32) * 32)
    read, dt = nbytes(q) + nbytes(k) + nbytes(v) + (nbytes(bias) if bias is not None else 0), q.dtype
    o_bytes, lse_bytes = size(q.shape, q.dtype), size(lse_shape, "fp32")
    run = 1 if bias is not None else 2  # causal: half the blocks executed

    def rule(gs):
        grads = [g.empty(sq, gs[0].dtype, op), g.empty(sk, gs[0].dtype, op), g.empty(sv, gs[0].dtype, op)]
        g.kernel(op, (read, o_bytes, gs[0], lse_bytes), tuple(grads), "flash", 5 * one // run, "attention", 5 * one,
                 dt)  # fmt: skip
        return grads

    def kernel():
        out = g.empty(q.shape, q.dtype, name)
        lse = g.empty(lse_shape, "fp32", name)
        inputs = (q, k, v) + ((bias,) if bias is not None else ())
        g.kernel(name, inputs, (out, lse), "flash", 2 * one // run, "attention", 2 * one, dt)  # QKᵀ and PV
        return out, lse, g.empty((), "int64", name), g.empty((), "int64", name)

    saved = [(q, "query"), (k, "key"), (v, "value")] + ([(bias, "attn_bias")] if bias is not None else [])
    node = g.begin(name, [q, k, v], rule, saved)
    out, lse, seed, offset = g.outputs(name, kernel, ("output", "logsumexp", "philox_seed", "philox_offset"))
    g.end(node, [out, lse], [(out, "output"), (lse, "log_sumexp"), (seed, "philox_seed"), (offset, "philox_offset")])
    return out
