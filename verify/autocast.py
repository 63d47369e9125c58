"""The stock PyTorch loop: fp32 weights trained under torch.autocast, measured on real CPU tensors.

    with torch.autocast(device_type, dtype=torch.bfloat16):   # or float16
        loss = model(idx, targets)
    scaler.scale(loss).backward()                             # fp16 (torch.amp.GradScaler); bf16: loss.backward()
    scaler.step(optimizer)
    scaler.update()

Autocast does nothing on the meta device: its dispatch keys (AutocastCPU, AutocastCUDA) are per
device. So this loop is measured on CPU tensors at reduced size, with LiveBytes watching CPU storages
(tests/test_tracker.py proves its figures are the CPU allocator's), and memcalc.exact is held against
it with CPU's autocast lists (Config(device="cpu")). The CUDA prediction differs from the CPU run
only where the lists and kernels differ: tests/test_stack_autocast.py names and tests each difference.

On CPU, SDPA's flash backend is aten._scaled_dot_product_flash_attention_for_cpu (cpu_kernels): it
takes no dropout and saves no RNG state; aten._scaled_dot_product_flash_attention has no CPU kernel.

The optimizer is verify/recipes.py's per-tensor AdamW as a torch.optim.Optimizer (ReferenceAdamW),
so that GradScaler drives it as it drives torch.optim's; torch.optim's implementations slot in as the
optimizer argument.
"""

from __future__ import annotations

import torch

from memcalc.model.shape import ModelShape
from memcalc.model.stacks import Stack, stack_for
from memcalc.model.tricks import Tricks

from .builder import Kernels, build, materialise
from .meta import StepBytes, measure_step, meta_kernels
from .recipes import DTYPES, AdamW, adamw_, bitsandbytes, library_optimizer
from .track import LiveBytes


REFERENCE_STEP = stack_for("torch", impl="reference")  # the stock loop with the reference AdamW step


class ReferenceAdamW(torch.optim.Optimizer):
    """recipes.Recipe's update on fp32 parameters (no master copy): per tensor, the gradient taken off
    .grad, AdamW with one temporary, the gradient released; m and v made at the first step."""

    def __init__(self, params, hp: AdamW = AdamW()):
        super().__init__(params, {})
        self.hp = hp
        self.steps = 0
        self.m: list[torch.Tensor | None] = [None] * len(self.tensors())
        self.v: list[torch.Tensor | None] = [None] * len(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.steps += 1
        for i, p in enumerate(self.tensors()):
            g, p.grad = p.grad, None
            if self.m[i] is None:
                self.m[i], self.v[i] = torch.zeros_like(p), torch.zeros_like(p)
            adamw_(p, g, self.m[i], self.v[i], self.steps, self.hp)
            del g


class AutocastRecipe:
    """The model (fp32), its forward under torch.autocast, GradScaler for fp16, and the optimizer:
    ReferenceAdamW, or the stack's torch.optim / bitsandbytes optimizer (verify/recipes.py
    library_optimizer) over the fp32 parameters, its gradients set to None after each step."""

    def __init__(self, model: torch.nn.Module, precision: str, device_type: str, optimizer=None):
        self.model, self.precision, self.device_type = model, precision, device_type
        self.optimizer = optimizer if optimizer is not None else ReferenceAdamW(model.parameters())
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
        self.skipped = 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model under torch.autocast; Transformers' (verify/hf.py TrainerModel with autocast) runs
        its own, as Accelerate prepared it."""
        if getattr(self.model, "autocast", None) is not None:
            return self.model(idx, targets)
        with torch.autocast(self.device_type, dtype=DTYPES[self.precision]):
            return self.model(idx, targets)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def update(self) -> bool:
        """The optimizer step, then optimizer.zero_grad(set_to_none=True); False when GradScaler
        skipped the step (a gradient was inf or nan)."""
        stepped = True
        if self.scaler is None:
            self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # update() backs the scale off after a skipped step
            self.skipped += not stepped
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything kept between steps besides the parameters: the optimizer's state (m and v;
        torch.optim's step counters; AdamW8bit's absmax and quantile maps), the scale and growth tracker."""
        if isinstance(self.optimizer, ReferenceAdamW):
            out = [t for t in self.optimizer.m + self.optimizer.v if t is not None]
        else:
            out = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        if self.scaler is not None and self.scaler._scale is not None:
            out += [self.scaler._scale, self.scaler._growth_tracker]
        return out


def cpu_kernels(tricks: Tricks) -> Kernels:
    """What runs on CPU: stock SDPA held to its flash backend, and aten.native_dropout (bool mask)."""
    return Kernels(attention="sdpa-flash" if tricks.flash else "eager", dropout="native", recompute=tricks.recompute)


def measure_cpu(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                timeline: bool = False, stack: Stack = REFERENCE_STEP,
                optimizer: str = "adamw") -> tuple[StepBytes, LiveBytes, AutocastRecipe]:  # fmt: skip
    """verify/meta.py's measured step (a warm-up step, then the measured one) of the fp32 model on
    CPU tensors, trained by the stock loop under torch.autocast("cpu", tricks' 16-bit dtype): the
    stack's model (memcalc's reference, or Transformers' as its Trainer runs it: verify/hf.py) and its
    optimizer (stack.impl: reference, loop, foreach, fused; optimizer: adamw, sgd, adam8bit)."""
    return measure_autocast(shape, seq_len, micro_batch, tricks, grad_accum, timeline, stack, optimizer, "cpu")


def measure_autocast(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                     timeline: bool = False, stack: Stack = REFERENCE_STEP, optimizer: str = "adamw",
                     device: str = "cpu") -> tuple[StepBytes, LiveBytes, AutocastRecipe]:  # fmt: skip
    """measure_cpu on a device: cpu, or cuda (a GPU's tensors tracked at the dispatcher as on meta,
    with the kernels meta calls by name: the flash op, aten.native_dropout)."""
    if optimizer == "adam8bit":
        bitsandbytes()  # imported before the tracker watches
    kernels = cpu_kernels(tricks) if device == "cpu" else meta_kernels(tricks)
    torch.manual_seed(0)
    if stack.model == "hf":
        from .hf import build_hf

        model = build_hf(shape, tricks, seq_len, device=device, autocast=device)
    else:
        model = materialise(build(shape, kernels, seq_len, torch.float32), device)
    made = []

    def recipe_for(m, precision):
        params = list(m.parameters())
        opt = None if stack.impl == "reference" else library_optimizer(params, optimizer, stack.impl)
        made.append(AutocastRecipe(m, precision, device, opt))
        return made[0]

    step, live = measure_step(shape, seq_len, micro_batch, tricks, device, kernels, model, grad_accum, timeline,
                              stack=stack, make_recipe=recipe_for)  # fmt: skip
    return step, live, made[0]

