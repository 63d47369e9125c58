"""Training recipes: what one optimizer step keeps, converts and frees, per precision.

fp32  fp32 weights and grads; AdamW state in fp32.
bf16  bf16 weights and grads (all compute in bf16, fp32 accumulation inside the matmuls); fp32
      master weights and AdamW state (Micikevicius et al. 2018). Each grad is converted to fp32
      and released one tensor at a time, never all at once, then the master is copied back.
fp16  as bf16, with dynamic loss scaling as torch.amp.GradScaler does it (scale 2^16, growth x2
      every 2000 clean steps, backoff x0.5 on inf/nan), a step skipped when any grad is not finite.

AdamW is written out per tensor (adamw_) so its temporaries are known and do not change between
PyTorch versions: one, the denominator. m and v are made at the first step, as torch.optim does.

TorchRecipe trains with the libraries' own optimizers instead (the stack's --optimizer-impl: loop,
foreach or fused; --optimizer sgd or adam8bit): torch.optim.AdamW and SGD as shipped, bitsandbytes'
AdamW8bit, over the model's own parameters: fp32, or 16-bit with no master (--recipe pure).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.optim.optimizer as optimizer_module

from memcalc.errors import InputError
from memcalc.exact.base.config import untrainable
from memcalc.model.stacks import DEFAULT_STACK, Stack

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class AdamW:
    """Loshchilov & Hutter 2019; the values are GPT-3's (Brown et al. 2020, App. B) at a small lr."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@torch.no_grad()
def adamw_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, hp: AdamW) -> None:
    """One AdamW update of one fp32 tensor in place; the math of torch.optim.AdamW (foreach=False)."""
    w.mul_(1 - hp.lr * hp.weight_decay)  # decoupled weight decay
    m.lerp_(g, 1 - hp.beta1)  # m = b1·m + (1 - b1)·g
    v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)  # v = b2·v + (1 - b2)·g²
    bias1, bias2 = 1 - hp.beta1**step, 1 - hp.beta2**step
    denom = v.sqrt().div_(math.sqrt(bias2)).add_(hp.eps)  # the one temporary: 4 bytes per element
    w.addcdiv_(m, denom, value=-hp.lr / bias1)


def trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer is given: the parameters that require grad (the Trainer's create_optimizer takes
    those alone: trainer.py get_decay_parameter_names ... if p.requires_grad), every one but frozen weights."""
    return [p for p in model.parameters() if p.requires_grad]


class Recipe:
    """A model and its optimizer state for one precision; step() = forward, backward, update."""

    def __init__(self, model: torch.nn.Module, precision: str, hp: AdamW = AdamW()):
        self.model, self.precision, self.hp = model, precision, hp
        self.params = trained(model)
        device = self.params[0].device
        with torch.no_grad():  # fp32 master weights for the 16-bit recipes, made once
            self.masters = self.params if precision == "fp32" else [p.detach().float() for p in self.params]
        self.m: list[torch.Tensor | None] = [None] * len(self.params)
        self.v: list[torch.Tensor | None] = [None] * len(self.params)
        self.steps = 0
        self.skipped = 0
        self.scale = self.growth = None
        if precision == "fp16":  # GradScaler's two device tensors: fp32 scale, int32 growth tracker
            self.scale = torch.full((), 2.0**16, dtype=torch.float32, device=device)
            self.growth = torch.zeros((), dtype=torch.int32, device=device)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale if self.scale is not None else loss).backward()

    @torch.no_grad()
    def update(self) -> bool:
        """The optimizer step, one parameter tensor at a time; grads are released as they are used.
        False when fp16's loss scaler skipped it (a gradient was inf or nan)."""
        inv_scale = found_inf = None
        if self.scale is not None:
            found_inf, inv_scale = self.check_finite()
            torch._amp_update_scale_(self.scale, self.growth, found_inf, 2.0, 0.5, 2000)  # GradScaler.update
            if found_inf.device.type != "meta" and found_inf.item():  # meta has no values: never skipped
                self.skipped += 1
                for p in self.params:
                    p.grad = None
                return False
        self.steps += 1
        for i, (p, w) in enumerate(zip(self.params, self.masters)):
            g = p.grad if self.precision == "fp32" else p.grad.float()  # (n,) fp32, this tensor only
            p.grad = None
            if inv_scale is not None:
                g.mul_(inv_scale)
            if self.m[i] is None:
                self.m[i], self.v[i] = torch.zeros_like(w), torch.zeros_like(w)
            adamw_(w, g, self.m[i], self.v[i], self.steps, self.hp)
            del g
            if w is not p:
                p.copy_(w)  # the new 16-bit weights
        return True

    def check_finite(self) -> tuple[torch.Tensor, torch.Tensor]:
        """GradScaler's check: found_inf set if any 16-bit grad has an inf or nan (nothing unscaled here)."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        inv_scale = self.scale.reciprocal()
        one = torch.ones((), dtype=torch.float32, device=self.scale.device)
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
        return found_inf, inv_scale

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything the recipe keeps between steps, besides the model's own parameters."""
        extra = [] if self.masters is self.params else list(self.masters)
        extra += [t for t in self.m + self.v if t is not None]
        extra += [t for t in (self.scale, self.growth) if t is not None]
        return extra


