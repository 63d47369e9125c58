"""The Trainer's gradient clipping, in bytes: TrainingArguments(max_grad_norm=1.0), its default. transformers 5.25
Trainer._inner_training_loop calls _clip_grad_norm after the micro-batches' backward and before optimizer.step():
accelerate's Accelerator.clip_grad_norm_ (under fp16 GradScaler's unscale_ first: memcalc.exact.train.amp), then
torch/nn/utils/clip_grad.py clip_grad_norm_ (torch 2.13) over model.parameters():

  _get_total_norm          the gradients grouped by device and dtype (a std::unordered_map: the last dtype
                           seen comes first, libstdc++ putting a node whose bucket is empty at the front);
                           torch._foreach_norm of each group (CUDA: aten/src/ATen/native/cuda/ForeachReduceOp.cu,
                           an fp32 zeros of ntensors x max chunks of 65536 elements, then one 0-d result per
                           tensor in the gradients' dtype, the zeros freed); torch.stack of the norms,
                           linalg.vector_norm of the stack
  _clip_grads_with_norm_   max_norm / (total_norm + 1e-6) (Tensor.__rtruediv__: reciprocal() * max_norm), clamped
                           to 1.0, torch._foreach_mul_ of each group in place

The total norm is the Trainer's grad_norm, a local of its loop until the next optimizer step's clipping: it outlives
the step. (verify/recipes.py cuda_norms makes meta and CPU tensors take the same path, the zeros made visible.) The
sharded engines' clipping (DeepSpeed's in its engine, FSDP2's over DTensors) is not this one, and is not replayed.
"""

from __future__ import annotations

from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor

CHUNK = 65536  # aten/src/ATen/native/cuda/MultiTensorApply.cuh kChunkSize


def clip_grad_norm(g: Graph, params: list[Tensor]) -> Tensor:
    """clip_grad_norm_(params, 1.0) over the parameters that have a gradient: the total norm (0-d), returned."""
    seen: dict[str, list[Tensor]] = {}  # _group_tensors_by_device_and_dtype: one device here
    for p in params:
        if p.grad is not None:
            seen.setdefault(p.grad.dtype, []).append(p.grad)
    groups = dict(reversed(seen.items()))  # the map's order: the last new key first
    norms = [norm for grads in groups.values() for norm in foreach_norm(g, grads)]
    dtype = "fp32" if len(groups) > 1 else next(iter(groups))  # torch.stack promotes mixed dtypes
    stacked = made(g, (len(norms),), "stack", *norms, dtype=dtype)
    total = made(g, (), "linalg_vector_norm", stacked, dtype=dtype)
    del stacked, norms  # the stack at once, the norms as _get_total_norm returns
    shifted = made(g, (), "add", total, dtype=dtype)  # total_norm + 1e-6
    reciprocal = made(g, (), "reciprocal", shifted, dtype=dtype)
    clip_coef = made(g, (), "mul", reciprocal, dtype=dtype)  # max_norm / (...)
    del reciprocal, shifted
    clamped = made(g, (), "clamp", clip_coef, dtype=dtype)
    for grads in groups.values():
        g.kernel("_foreach_mul_", tuple(grads) + (clamped,), tuple(grads))
    del clip_coef, clamped
    return total


def foreach_norm(g: Graph, grads: list[Tensor]) -> list[Tensor]:
    """torch._foreach_norm(grads, 2.0): its fp32 partial sums (ntensors x the largest tensor's chunks, zeroed) while
    it runs, and one 0-d norm per tensor in their dtype."""
    chunks = max(-(-t.numel // CHUNK) for t in grads)
    partial = made(g, (len(grads) * chunks,), "zeros", dtype="fp32")
    norms = [g.empty((), t.dtype, "_foreach_norm") for t in grads]
    g.kernel("_foreach_norm", tuple(grads), tuple(norms) + (partial,))
    del partial
    return norms
