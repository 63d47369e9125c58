"""verify/recipes.py's training recipes in bytes: what the optimizer step keeps, converts and frees.

Recipe       the reference implementation (verify/recipes.py Recipe): fp32 master for 16-bit weights,
             AdamW written out per tensor
TorchRecipe  the libraries' optimizers over the model's own parameters (verify/recipes.py TorchRecipe,
             memcalc.exact.train.optimizers): fp32, or 16-bit weights with no master (the pure recipe)
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.model.stacks import check_tricks, stack_for

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig, not_replayed, shape_not_replayed
from ..builder.model import Transformer
from ..hf.model import HFModel, arch_for, check_finetune
from ..sim.graph import Graph, layer_of, scope_of
from ..sim.tensors import Tensor
from ..torchtune.model import TTModel, finetune_not_replayed
from .clip import clip_grad_norm
from .optimizers import SGD, AdamW, AdamW8bit, library_optimizer
from .torchtune import TorchtuneRecipe


def check_simulated(cfg: StepConfig) -> None:
    """What the simulator replays; anything else is refused in one line, never guessed."""
    reason = not_replayed(cfg.model, cfg.recipe, cfg.impl, cfg.optimizer, cfg.precision) or shape_not_replayed(cfg.shape, cfg.model, cfg.recipe, cfg.impl)
    if reason:
        raise InputError(reason)
    if (cfg.model == "hf" and (cfg.ckpt_every > 1 or cfg.recompute == "op")) or (cfg.flash and cfg.precision == "fp32"):
        check_tricks(stack_for(cfg.model), cfg.tricks)
    if cfg.fp8 and cfg.model != "reference":
        raise InputError(f"{cfg.tricks.fp8_name} is replayed on memcalc's reference model (--stack reference, torch, "
                         "fsdp2), not on Transformers' classes")
    if cfg.fp8 == "te" and (cfg.shape.n_experts or cfg.shape.is_mla):
        raise InputError("fp8:te is replayed on dense blocks (te.Linear for each linear, as llm-foundry's fc_type te "
                         "builds them), not on a mixture of experts or latent attention")
    if cfg.fp8 and cfg.shape.n_experts:
        raise InputError("fp8 with a mixture of experts is not replayed: torchtitan casts grouped experts with "
                         "torchao's MoE training, not Float8Linear")
    if cfg.model == "torchtune":
        reason = finetune_not_replayed(cfg.finetune, cfg.shape)
        if reason:
            raise InputError(reason)
    elif not cfg.finetune.trains_all:
        check_finetune(cfg.finetune, arch_for(cfg.shape) if cfg.model == "hf" else "", cfg.model)
    if cfg.device not in ("cuda", "cpu"):
        raise InputError(f"the exact model does not replay device {cfg.device!r}; it replays cuda, cpu")
    if cfg.device == "cpu" and cfg.flash and cfg.shape.dropout > 0:
        raise InputError("CPU's flash attention kernel has no dropout (_scaled_dot_product_flash_attention_for_cpu)")


def recipe_for(g: Graph, m: Transformer | TTModel, clip: bool = False) -> Recipe | TorchRecipe | TorchtuneRecipe:
    """verify/recipes.py recipe_for: the reference implementation, or the libraries' optimizers; torchtune's
    recipes' loop for its model (verify/torchtune.py). clip: the Trainer's clipping (memcalc.exact.train.clip)."""
    if isinstance(m, TTModel):
        return TorchtuneRecipe(g, m)
    return Recipe(g, m) if m.cfg.impl == "reference" else TorchRecipe(g, m, clip)


def recipe_note(cfg: StepConfig) -> str:
    """What the simulated step trains and its optimizer step are, in a line."""
    ft = cfg.finetune
    if cfg.model == "torchtune":
        return torchtune_note(cfg)
    if ft.lora:  # PEFT's adapters over a base loaded in the trick set's dtype (memcalc.exact.hf.lora)
        base = "an nf4 base (bitsandbytes, double quantisation)" if ft.quantize else f"a {cfg.precision} base"
        cast = " under torch.autocast" if cfg.recipe == "autocast" and cfg.precision != "fp32" else ""
        optimizer = optimizer_note(cfg, "fp32", "")
        return f"PEFT's LoRA r={ft.lora_rank} over {base}{cast}; {optimizer} over the adapters alone"
    frozen = f"; {ft.label}: no grads or optimizer state for them" if not ft.trains_all else ""
    return training_note(cfg) + frozen


def torchtune_note(cfg: StepConfig) -> str:
    """torchtune's recipe in a line: what trains, in what dtype, the loss, the optimizer and when it steps."""
    ft = cfg.finetune
    base = "torchao NF4 base" if ft.quantize else f"{cfg.precision} base"
    what = (f"LoRALinear r={ft.lora_rank} ({cfg.precision} adapters) over a {base}" if ft.lora else
            f"every weight in {cfg.precision}, no master")  # fmt: skip
    loss = "CEWithChunkedOutputLoss (8 chunks)" if cfg.stack.loss == "chunked" else "cross-entropy over the logits"
    when = ", one per parameter stepped in backward (optimizer_in_bwd)" if cfg.stack.in_backward else ""
    return f"torchtune: {what}; {loss}; {optimizer_note(cfg, cfg.precision, '')}{when}"