# -- the libraries' own optimizers -----------------------------------------------------------------


@dataclass(frozen=True)
class SGD:
    """SGD with heavy-ball momentum (Polyak 1964); torch.optim.SGD's defaults otherwise: no dampening,
    no weight decay, no Nesterov."""

    lr: float = 1e-4
    momentum: float = 0.9


IMPLS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}  # torch.optim's switches


@contextlib.contextmanager
def fused_on_meta(on_meta: bool):
    """torch.optim refuses fused=True on a device not in torch/utils/_foreach_utils.py
    _get_fused_kernels_supported_devices (mps, cuda, xpu, hpu, cpu, mtia, ...; asked by
    torch/optim/optimizer.py _device_dtype_check_for_fused). meta has _fused_adamw_'s meta kernel
    (torch/_meta_registrations.py meta__fused_adam_), so while the step runs meta is added to the list
    torch.optim.optimizer imported: the one place verify patches torch."""
    if not on_meta:
        yield
        return
    listed = optimizer_module._get_fused_kernels_supported_devices
    optimizer_module._get_fused_kernels_supported_devices = lambda: [*listed(), "meta"]
    try:
        yield
    finally:
        optimizer_module._get_fused_kernels_supported_devices = listed


def library_optimizer(params: list[torch.Tensor], optimizer: str, impl: str, adamw: AdamW = AdamW(),
                      sgd: SGD = SGD()) -> torch.optim.Optimizer:  # fmt: skip
    """The optimizer as its library ships it: torch.optim.AdamW or SGD with foreach=False (loop),
    foreach=True or fused=True; bitsandbytes' AdamW8bit (its own per-tensor step, whatever the impl)."""
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=adamw.lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.eps,
                                 weight_decay=adamw.weight_decay, **IMPLS[impl])  # fmt: skip
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=sgd.lr, momentum=sgd.momentum, **IMPLS[impl])
    bnb_names = {"adam8bit": "AdamW8bit", "paged-adam8bit": "PagedAdamW8bit", "paged-adamw": "PagedAdamW"}
    if optimizer in bnb_names:  # paged: on CPU tensors get_state_buffer falls back to zeros_like
        chosen = getattr(bitsandbytes().optim, bnb_names[optimizer])
        return chosen(params, lr=adamw.lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.eps,
                      weight_decay=adamw.weight_decay)
    raise InputError(f"unknown optimizer {optimizer!r}; known: adamw, sgd, {', '.join(bnb_names)}")


def bitsandbytes():
    """The installed bitsandbytes, or a one-line error: it is the optional extra memcalc[bnb]. Import it
    before a step is tracked on CPU tensors: its module makes CPU tensors (backends/utils.py
    _NF4_QUANT_TABLE, _FP4_QUANT_TABLE) that are no part of any step."""
    # its CPU backend warns, on import, that a 4-bit matmul kernel could not be downloaded: not ours
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise InputError("--optimizer adam8bit trains with bitsandbytes' AdamW8bit: pip install 'memcalc[bnb]'") from e
    return bnb


