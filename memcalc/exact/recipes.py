"""verify/recipes.py's training recipe in bytes: what the optimizer step keeps, converts and frees."""

from __future__ import annotations

from memcalc.errors import InputError

from . import aten
from .builder import Model, made
from .config import Config
from .hf import HFModel
from .sim import Graph, Tensor

SIMULATED = {"model": ("reference", "hf"), "recipe": ("master",), "impl": ("reference",), "optimizer": ("adamw",)}


def check_simulated(cfg: Config) -> None:
    """What the simulator replays; anything else is refused in one line, never guessed."""
    for what, known in SIMULATED.items():
        value = getattr(cfg, what)
        if value not in known and not (what == "recipe" and cfg.precision == "fp32"):
            raise InputError(f"the exact model does not replay {what} {value!r} yet; it replays "
                             f"{', '.join(known)}")  # fmt: skip


class Recipe:
    """verify/recipes.py's Recipe: fp32 master weights (16-bit recipes), AdamW m and v made at the
    first step, and GradScaler's scale and growth tracker for fp16."""

    def __init__(self, g: Graph, m: Model | HFModel):
        self.g, self.model, self.precision = g, m, m.cfg.precision
        self.params = m.params
        if self.precision == "fp32":
            self.masters = self.params
        else:  # p.detach().float()
            self.masters = [g.empty(p.shape, "fp32", "_to_copy", kind="state") for p in self.params]
        self.m: list[Tensor | None] = [None] * len(self.params)
        self.v: list[Tensor | None] = [None] * len(self.params)
        self.scale = self.growth = None
        if self.precision == "fp16":
            self.scale = g.empty((), "fp32", "full", kind="state")
            self.growth = g.empty((), "int32", "zeros", kind="state")

    def backward(self, loss: Tensor) -> None:
        if self.scale is None:
            self.g.backward(loss)
        else:  # (loss * scale).backward()
            scaled = aten.mul(self.g, loss, self.scale)
            self.g.backward(scaled)
            del scaled

    def update(self) -> None:
        """Per parameter tensor: its grad to fp32 (the 16-bit grad released), AdamW (one temporary,
        the denominator), the fp32 grad released, the master copied back in place. Each kernel is
        recorded against the parameter's layer (recipes.adamw_ line by line)."""
        g = self.g
        g.stage = "optimizer"
        found_inf = inv_scale = None
        if self.scale is not None:
            found_inf = made(g, (), "zeros")
            inv_scale = made(g, (), "reciprocal", self.scale)
            one = made(g, (), "ones")
            self.check_finite(found_inf)
            g.kernel("_amp_update_scale_", (self.scale, self.growth, found_inf), (self.scale, self.growth))
            del one
        for i, (p, w) in enumerate(zip(self.params, self.masters)):
            g.layer = layer_of(p.name)
            if self.precision == "fp32":
                grad = p.grad
            else:  # p.grad.float()
                grad = g.empty(p.shape, "fp32", "_to_copy")
                g.kernel("_to_copy", (p.grad,), (grad,))
            p.grad = None
            if inv_scale is not None:
                g.kernel("mul_", (grad, inv_scale), (grad,))
            if self.m[i] is None:  # made at the first step only
                self.m[i] = g.empty(w.shape, "fp32", "zeros_like", kind="state")
                self.v[i] = g.empty(w.shape, "fp32", "zeros_like", kind="state")
            m, v = self.m[i], self.v[i]
            g.kernel("mul_", (w,), (w,))  # decoupled weight decay
            g.kernel("lerp_", (m, grad), (m,))
            g.kernel("mul_", (v,), (v,))
            g.kernel("addcmul_", (v, grad), (v,))  # g·g: one operand read once
            denom = g.empty(w.shape, "fp32", "sqrt")  # v.sqrt().div_(...).add_(eps)
            g.kernel("sqrt", (v,), (denom,))
            g.kernel("div_", (denom,), (denom,))
            g.kernel("add_", (denom,), (denom,))
            g.kernel("addcdiv_", (w, m, denom), (w,))
            if w is not p:
                g.kernel("copy_", (w,), (p,))  # the new 16-bit weights
            del denom, grad, m, v
        del found_inf, inv_scale
        g.layer, g.stage = None, "forward"

    def check_finite(self, found_inf: Tensor) -> None:
        """_amp_foreach_non_finite_check_and_unscale_: one foreach kernel over every 16-bit gradient,
        recorded per layer (the grads of one block, then those outside) so that layers scale."""
        layers: dict[int | None, list] = {}
        for p in self.params:
            layers.setdefault(layer_of(p.name), []).append(p.grad)
        for layer, grads in layers.items():
            self.g.layer = layer
            self.g.kernel("_amp_foreach_non_finite_check_and_unscale_", tuple(grads), (found_inf,))
        self.g.layer = None


def layer_of(name: str) -> int | None:
    """The block a parameter belongs to, from its name (blocks.3.attn.wq.weight, and Transformers'
    model.layers.3.self_attn.q_proj.weight and transformer.h.3.attn.c_attn.weight -> 3)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("blocks", "layers", "h") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None
