"""Liger's kernels in a Transformers model, as the Trainer applies them (use_liger_kernel=True), op by op in bytes on
memcalc.exact.sim.graph.

transformers 5.25 integrations/liger.py apply_liger_kernel calls liger-kernel 0.8.5's
_apply_liger_kernel_to_instance on the model PEFT wraps, with apply_liger_kernel_to_llama's defaults (mistral, qwen2
and qwen3 the same; liger_kernel/transformers/monkey_patch.py): RoPE, RMSNorm (Qwen3's q_norm and k_norm too) and
SwiGLU patched, and the head fused with the cross-entropy (liger_kernel/transformers/model/llama.py lce_forward: no
logits in training). Each is an autograd.Function whose kernels are Triton's: they read and write tensors their
Python wrapper allocated, and allocate none, so the wrappers' allocations (liger_kernel/ops: rms_norm.py, rope.py,
swiglu.py, fused_linear_cross_entropy.py, the nvidia-triton implementations) are all they hold. Three follow the
device (memcalc.model.savers.Liger): RMSNorm's partial weight gradients, the logits chunk's buffer, the head's
gradient.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memcalc.model.savers import Liger
from memcalc.model.stacks import FUSED_HEAD, KBIT_PREPARED

from .. import aten
from ..aten.operands import made
from ..base.config import ITEMSIZE
from ..sim.checkpoint import saved_of
from ..sim.graph import Graph
from ..sim.tensors import Tensor

if TYPE_CHECKING:
    from .family import HFModel

# the model_types whose apply_liger_kernel_to_<model_type> the replay has (monkey_patch.py
# MODEL_TYPE_TO_APPLY_LIGER_FN): RoPE, RMSNorm (Qwen3's q_norm and k_norm), SwiGLU, lce_forward
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
IN_PLACE = {"gemma2": False}  # _patch_rms_norm_module's in_place, True unless the family's patch sets it


def not_replayed(cfg, arch: str) -> str | None:
    """Why the replay cannot run Liger's kernels on this step, or None: a family whose patching it has not built,
    autocast over fp32 weights (the fused cross-entropy then casts the head chunk by chunk: not built), TRL's k-bit
    preparation, LoRA on the head or its trained copy (lce_forward reads lm_head.weight)."""
    if arch == "gemma3_text":
        return ("--liger on Gemma 3: its q_norm and k_norm run on the transposed (B, n, T, d) views, which Liger's "
                "RMSNorm and RoPE copy contiguous first: not replayed")  # fmt: skip
    if arch not in ARCHS:
        return f"--liger: Liger's patching of {arch} is not replayed; it is for {', '.join(ARCHS)}"
    if cfg.recipe == "autocast" and cfg.precision != "fp32" and not cfg.finetune.lora:
        what = ("Liger's RMSNorm then takes fp32 weights beside autocast's 16-bit activations"
                if cfg.stack.trl in FUSED_HEAD else "Liger's fused cross-entropy then casts the head chunk by chunk")
        return ("--liger under autocast over fp32 weights (the Trainer's bf16=True on a model loaded in fp32): "
                f"{what}, which is not replayed; load the model in bf16 (--recipe pure), or train LoRA (its base in 16 "
                "bits)")  # fmt: skip
    ft = cfg.finetune
    if cfg.stack.trl in KBIT_PREPARED and ft.quantize:
        return ("--liger with TRL's k-bit preparation: its fp32 norms hand Liger's fused cross-entropy an fp32 "
                "residual stream beside a bf16 head, which is not replayed (--stack hf: the Trainer "
                "alone)")  # fmt: skip
    if "lm_head" in ft.targets or "lm_head" in ft.modules_to_save:
        return "--liger with LoRA on lm_head or lm_head in --modules-to-save: lce_forward reads lm_head.weight alone"
    return None


def over(storage, shape, dtype: str) -> Tensor:
    """A tensor over a storage a Function saved: its backward writes its gradient there, in place."""
    return Tensor(storage, tuple(shape), dtype, copies=storage.copies)


def liger_norm(m: HFModel):
    """The model's RMSNorm as LigerRMSNorm (Gemma's: LigerRMSNormForGemma, casting_mode "gemma", offset 1; Gemma 2's
    not in place): norm(g, x, weight, scope)."""
    liger, in_place = m.cfg.stack.savers.liger, IN_PLACE.get(m.arch, True)
    return lambda g, x, w, scope: rms_norm(g, liger, x, w, scope, in_place)


def rms_norm(g: Graph, liger: Liger, x: Tensor, w: Tensor, scope: str, in_place: bool = True) -> Tensor:
    """LigerRMSNormFunction (casting_mode "llama" or "gemma": the same tensors): Y = empty(rows, H) and RSTD =
    empty(rows) fp32; saves X (the input itself), W, RSTD. Backward: the weight's partial gradients, one fp32 row per
    SM (_dW), where the weight trains; dX written into dY (in_place), else into zeros_like(dY); dW =
    _dW.sum(0).to(W.dtype)."""
    sx, sw, trains, w_dtype = x.shape, w.shape, w.requires_grad, w.dtype
    rows, x_bytes, w_bytes = math.prod(sx[:-1]), x.nbytes, w.nbytes

    def rule(gs):
        dy = gs[0]
        partial = g.empty((liger.sms, sw[0]), "fp32", "empty") if trains else None
        dx = dy if in_place else made(g, dy.shape, "zeros_like", dtype=dy.dtype)
        g.kernel("rms_norm_backward", (dy, x_bytes, w_bytes), (dx,) + ((partial,) if trains else ()))
        dw = None
        if trains:
            summed = made(g, sw, "sum", partial, dtype="fp32")
            dw = summed if w_dtype == "fp32" else made(g, sw, "_to_copy", summed, dtype=w_dtype)
            del summed
        del partial
        return [over(dx.storage, sx, dx.dtype), dw]

    with g.scoped(scope):
        node = g.begin("LigerRMSNormFunction", [x, w], rule, function=True)
        y = g.empty(sx, x.dtype, "empty")
        rstd = g.empty((rows,), "fp32", "empty")
        g.kernel("rms_norm", (x, w), (y, rstd))
        g.end(node, [y], [(x, "X"), (w, "W"), (rstd, "RSTD")])
        return y


def rope(g: Graph, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, copies: tuple[bool, bool]) -> tuple[Tensor, Tensor]:
    """LigerRopeFunction: q and k transposed back to (B, T, n, d) (laid out so: no copy) and rotated in place; the
    outputs are their transposes, over the projections' storages; saves cos and sin. Backward rotates dq and dk in
    place after dq.transpose(1, 2).contiguous(): a copy where the gradient arrives contiguous in (B, n, T, d)
    (copies: q's, k's)."""
    sq, sk, tables = q.shape, k.shape, cos.nbytes + sin.nbytes

    def rule(gs):
        dq, dk = (made(g, s, "clone", d, dtype=d.dtype) if c else d for d, s, c in zip(gs, (sq, sk), copies))
        g.kernel("rope_backward", (dq, dk, tables), (dq, dk))
        return [g.view(dq, sq), g.view(dk, sk), None, None]

    node = g.begin("LigerRopeFunction", [q, k, cos, sin], rule, function=True)
    g.kernel("rope", (q, k, cos, sin), (q, k))
    q_out, k_out = g.view(q, sq), g.view(k, sk)
    g.end(node, [q_out, k_out], [(cos, "cos"), (sin, "sin")])
    return q_out, k_out


def swiglu(g: Graph, a: Tensor, b: Tensor, name: str = "LigerSiLUMulFunction") -> Tensor:
    """LigerSiLUMulFunction (LigerGELUMulFunction, Gemma's GEGLU: the same tensors): c = empty_like(a); saves a and b.
    Backward writes da into a and db into b, in place, and returns them: no tensor."""
    sa, sb, dtype = a.shape, b.shape, a.dtype

    def rule(gs):
        saved = saved_now()
        da, db = over(saved[0], sa, dtype), over(saved[1], sb, dtype)
        g.kernel("swiglu_backward", (gs[0], da, db), (da, db))
        return [da, db]

    node = g.begin(name, [a, b], rule, function=True)
    saved_now = saved_of(node)
    c = g.empty(sa, dtype, "empty_like")
    g.kernel("swiglu", (a, b), (c,))
    g.end(node, [c], [(a, "a"), (b, "b")])
    return c


def swiglu_mlp(g: Graph, m: HFModel, n: str, x: Tensor, linear) -> Tensor:
    """LigerSwiGLUMLP.forward: down_proj(LigerSiLUMulFunction(gate_proj(x), up_proj(x))) (LigerGEGLUMLP's, Gemma's,
    with LigerGELUMulFunction; linear: the family's, PEFT's LoRA where it wraps the projection)."""
    name = "LigerGELUMulFunction" if m.arch.startswith("gemma") else "LigerSiLUMulFunction"
    # gate and up are the call's temporaries: they go as it returns (a checkpointed layer keeps neither)
    return linear(g, m, n + "down_proj", swiglu(g, linear(g, m, n + "gate_proj", x), linear(g, m, n + "up_proj", x),
                                                name))  # fmt: skip


def causal_lm_loss(g: Graph, m: HFModel, hidden_states: Tensor, head: Tensor, labels: Tensor,
                   num_items_in_batch: Tensor) -> Tensor:  # fmt: skip
    """lce_forward's loss (transformers/model/loss_utils.py LigerForCausalLMLoss): labels padded by one ignore_index
    and shifted (labels[..., 1:].contiguous(): a view for one row, else a copy), hidden_states.view(-1, H), the fused
    linear cross-entropy summed, then / num_items_in_batch. Its padded and shifted labels die as it returns."""
    B, T, H = hidden_states.shape
    with g.scoped("loss"):
        padded = made(g, (B, T + 1), "constant_pad_nd", labels, dtype="int64")
        shift_labels = g.view(padded, (B, T)) if B == 1 else made(g, (B, T), "clone", padded, dtype="int64")
    with g.scoped("logits"):
        flat = aten.view(g, hidden_states, (B * T, H))
        loss = fused_linear_cross_entropy(g, m.cfg.stack.savers.liger, flat, head, m.cfg.device == "cuda")
    with g.scoped("loss"):
        loss = aten.div_tensor(g, loss, num_items_in_batch)
    del padded, shift_labels, flat
    return loss


def fused_linear_cross_entropy(g: Graph, liger: Liger, x: Tensor, w: Tensor, cuda: bool = True) -> Tensor:
    """LigerFusedLinearCrossEntropyFunction (reduction "sum"): the gradients computed in forward and saved, chunk by
    chunk of rows: fused_linear_cross_entropy_forward, then its backward (grad_input scaled in place)."""
    (BT, H), (V, _) = x.shape, w.shape
    trains_head, x_dtype, w_dtype = w.requires_grad, x.dtype, w.dtype

    def rule(gs):
        # torch.equal(grad_output, torch.tensor(1.0, device=...)): the 1.0, then on CUDA at::eq(...).all() (Equal.cpp
        # cuda_equal; CPU's compares in place). False, the loss being / num_items_in_batch: element_mul_kernel scales
        # the saved gradients in place
        one = made(g, (), "lift_fresh", dtype="fp32")
        if cuda:
            same = made(g, (), "eq", dtype="bool")
            every = made(g, (), "all", same, dtype="bool")
            del every, same
        del one
        saved = saved_now()
        saved_input = over(saved[0], (BT, H), x_dtype)
        saved_weight = over(saved[1], (V, H), w_dtype) if trains_head else None
        g.kernel("element_mul", (saved_input, gs[0]), (saved_input,) + ((saved_weight,) if trains_head else ()))
        return [saved_input, saved_weight]

    node = g.begin("LigerFusedLinearCrossEntropyFunction", [x, w], rule, function=True)
    saved_now = saved_of(node)
    loss, grad_input, grad_weight = flce_forward(g, liger, x, w)
    g.end(node, [loss], [(grad_input, "grad_input")] + ([(grad_weight, "grad_weight")] if trains_head else []))
    del grad_input, grad_weight
    return loss


def flce_forward(g: Graph, liger: Liger, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """fused_linear_cross_entropy_forward: grad_input (zeros_like input), grad_weight (zeros_like weight, where it
    trains), loss_1d (BT fp32), the target mask and its count (.item()); then chunks of rows, chunk_size =
    next_power_of_2(cdiv(BT, cdiv(V, H))): the chunk's logits (into one buffer, mm_out, else a new tensor), the
    cross-entropy kernel writing their gradient over them, grad_input's rows (mm into its slice, else a product
    copied there), the head's gradient (addmm in place; else mm, .float(), added); the loss, torch.sum(loss_1d).
    loss_1d and the mask die as it returns."""
    (BT, H), (V, _) = x.shape, w.shape
    dt = x.dtype
    chunk = min(next_power_of_2(cdiv(BT, cdiv(V, H))), BT)
    grad_input = made(g, (BT, H), "zeros_like", dtype=dt)
    grad_weight = made(g, (V, H), "zeros_like", dtype=w.dtype) if w.requires_grad else None
    loss_1d = made(g, (BT,), "zeros", dtype="fp32")
    mask = made(g, (BT,), "ne", BT * 8, dtype="bool")  # target != ignore_index
    counted = made(g, (), "sum", mask, dtype="int64")  # target_mask.sum().item()
    del counted
    buffer = made(g, (chunk, V), "empty", dtype=dt) if liger.mm_out else None
    for start in range(0, BT, chunk):
        n, fl = min(chunk, BT - start), 2 * min(chunk, BT - start) * H * V
        logits = g.view(buffer, (n, V)) if buffer is not None else g.empty((n, V), dt, "mm")  # mm(out=) or a new one
        g.kernel("mm", (n * H * ITEMSIZE[dt], w), (logits,), "tensor", fl, "logits", dtype=dt)
        g.kernel("liger_cross_entropy", (logits,), (logits, n * 4))  # the gradient over the logits, the loss rows
        if buffer is not None:
            g.kernel("mm", (logits, w), (n * H * ITEMSIZE[dt],), "tensor", fl, "logits", dtype=dt)
        else:  # grad_input[start:end] = grad_logits_chunk @ weight
            rows = made(g, (n, H), "mm", logits, w, dtype=dt)
            g.kernel("copy_", (rows,), (n * H * ITEMSIZE[dt],))
            del rows
        if grad_weight is not None:
            head_gradient(g, liger, grad_weight, logits, n, H, fl)
        del logits
    del buffer
    loss = made(g, (), "sum", loss_1d, dtype="fp32")
    del loss_1d, mask
    return loss, grad_input, grad_weight


def head_gradient(g: Graph, liger: Liger, grad_weight: Tensor, logits: Tensor, n: int, H: int, fl: int) -> None:
    """One chunk's share of the head's gradient: addmm into grad_weight (compute capability 8 or more, 16-bit
    logits, grad_weight fp32 or of their dtype), else grad_weight += torch.mm(grad_logits_chunk.t(),
    input_chunk).float(): the product, and its fp32 copy where it is not fp32."""
    V, dt = logits.shape[1], logits.dtype
    if liger.addmm and dt in ("bf16", "fp16") and grad_weight.dtype in ("fp32", dt):
        g.kernel("addmm", (logits, n * H * ITEMSIZE[dt], grad_weight), (grad_weight,), "tensor", fl, "logits", dtype=dt)
        return
    product = g.empty((V, H), dt, "mm")
    g.kernel("mm", (logits, n * H * ITEMSIZE[dt]), (product,), "tensor", fl, "logits", dtype=dt)
    widened = product if dt == "fp32" else made(g, (V, H), "_to_copy", product, dtype="fp32")
    g.kernel("add_", (grad_weight, widened), (grad_weight,))
    del product, widened


def cdiv(a: int, b: int) -> int:
    """triton.cdiv."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 1
