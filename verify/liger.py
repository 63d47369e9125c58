"""Liger's kernels on the meta device (issue 40): the Trainer's use_liger_kernel=True, measured through liger-kernel's
own autograd Functions.

transformers 5.25 Trainer.train calls integrations/liger.py apply_liger_kernel(model), which patches the model PEFT
wraps with liger-kernel 0.8.5's defaults (apply): RoPE, RMSNorm, SwiGLU, and lce_forward (the head fused with the
cross-entropy). Each Function's Python wrapper allocates its outputs and buffers, then launches Triton kernels that
write into them and allocate nothing: on meta the launches are skipped (meta_paths) and every allocation the wrappers
make is counted as on a GPU. What meta cannot run is answered as CUDA answers it, or left to the replay's device
fields (memcalc.model.savers.Liger):

  .item()                    a meta tensor has no value: the target mask's count is answered 1 (it only scales the
                             loss)
  torch.equal, torch.tensor  the backward's torch.equal(grad_output, torch.tensor(1.0)) runs CUDA's ops (eq, all)
                             and answers False (the loss is / num_items_in_batch); the 1.0 is made visible on meta
                             (MetaTorch)
  _can_use_mm_out            CUDA's answer: the logits chunk made once and reused (Liger.mm_out True)
  RMSNorm's SM count         1 off CUDA: the replay is held to it with Liger.sms = 1
  the head's gradient        CUDA's in-place addmm needs a CUDA device: meta runs the product and its fp32 copy
                             (Liger.addmm False)

An autocast stack is measured the same way on CPU tensors. apply_liger_kernel also replaces the modeling modules'
RMSNorm and MLP classes and their apply_rotary_pos_emb for the whole process; apply puts them back and held sets
them again only while the step is measured, so that models built later are Transformers' own.
"""

from __future__ import annotations

import contextlib

import torch

from memcalc.errors import InputError
from memcalc.exact.hf.liger import ARCHS
from memcalc.model.savers import ON_META as MEASURED  # what liger-kernel's wrappers run on meta, meta_paths held
from memcalc.model.savers import Liger


def liger_kernel():
    try:
        import liger_kernel.transformers  # noqa: F401
        from transformers.integrations.liger import apply_liger_kernel
    except ImportError as e:  # liger-kernel needs triton: Linux x86-64 and aarch64 wheels
        raise InputError(f"--liger on verify needs liger-kernel (pip install -e '.[test]'): {e}") from None
    return apply_liger_kernel


# What apply_liger_kernel_to_<model_type> set on Transformers' modeling modules beside the model it patched:
# (module, name) -> Liger's value. Restored at once (later models build with Transformers' own classes), set again
# only while a step is measured (held): RoPE is a module global LlamaAttention.forward looks up at each call.
PATCHED: dict[tuple, object] = {}
ABSENT = object()  # a name the module did not have before


def apply(model: torch.nn.Module, config: dict | None = None) -> None:
    """Trainer.train's apply_liger_kernel(self.model, self.args.liger_kernel_config): None, liger's defaults (TRL from
    1.15: {"fused_linear_cross_entropy": False}, its own fused LM head in place of Liger's). It also
    replaces the modeling module's RMSNorm and MLP classes and its apply_rotary_pos_emb, for the process: those are
    put back (PATCHED keeps Liger's). Then RoPE's implementations looked up (liger_kernel/backends/registry.py imports
    them at the first dispatch and logs each that fails with its exception, whose traceback would hold the step's
    frames, and their tensors, wherever the log records are kept) before anything is measured."""
    import importlib

    modules = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in ARCHS]
    before = {m: dict(vars(m)) for m in modules}
    liger_kernel()(model, config)
    PATCHED.clear()
    for m in modules:
        for name, value in list(vars(m).items()):
            if before[m].get(name, ABSENT) is not value:
                PATCHED[(m, name)] = value
                restore(m, name, before[m].get(name, ABSENT))
    from liger_kernel.backends import available_impls

    available_impls("rope")


