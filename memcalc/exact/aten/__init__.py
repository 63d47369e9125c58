"""The aten ops verify/builder.py runs, in bytes: what each allocates, what its autograd node saves,
and what its backward allocates, in order (derivatives.yaml's formulas, checked against the meta trace).
The models call them by this package's names (aten.mm); each family is written in its own module:
  operands     what operands decide: bytes, broadcast shapes, type promotion, autocast's casts
  views        views, reshape's copy, split, chunk, cat, slices and pads
  arithmetic   casts, add, sub, mul, div, pow, rsqrt, mean, sums and a row norm
  activations  the activations, softmax and log-softmax, dropout, masked_fill
  matmul       mm, addmm, bmm, F.linear and 4-D torch.matmul
  fused        native_layer_norm and the flash and memory-efficient attention kernels
  indexing     embedding, nll_loss, gather, index_select, index_add
and beside them, called by name: cast_policy (torch.autocast's op lists and its cache of weight casts), and
the fp8 linears, float8 (torchao's Float8Linear) and te (Transformer Engine's te.Linear).

Each op is written as autograd runs it: g.begin() makes the node and packs the saved inputs, the
kernel allocates the outputs, g.end() attaches them and packs the saved outputs. Every begin/end
names the tensors its node saves: these are the terms memcalc.exact counts.
A backward rule returns one gradient per input; a (gradient, shape) pair is summed to the input's
shape after the rule returns, as autograd's validate_outputs does for broadcast inputs (and a gradient
of another dtype than its input is cast to it).

Under torch.autocast (memcalc.exact.aten.cast_policy) the ops autocast wraps cast their inputs first, as its
wrapper does before the op records its node: autocast(g, op, ...) names the op whose list decides.
Ops whose inputs' dtypes differ compute in the wider one (promote).

Each kernel, forward and backward, is also written down with g.kernel(op, reads, writes): what it
reads and writes in HBM (each operand once) and, for matmuls, its FLOPs (2·m·k·n). Backward rules
keep byte counts of the tensors they read, never the tensors: a reference would change lifetimes.

May import: memcalc.exact.base, memcalc.exact.sim, and what they may.
"""

from .activations import exp, gelu, log_softmax, masked_fill, native_dropout, safe_softmax, sigmoid, silu, softmax, tanh
from .arithmetic import (add, add_scalar, div, div_scalar, div_tensor, mean_last, mul, mul_scalar, mul_scalar_, neg,
                         pow2, pow_scalar, rsqrt, sub, sub_scalar, sum_all, sum_keepdim, sum_last, to,
                         vector_norm_rows)  # fmt: skip
from .fused import efficient_attention, flash_attention, layer_norm
from .indexing import embedding, gather, index_add_, index_select, nll_loss
from .matmul import addmm, bmm, linear, matmul4, mm
from .operands import autocast, promote, size
from .views import (cat, cat_last, chunk2, expand, narrow_last, pad_last, reshape_copy, slice_last, split,
                    split_last, t, view)  # fmt: skip

__all__ = [
    "add", "add_scalar", "addmm", "autocast", "bmm", "cat", "cat_last", "chunk2", "div", "div_scalar", "div_tensor",
    "efficient_attention", "embedding", "exp", "expand", "flash_attention", "gather", "gelu", "index_add_", "index_select", "layer_norm", "linear",
    "log_softmax", "masked_fill", "matmul4", "mean_last", "mm", "mul", "mul_scalar", "mul_scalar_", "narrow_last",
    "native_dropout", "neg", "nll_loss", "pad_last", "pow2", "pow_scalar", "promote", "reshape_copy", "rsqrt",
    "safe_softmax", "sigmoid", "silu", "size", "slice_last", "softmax", "split", "split_last", "sub", "sub_scalar",
    "sum_all", "sum_keepdim", "sum_last", "t", "tanh", "to", "vector_norm_rows", "view",
]  # fmt: skip
