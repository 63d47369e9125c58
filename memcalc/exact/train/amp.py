"""verify/autocast.py's training loop in bytes: torch.autocast over fp32 weights, torch.amp.GradScaler
for fp16, and the optimizer step on the fp32 weights themselves (no master copy).

    with torch.autocast(device, dtype):       # memcalc.exact.builder.model.forward, memcalc.exact.hf.model.forward
        loss = model(idx, targets)
    scaler.scale(loss).backward()             # fp16; bf16 calls loss.backward()
    scaler.step(optimizer)                    # unscale_, then optimizer.step() unless a grad is inf/nan
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

The optimizer is the stack's (cfg.impl): verify/autocast.py's ReferenceAdamW (per tensor, one
temporary: memcalc.exact.train.recipes.adamw), or the libraries' as memcalc.exact.train.optimizers replays them
(torch.optim's AdamW loop, foreach or fused, SGD, bitsandbytes' AdamW8bit), over fp32 parameters: their
state is fp32 (zeros_like(param)). Fused AdamW takes GradScaler's own path (GradScaler.step: no unscale_,
the fused kernel unscales and skips by itself).
"""

from __future__ import annotations

from ..aten import mul
from ..builder.model import Transformer
from ..sim.graph import Graph, layer_of
from ..sim.tensors import Tensor
from .clip import clip_grad_norm
from .optimizers import SGD, AdamW, AdamW8bit, library_optimizer
from .recipes import adamw