class TorchRecipe:
    """Training as a stock PyTorch loop does: the model's own parameters are what the optimizer updates
    (fp32, or 16-bit in the pure recipe: no master, and torch.optim's zeros_like(param) state is 16-bit),
    loss.backward(), (clip: the Trainer's clipping, trainer_clip), optimizer.step(), optimizer.zero_grad() (grads
    set to None). Pure fp16 has no loss
    scaling: torch.amp.GradScaler.unscale_ refuses fp16 gradients ("Attempting to unscale FP16
    gradients.", torch/amp/grad_scaler.py _unscale_grads_)."""

    def __init__(self, model: torch.nn.Module, precision: str, optimizer: str = "adamw", impl: str = "foreach",
                 clip: bool = False):  # fmt: skip
        self.model, self.precision = model, precision
        self.params = trained(model)
        self.optimizer = library_optimizer(self.params, optimizer, impl)
        self.on_meta = impl == "fused" and self.params[0].device.type == "meta"
        self.skipped = 0  # no loss scaler: no step is ever skipped
        self.clip = clip  # the Trainer's clipping (trainer_clip)
        self.grad_norm = None  # the Trainer loop's grad_norm: the last step's total norm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def update(self) -> bool:
        if self.clip:
            self.grad_norm = None  # the loop's grad_norm = None, then the clipping's total norm
            self.grad_norm = trainer_clip(self.model)
        with fused_on_meta(self.on_meta):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state on the parameters' device (torch.optim keeps loop and foreach's step
        counters on the CPU: torch/optim/adam.py, _init_group)."""
        device = self.params[0].device
        return [t for s in self.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.device == device]  # fmt: skip


def trainer_clip(model: torch.nn.Module) -> torch.Tensor:
    """transformers 5.25 Trainer._clip_grad_norm with TrainingArguments' max_grad_norm 1.0: accelerate's
    clip_grad_norm_ (its unscale_gradients first where GradScaler scales: the caller's), then torch's
    clip_grad_norm_(model.parameters(), 1.0), as on CUDA (cuda_norms). The total norm is the loop's grad_norm."""
    with cuda_norms():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@contextlib.contextmanager
def cuda_norms():
    """While active, clip_grad_norm_ on meta or CPU tensors as on CUDA: the foreach path (meta has no foreach
    kernels: it would take each norm alone, the same 0-d results), and torch._foreach_norm's fp32 partial sums,
    which CUDA's kernel keeps while it runs (aten/src/ATen/native/cuda/ForeachReduceOp.cu: zeros of ntensors x the
    largest tensor's chunks of 65536), made before its results and dropped after, where the tracker sees them."""
    from torch.nn.utils import clip_grad

    saved = (torch._foreach_norm, clip_grad._has_foreach_support)
    foreach_norm = saved[0]

    def norm(tensors, ord=2, dtype=None):
        chunks = max(-(-t.numel() // 65536) for t in tensors)
        partial = torch.zeros(len(tensors) * chunks, dtype=torch.float32, device=tensors[0].device)  # noqa: F841
        return foreach_norm(tensors, ord) if dtype is None else foreach_norm(tensors, ord, dtype)

    torch._foreach_norm = norm
    clip_grad._has_foreach_support = lambda tensors, device: True
    try:
        yield
    finally:
        torch._foreach_norm, clip_grad._has_foreach_support = saved


def check_recipe(precision: str, stack: Stack, optimizer: str) -> None:
    """What is trained (memcalc.exact.base.config.untrainable: the same rules the simulator keeps). The
    autocast recipe trains through verify/autocast.py (autocast runs on CPU and CUDA tensors only)."""
    if optimizer not in ("adamw", "sgd", "adam8bit", "paged-adam8bit", "paged-adamw"):
        raise InputError(f"unknown optimizer {optimizer!r}; known: adamw, sgd, adam8bit, paged-adam8bit, paged-adamw")
    reason = untrainable(precision, stack.recipe, stack.impl, optimizer)
    if reason:
        raise InputError(reason)


def recipe_for(model: torch.nn.Module, precision: str, stack: Stack = DEFAULT_STACK,
               optimizer: str = "adamw") -> Recipe | TorchRecipe:  # fmt: skip
    """The stack's recipe: the reference implementation (this file's Recipe, the lesson's loop), or
    the libraries' optimizers (TorchRecipe)."""
    check_recipe(precision, stack, optimizer)
    if stack.model == "torchtune":
        from .torchtune import TorchtuneRecipe

        return TorchtuneRecipe(model, optimizer, stack)
    if precision != "fp32" and stack.recipe == "autocast":
        raise InputError("the autocast recipe trains through verify/autocast.py (AutocastRecipe), not this loop")
    if stack.impl == "reference":
        return Recipe(model, precision)
    return TorchRecipe(model, precision, optimizer, stack.impl, clip=stack.model == "hf")  # the Trainer clips