def training_note(cfg: StepConfig) -> str:
    """What the simulated optimizer step is when every weight (or all but the frozen ones) trains."""
    if cfg.recipe == "autocast" and cfg.precision != "fp32":
        scaler = ", GradScaler" if cfg.precision == "fp16" else ""
        return (f"torch.autocast over fp32 weights ({cfg.device.upper()}'s lists; weight casts cached through "
                f"forward){scaler}; {optimizer_note(cfg, 'fp32', '')}")  # fmt: skip
    if cfg.impl == "reference":
        return "AdamW (fp32 m, v) on one GPU, grads converted per tensor"
    return optimizer_note(cfg, cfg.precision, "" if cfg.precision == "fp32" else ", no master") + " on one GPU"


def optimizer_note(cfg: StepConfig, weights: str, master: str) -> str:
    """The optimizer step over weights of that dtype."""
    if cfg.impl == "reference":
        return f"AdamW per tensor on the {weights} weights"
    if cfg.optimizer in ("adam8bit", "paged-adam8bit", "paged-adamw"):
        name = {"adam8bit": "AdamW8bit", "paged-adam8bit": "PagedAdamW8bit", "paged-adamw": "PagedAdamW"}[cfg.optimizer]
        state = "fp32 m, v" if cfg.optimizer == "paged-adamw" else "uint8 m, v"
        paged = (" in unified memory (paged: evictable to host, outside PyTorch's allocator)"
                 if cfg.optimizer.startswith("paged") else "")
        return f"bitsandbytes {name} ({weights} weights{master}; {state}{paged})"
    name = {"adamw": "AdamW", "sgd": "SGD with momentum"}[cfg.optimizer]
    return f"torch.optim {name} ({cfg.impl}; {weights} weights and state{master})"


