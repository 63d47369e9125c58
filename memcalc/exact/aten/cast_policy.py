"""torch.autocast in bytes: which aten ops cast their inputs, to what, and the cache of weight casts.

A stock PyTorch loop keeps fp32 weights and runs the forward under
`with torch.autocast(device, dtype=torch.bfloat16): loss = model(...)`. Autocast is a dispatch key:
ahead of autograd, its wrapper of each listed op casts the op's floating inputs, so that the op
records its node (and saves its inputs) in the cast dtype. The wrappers' policies
(aten/src/ATen/autocast_mode.h, enum CastPolicy):
  lower_precision_fp  every floating input to the autocast dtype (bf16, or fp16): matmuls, linear, SDPA
  fp32                every floating input to fp32: pow, rsqrt, the norms, the losses (CUDA)
  fp32_set_opt_dtype  the op's own dtype argument set to float: softmax, log_softmax, sum (CUDA only)
  fp32_append_dtype   norm: dtype=float appended
  promote             every floating input to the widest among them (fp32 if any is)
  banned              binary_cross_entropy raises under CUDA autocast
Ops on no list follow ordinary type promotion (a bf16 activation times an fp32 weight is fp32:
memcalc.exact.aten.promote).

The lists are torch 2.13's registrations, op for op (tests/test_stack_autocast.py holds them against
the installed binary's dispatch tables): CUDA's are the AT_FORALL_* macros of autocast_mode.h
(torch 2.13.0's include/ATen/autocast_mode.h) registered by autocast_mode.cpp's
TORCH_LIBRARY_IMPL(aten, Autocast, m); CPU's are autocast_mode.cpp's own list
(TORCH_LIBRARY_IMPL(aten, AutocastCPU, m), pytorch/pytorch@008ec6b1). Autocast does nothing on the
meta device: its dispatch keys are per device, which is why verify/autocast.py measures on CPU.

cached_cast (autocast_mode.cpp): an eligible input (a floating tensor, not fp64) of another dtype is
copied by .to(dtype), an aten._to_copy whose autograd node casts the gradient back. A cast to the
autocast dtype of an fp32 leaf that requires grad (a parameter) is cached, keyed by the parameter,
until the outermost autocast region exits (torch/amp/autocast_mode.py __exit__:
clear_autocast_cache): each weight is cast once per forward, and its cast lives through forward.
The wrapper calls the op with cached_cast(args)...: C++ leaves the order of evaluating those
arguments to the compiler, and GCC's, measured on CPU, is right to left (a linear casts its bias,
its weight, then its input; SDPA its value, key, then query).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from memcalc.errors import InputError

from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import to as copy_to

LOWER, FP32, SET_OPT_DTYPE, APPEND_DTYPE, PROMOTE, BANNED = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")  # fmt: skip
FLOATING = ("fp32", "bf16", "fp16")  # is_eligible: floating and not fp64
DEVICES = ("cuda", "cpu")


def listed(policy: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), policy)


# autocast_mode.h AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE; autocast_mode.cpp adds cudnn's
# convolutions and bans binary_cross_entropy.
CUDA = {
    **listed(LOWER, """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
        linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
        _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
        scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose"""),
    **listed(FP32, """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm
        frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss
        nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
        margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
        _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
        upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"""),
    **listed(SET_OPT_DTYPE, """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""),
    **listed(APPEND_DTYPE, "norm.Scalar norm.ScalarOpt_dim"),
    **listed(PROMOTE, "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"),
    **listed(BANNED, "binary_cross_entropy"),
}
# autocast_mode.cpp TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) (its Dimname overloads are not in
# torch 2.13's registrations, nor here)
CPU = {
    **listed(LOWER, """conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot
        baddbmm addmm _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer
        conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention
        _native_multi_head_attention"""),
    **listed(FP32, """avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile
        quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist grid_sampler_2d
        _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky cholesky_inverse
        cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d max_unpool3d
        adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
        replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
        poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn
        fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond
        linalg_cond.p_str linalg_matrix_rank linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor
        linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals
        linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d
        fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex
        linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex"""),
    **listed(PROMOTE, "stack cat index_copy"),
}
POLICIES = {"cuda": CUDA, "cpu": CPU}


@dataclass
class Autocast:
    """One autocast setting (device and 16-bit dtype), with torch's cast cache and nesting depth."""

    device: str  # cuda | cpu: whose lists
    dtype: str  # bf16 | fp16: the lower precision
    cache: dict[int, Tensor] = field(default_factory=dict)  # id(parameter) -> its cast
    nesting: int = 0

    @contextlib.contextmanager
    def region(self, g: Graph):
        """with torch.autocast(device, dtype): the ops below autocast; leaving the outermost region
        drops the cached casts (autocast_mode.py __exit__)."""
        outer, g.autocast = g.autocast, self
        self.nesting += 1
        try:
            yield
        finally:
            self.nesting -= 1
            g.autocast = outer
            if self.nesting == 0:
                self.cache.clear()

    def inputs(self, g: Graph, op: str, tensors: tuple) -> tuple:
        """The wrapper of op (WrapFunction_<policy>::call): its tensors cast, right to left."""
        policy = POLICIES[self.device].get(op)
        if policy == LOWER:
            to = self.dtype
        elif policy == FP32:
            to = "fp32"
        elif policy == PROMOTE:  # promote_type: fp32 if any eligible input is, else the lower precision
            to = "fp32" if any(t is not None and t.dtype == "fp32" for t in tensors) else self.dtype
        elif policy == BANNED:  # binary_cross_entropy_banned
            raise InputError(f"{op} is unsafe to autocast (autocast_mode.cpp); use the _with_logits form")
        else:
            return tensors
        out = list(tensors)
        for i in reversed(range(len(out))):
            out[i] = self.cached_cast(g, out[i], to)
        return tuple(out)

    def opt_dtype(self, op: str, x: Tensor) -> str | None:
        """fp32_set_opt_dtype: the op's dtype argument, float where x is eligible."""
        if POLICIES[self.device].get(op) == SET_OPT_DTYPE and x.dtype in FLOATING:
            return "fp32"
        return None

    def cached_cast(self, g: Graph, t: Tensor | None, to: str) -> Tensor | None:
        """autocast_mode.cpp cached_cast: a parameter's cast to the lower precision is made once
        per region; any other eligible tensor is copied every time."""
        if t is None or t.dtype not in FLOATING or t.dtype == to:
            return t
        if to != self.dtype or t.dtype != "fp32" or not is_parameter(t):
            return copy_to(g, t, to)
        cast = self.cache.get(id(t))
        if cast is None:
            cast = self.cache[id(t)] = copy_to(g, t, to)
        return cast


def is_parameter(t: Tensor) -> bool:
    """A leaf that requires grad, not a view: what autocast caches the cast of."""
    return t.grad_fn is not None and t.grad_fn.leaf is t


def autocast_for(recipe: str, precision: str, device: str) -> Autocast | None:
    """The autocast a step runs its forward under: the autocast recipe's, for a 16-bit precision."""
    if recipe != "autocast" or precision == "fp32":
        return None
    return Autocast(device, precision)
