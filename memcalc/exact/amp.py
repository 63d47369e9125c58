"""verify/autocast.py's training loop in bytes: torch.autocast over fp32 weights, torch.amp.GradScaler
for fp16, and the optimizer step on the fp32 weights themselves (no master copy).

    with torch.autocast(device, dtype):       # memcalc.exact.builder.forward, memcalc.exact.autocast
        loss = model(idx, targets)
    scaler.scale(loss).backward()             # fp16; bf16 calls loss.backward()
    scaler.step(optimizer)                    # unscale_, then optimizer.step() unless a grad is inf/nan
    scaler.update()

The optimizer step is verify/recipes.py's per-tensor AdamW (memcalc.exact.recipes.adamw) on the fp32
parameters: each gradient, fp32 already, is released as its tensor is updated. AutocastRecipe.
optimizer_step is the one place that picks it: torch.optim's implementations slot in there.
"""

from __future__ import annotations

from .aten import mul
from .builder import Model
from .recipes import adamw
from .sim import Graph, Tensor, layer_of


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

    def unscale_(self, params: list[Tensor]) -> None:
        """inv_scale = scale.double().reciprocal().float(); found_inf = full(0.0); _unscale_grads_
        copies both for the device (_MultiDeviceReplicator.get: .to(device, copy=True)), then one
        _amp_foreach_non_finite_check_and_unscale_ over the grads of one device and dtype (all fp32
        here; recorded per layer so that layers scale). The found_inf copy outlives unscale_."""
        double = self.made((), "fp64", "_to_copy", self.scale_t)
        reciprocal = self.made((), "fp64", "reciprocal", double)
        del double
        inv_scale = self.made((), "fp32", "_to_copy", reciprocal)
        del reciprocal
        found_inf = self.made((), "fp32", "full")
        found_copy = self.made((), "fp32", "_to_copy", found_inf)  # get(device): found_inf first
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
        del inv_copy, inv_scale, found_inf  # _unscale_grads_ and unscale_ return
        self.found_inf = found_copy

    def update(self) -> None:
        """_amp_update_scale_ in place; _per_optimizer_states reset: the found_inf copy goes."""
        self.g.kernel("_amp_update_scale_", (self.scale_t, self.growth, self.found_inf), (self.scale_t, self.growth))
        self.found_inf = None

    def made(self, shape, dtype: str, op: str, *inputs: Tensor, kind: str = "activation") -> Tensor:
        t = self.g.empty(shape, dtype, op, kind=kind)
        self.g.kernel(op, inputs, (t,))
        return t


class AutocastRecipe:
    """The autocast recipe's step: fp32 parameters are what AdamW updates; m and v (fp32) made at
    the first step; GradScaler for fp16."""

    def __init__(self, g: Graph, m: Model):
        self.g, self.model, self.precision = g, m, m.cfg.precision
        self.params = m.params
        self.m: list[Tensor | None] = [None] * len(self.params)
        self.v: list[Tensor | None] = [None] * len(self.params)
        self.scaler = GradScaler(g) if self.precision == "fp16" else None

    def backward(self, loss: Tensor) -> None:
        if self.scaler is None:
            self.g.backward(loss)
        else:  # scaler.scale(loss).backward()
            scaled = self.scaler.scale(loss)
            self.g.backward(scaled)
            del scaled

    def update(self) -> None:
        """scaler.step(optimizer) (unscale_, then the step: measured steps never find an inf), then
        scaler.update(); without a scaler, optimizer.step()."""
        g = self.g
        g.stage = "optimizer"
        if self.scaler is not None:
            self.scaler.unscale_(self.params)
        self.optimizer_step()
        if self.scaler is not None:
            self.scaler.update()
        g.layer, g.stage = None, "forward"

    def optimizer_step(self) -> None:
        """verify/autocast.py ReferenceAdamW.step: per parameter tensor, its fp32 gradient taken off
        .grad, AdamW (one temporary), the gradient released."""
        g = self.g
        for i, p in enumerate(self.params):
            g.layer = layer_of(p.name)
            grad, p.grad = p.grad, None
            if self.m[i] is None:  # made at the first step only
                self.m[i] = g.empty(p.shape, "fp32", "zeros_like", kind="state")
                self.v[i] = g.empty(p.shape, "fp32", "zeros_like", kind="state")
            adamw(g, p, grad, self.m[i], self.v[i])
            del grad