class Recipe:
    """verify/recipes.py's Recipe: fp32 master weights (16-bit recipes), AdamW m and v made at the
    first step, and GradScaler's scale and growth tracker for fp16."""

    def __init__(self, g: Graph, m: Transformer | HFModel):
        self.g, self.model, self.precision = g, m, m.cfg.precision
        self.params = m.params
        if self.precision == "fp32":
            self.masters = self.params
        else:  # p.detach().float(): an fp32 parameter (LoRA's adapters, memcalc.exact.hf.lora) is its own
            self.masters = [p if p.dtype == "fp32" else g.empty(p.shape, "fp32", "_to_copy", kind="state",
                                                                 copies=p.copies) for p in self.params]  # fmt: skip
            for p, w in zip(self.params, self.masters):
                if w is not p:
                    g.mark(w, "master", p.name)
        self.m: list[Tensor | None] = [None] * len(self.params)
        self.v: list[Tensor | None] = [None] * len(self.params)
        self.scale = self.growth = None
        if self.precision == "fp16":
            self.scale = g.empty((), "fp32", "full", kind="state")
            self.growth = g.empty((), "int32", "zeros", kind="state")

    def first_step_state(self) -> None:
        """What the first optimizer step leaves behind besides new weights: AdamW's m and v. A step
        simulated after this allocates and frees what it would after a real first step."""
        for i, w in enumerate(self.masters):
            self.m[i] = self.g.empty(w.shape, "fp32", "zeros_like", kind="state", copies=w.copies)
            self.v[i] = self.g.empty(w.shape, "fp32", "zeros_like", kind="state", copies=w.copies)
            self.g.mark(self.m[i], "state", self.params[i].name)
            self.g.mark(self.v[i], "state", self.params[i].name)

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
        for i, p in enumerate(g.each(self.params)):  # equal experts' tensors in turn: see Graph.each
            w = self.masters[i]
            g.layer, g.scope = layer_of(p.name), scope_of(p.name)
            if self.precision == "fp32" or p.grad.dtype == "fp32":
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
            adamw(g, w, grad, self.m[i], self.v[i])
            if w is not p:
                g.kernel("copy_", (w,), (p,))  # the new 16-bit weights
            del grad
        del found_inf, inv_scale
        g.layer, g.stage, g.scope = None, "forward", ""

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


class TorchRecipe:
    """verify/recipes.py TorchRecipe: the model's own parameters (fp32, or 16-bit with no master) updated
    by the library's optimizer (after the Trainer's clipping, where it clips), loss.backward() unscaled (pure
    fp16: GradScaler refuses fp16 grads), then optimizer.zero_grad(): every gradient set to None, in parameter
    order."""

    def __init__(self, g: Graph, m: Transformer, clip: bool = False):
        self.g, self.model, self.params = g, m, m.params
        self.optimizer: AdamW | SGD | AdamW8bit = library_optimizer(g, m.params, m.cfg.optimizer, m.cfg.impl,
                                                                     m.cfg.device)  # fmt: skip
        self.clip = clip  # the Trainer's clipping (memcalc.exact.train.clip)
        self.grad_norm: Tensor | None = None  # the Trainer loop's grad_norm: the last step's total norm

    def backward(self, loss: Tensor) -> None:
        self.g.backward(loss)

    def update(self) -> None:
        g = self.g
        g.stage = "optimizer"
        if self.clip:
            self.grad_norm = None  # the loop's grad_norm = None, then the clipping's total norm
            self.grad_norm = clip_grad_norm(g, self.params)
        self.optimizer.step()
        for p in self.params:  # torch/optim/optimizer.py Optimizer.zero_grad(set_to_none=True)
            p.grad = None
        g.layer, g.stage = None, "forward"


def adamw(g: Graph, w: Tensor, grad: Tensor, m: Tensor, v: Tensor) -> None:
    """recipes.adamw_: one AdamW update of an fp32 tensor in place; one temporary, the denominator."""
    g.kernel("mul_", (w,), (w,))  # decoupled weight decay
    g.kernel("lerp_", (m, grad), (m,))
    g.kernel("mul_", (v,), (v,))
    g.kernel("addcmul_", (v, grad), (v,))  # g·g: one operand read once
    denom = g.empty(w.shape, "fp32", "sqrt")  # v.sqrt().div_(...).add_(eps)
    g.kernel("sqrt", (v,), (denom,))
    g.kernel("div_", (denom,), (denom,))
    g.kernel("add_", (denom,), (denom,))
    g.kernel("addcdiv_", (w, m, denom), (w,))