class GradScaler:
    """torch/amp/grad_scaler.py GradScaler on one device, in bytes: its scale (fp32) and growth
    tracker (int32), made by the first scale(); unscale_'s scalars; the found_inf kept until update()."""

    def __init__(self, g: Graph):
        self.g = g
        self.scale_t: Tensor | None = None
        self.growth: Tensor | None = None
        self.found_inf: Tensor | None = None  # _per_optimizer_states[...]["found_inf_per_device"]

    def scale(self, loss: Tensor) -> Tensor:
        """outputs * self._scale (a new fp32 scalar), after _lazy_init_scale_growth_tracker."""
        if self.scale_t is None:
            self.scale_t = self.made((), "fp32", "full", kind="state")
            self.growth = self.made((), "int32", "full", kind="state")
        return mul(self.g, loss, self.scale_t)

    def step(self, optimizer: ReferenceAdamW | AdamW | SGD | AdamW8bit, params: list[Tensor],
             unscaled: bool = False) -> None:  # fmt: skip
        """GradScaler.step: an optimizer with _step_supports_amp_scaling (fused AdamW) is handed the
        scale and found_inf: _check_inf_per_device, then found_inf = sum([found_inf.to(device)])
        (0 + it: a new scalar) and optimizer.grad_scale = scale * 1 (a new scalar), both deleted after
        optimizer.step(); any other is unscale_'d, then stepped (_maybe_opt_step: measured steps find
        no inf). unscaled: unscale_ ran already (the Trainer's clipping, memcalc.exact.train.clip): no check,
        grad_scale None, and nothing unscaled again."""
        if not getattr(optimizer, "supports_amp_scaling", False):
            if not unscaled:
                self.unscale_(params)
            optimizer.step()
            return
        if not unscaled:
            self.check_inf_per_device(params)
        found_inf = self.made((), "fp32", "add", self.found_inf)
        grad_scale = None if unscaled else self.made((), "fp32", "mul", self.scale_t)
        optimizer.step(grad_scale, found_inf)
        del grad_scale, found_inf  # del optimizer.grad_scale, optimizer.found_inf

    def unscale_(self, params: list[Tensor]) -> None:
        """inv_scale = scale.double().reciprocal().float(); found_inf = full(0.0); _unscale_grads_.
        The found_inf copy outlives unscale_."""
        double = self.made((), "fp64", "_to_copy", self.scale_t)
        reciprocal = self.made((), "fp64", "reciprocal", double)
        del double
        inv_scale = self.made((), "fp32", "_to_copy", reciprocal)
        del reciprocal
        found_inf = self.made((), "fp32", "full")
        self.unscale_grads_(params, inv_scale, found_inf)
        del inv_scale, found_inf  # unscale_ returns

    def check_inf_per_device(self, params: list[Tensor]) -> None:
        """_check_inf_per_device: dummy_inv_scale = full(1.0), found_inf = full(0.0), then
        _unscale_grads_ with them (allow_fp16): the grads checked, multiplied by 1."""
        dummy_inv_scale = self.made((), "fp32", "full")
        found_inf = self.made((), "fp32", "full")
        self.unscale_grads_(params, dummy_inv_scale, found_inf)
        del dummy_inv_scale, found_inf

    def unscale_grads_(self, params: list[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
        """_unscale_grads_: found_inf and inv_scale copied for the device (_MultiDeviceReplicator.get:
        .to(device, copy=True), found_inf's first), then one _amp_foreach_non_finite_check_and_unscale_
        over the grads of one device and dtype (all fp32 here; recorded per layer so that layers scale).
        The inv_scale copy dies when it returns; the found_inf copy is kept until update()."""
        found_copy = self.made((), "fp32", "_to_copy", found_inf)
        inv_copy = self.made((), "fp32", "_to_copy", inv_scale)
        layers: dict[int | None, list] = {}
        for p in params:
            if p.grad is not None:
                layers.setdefault(layer_of(p.name), []).append(p.grad)
        for layer, grads in layers.items():
            self.g.layer = layer
            self.g.kernel("_amp_foreach_non_finite_check_and_unscale_", tuple(grads) + (found_copy, inv_copy),
                          tuple(grads) + (found_copy,))  # fmt: skip
        self.g.layer = None
        del inv_copy
        self.found_inf = found_copy

    def update(self) -> None:
        """_amp_update_scale_ in place; _per_optimizer_states reset: the found_inf copy goes."""
        self.g.kernel("_amp_update_scale_", (self.scale_t, self.growth, self.found_inf), (self.scale_t, self.growth))
        self.found_inf = None

    def made(self, shape, dtype: str, op: str, *inputs: Tensor, kind: str = "activation") -> Tensor:
        t = self.g.empty(shape, dtype, op, kind=kind)
        self.g.kernel(op, inputs, (t,))
        return t


class ReferenceAdamW:
    """verify/autocast.py ReferenceAdamW.step: per parameter tensor, its fp32 gradient taken off .grad,
    AdamW (one temporary), the gradient released; m and v (fp32) made at the first step."""

    def __init__(self, g: Graph, params: list[Tensor]):
        self.g, self.params = g, params
        self.m: list[Tensor | None] = [None] * len(params)
        self.v: list[Tensor | None] = [None] * len(params)

    def step(self) -> None:
        g = self.g
        for i, p in enumerate(self.params):
            g.layer = layer_of(p.name)
            grad, p.grad = p.grad, None
            if self.m[i] is None:  # made at the first step only
                self.m[i] = g.empty(p.shape, "fp32", "zeros_like", kind="state")
                self.v[i] = g.empty(p.shape, "fp32", "zeros_like", kind="state")
            adamw(g, p, grad, self.m[i], self.v[i])
            del grad
        g.layer = None


class AutocastRecipe:
    """The autocast recipe's step: the fp32 parameters updated by the stack's optimizer, GradScaler for
    fp16, every gradient set to None after the step."""

    def __init__(self, g: Graph, m: Transformer, clip: bool = False):
        cfg = m.cfg
        self.g, self.model, self.precision = g, m, cfg.precision
        self.params = m.params
        self.optimizer: ReferenceAdamW | AdamW | SGD | AdamW8bit = (
            ReferenceAdamW(g, m.params) if cfg.impl == "reference"
            else library_optimizer(g, m.params, cfg.optimizer, cfg.impl, cfg.device))  # fmt: skip
        self.scaler = GradScaler(g) if self.precision == "fp16" else None
        self.clip = clip  # the Trainer's clipping (memcalc.exact.train.clip)
        self.grad_norm: Tensor | None = None  # the Trainer loop's grad_norm: the last step's total norm

    def backward(self, loss: Tensor) -> None:
        if self.scaler is None:
            self.g.backward(loss)
        else:  # scaler.scale(loss).backward()
            scaled = self.scaler.scale(loss)
            self.g.backward(scaled)
            del scaled

    def update(self) -> None:
        """The Trainer's clipping where it clips (under fp16 after scaler.unscale_), then scaler.step(optimizer),
        scaler.update() (without a scaler, optimizer.step()), then optimizer.zero_grad(set_to_none=True): every
        gradient set to None, in parameter order (ReferenceAdamW has released them already)."""
        g = self.g
        g.stage = "optimizer"
        if self.clip:
            self.grad_norm = None  # the loop's grad_norm = None, then the clipping's total norm
            if self.scaler is not None:  # accelerate's clip_grad_norm_: unscale_gradients() first
                self.scaler.unscale_(self.params)
            self.grad_norm = clip_grad_norm(g, self.params)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer, self.params, unscaled=self.clip)
            self.scaler.update()
        for p in self.params:  # torch/optim/optimizer.py Optimizer.zero_grad(set_to_none=True)
            p.grad = None
        g.layer, g.stage = None, "forward"