@contextlib.contextmanager
def module_globals():
    """While active: the modeling modules' names as apply_liger_kernel left them (PATCHED)."""
    saved = {key: getattr(*key, ABSENT) for key in PATCHED}
    for (module, name), value in PATCHED.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            restore(module, name, value)


def restore(module, name: str, value) -> None:
    """module.name back to value, or gone where it was ABSENT."""
    if value is ABSENT:
        delattr(module, name)
    else:
        setattr(module, name, value)


@contextlib.contextmanager
def held(liger: Liger, device: str):
    """meta_paths, for a stack whose Liger record is what meta and CPU tensors run (MEASURED): its kernels are
    Triton's, for a GPU, so on CPU tensors (an autocast stack's measure) they are skipped as on meta."""
    if device not in ("meta", "cpu"):
        raise InputError("--liger is measured on meta (CPU tensors under autocast): liger-kernel's Triton kernels "
                         "are skipped, their wrappers' allocations counted")  # fmt: skip
    if liger != MEASURED:
        raise InputError(f"on meta liger-kernel runs {MEASURED}, not {liger}: the replay is held to what meta runs")
    with meta_paths(), module_globals():
        yield


@contextlib.contextmanager
def meta_paths():
    """While active: Triton launches skipped (the kernels write into what their wrappers allocated), a meta tensor's
    .item() 1, the fused cross-entropy's torch as MetaTorch, and its mm-into-buffer path as on CUDA (for CPU
    tensors too, CPU autocast standing for CUDA's)."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.jit as jit
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    saved = (jit.JITFunction.run, autotuner.Autotuner.run, autotuner.Heuristics.run, torch.Tensor.item,
             flce._can_use_mm_out, flce.torch)  # fmt: skip
    item, can_use = saved[3], saved[4]
    jit.JITFunction.run = autotuner.Autotuner.run = autotuner.Heuristics.run = lambda self, *args, **kwargs: None
    torch.Tensor.item = lambda self: 1 if self.device.type == "meta" else item(self)
    flce._can_use_mm_out = lambda x, w: cuda_can_use_mm_out(x, w) if x.device.type in ("meta", "cpu") else \
        can_use(x, w)  # fmt: skip
    flce.torch = MetaTorch()
    try:
        yield
    finally:
        (jit.JITFunction.run, autotuner.Autotuner.run, autotuner.Heuristics.run, torch.Tensor.item,
         flce._can_use_mm_out, flce.torch) = saved  # fmt: skip


class MetaTorch:
    """torch as fused_linear_cross_entropy.py sees it on meta: its backward's torch.equal(grad_output,
    torch.tensor(1.0, device=grad_output.device)) as CUDA runs it. torch.tensor's meta storage is made where the
    tracker does not see it: lift_fresh, the op that hands it over on CPU and CUDA, is called so that it does. Off
    meta, torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, device=None, **kwargs):
        made = torch.tensor(data, *args, device=device, **kwargs)
        return torch.ops.aten.lift_fresh(made) if made.device.type == "meta" else made

    @staticmethod
    def equal(a, b):
        """aten/src/ATen/native/cuda/Equal.cpp cuda_equal: at::eq(self, src).all().item(), False on meta (the loss
        is / num_items_in_batch: its gradient is not 1)."""
        if a.device.type != "meta":
            return torch.equal(a, b)
        torch.eq(a, b).all()
        return False


def cuda_can_use_mm_out(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fused_linear_cross_entropy.py _can_use_mm_out on a CUDA device (not ROCm): grad off (inside the Function's
    forward), one floating dtype, and under autocast its dtype."""
    if torch.is_grad_enabled() or x.dtype != w.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    device = x.device.type if x.device.type == "cpu" else "cuda"  # CPU tensors stand for CUDA's under CPU autocast
    return not torch.is_autocast_enabled(device) or x.dtype == torch.get_autocast_dtype(device)
