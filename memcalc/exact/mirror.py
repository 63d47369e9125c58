"""verify/meta.py's measured training step, run in bytes on memcalc.exact.sim: the model built
(memcalc.exact.builder), a warm-up step, then the measured one under verify/recipes.py's recipe
(memcalc.exact.recipes), with every phase's peak; and trace(), the kernels of one step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import builder, hf
from .builder import Model
from .config import Config
from .recipes import Recipe, check_simulated, layer_of
from .sim import Graph, Kernel, Memory, Tensor


def build(g: Graph, cfg: Config) -> Model | hf.HFModel:
    """Whose model the stack trains (cfg.model): memcalc's reference layer, or Transformers' classes."""
    return hf.build(g, cfg) if cfg.model == "hf" else builder.build(g, cfg)


def forward(g: Graph, model: Model | hf.HFModel, idx: Tensor, targets: Tensor) -> Tensor:
    return (hf.forward if model.cfg.model == "hf" else builder.forward)(g, model, idx, targets)


@dataclass(frozen=True)
class Phases:
    """Bytes of one steady-state training step (the second), as verify measures them. Peaks are
    of everything live on the device: weights, buffers, inputs, optimizer state, activations; with
    gradient accumulation, forward and backward are its last micro-batch's (grads already exist)."""

    weights_bytes: int  # parameters and buffers, after build
    inputs_bytes: int  # token ids and targets
    state_bytes: int  # live between steps, less the inputs: weights, buffers, master, m, v (+ scaler)
    retained_bytes: int  # what forward leaves alive: saved tensors (and checkpoint inputs) and the loss
    grads_bytes: int  # what backward leaves alive above the state (the loss released): the gradients
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    forward_peak_at: str  # the op at which the peak was reached
    backward_peak_at: str
    optimizer_peak_at: str

    @property
    def step_peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)


def micro_step(g: Graph, model: Model, recipe: Recipe, idx: Tensor, targets: Tensor, grad_accum: int) -> None:
    """grad_accum forward-backward passes (grads add up in place), then the optimizer step."""
    for _ in range(grad_accum):
        loss = forward(g, model, idx, targets)
        recipe.backward(loss)
        del loss
    recipe.update()


def trace(cfg: Config) -> list[Kernel]:
    """The kernels of one steady-state training step: one micro-batch's forward and backward (and
    checkpoint recompute), what each further micro-batch adds into the gradients (AccumulateGrad's
    in-place add, phase "accumulate"), and the optimizer step. One step, no warm-up: a first step
    runs the same kernels as any other, except making AdamW's m and v, which is not a kernel here."""
    check_simulated(cfg)
    g = Graph(Memory())
    g.kernels = []
    model = build(g, cfg)
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")
    targets = g.empty((B, T), "int64", "input", kind="input")
    recipe = Recipe(g, model)
    loss = forward(g, model, idx, targets)
    recipe.backward(loss)
    del loss
    g.stage = "accumulate"
    for p in model.params:  # a later micro-batch's gradient, added into this one
        if p.grad is not None:
            g.layer = layer_of(p.name)
            g.accumulate(p)
    g.layer = None
    recipe.update()
    return g.kernels


def replayed(grad_accum: int) -> int:
    """How many of a step's micro-batches must be simulated: the first, whose gradients AccumulateGrad
    steals into .grad, and one later one, which adds its gradients into them in place. Every later
    micro-batch starts from the same live bytes and allocates and frees the same tensors in the same
    order (nothing marks the last one), so the second stands for the middle ones and the last."""
    return min(grad_accum, 2)


def simulate(cfg: Config, timeline: bool = False, every_micro_batch: bool = False) -> tuple[Phases, Graph, Memory]:
    """Build, one warm-up step, then the measured step (its last micro-batch's phases; the saved
    terms, rebuilt bytes and FLOPs of its first). Each step simulates replayed(grad_accum)
    micro-batches, equal to the byte to replaying all of them (every_micro_batch, or a timeline,
    which records every allocation, replays all), so the time does not grow with grad_accum."""
    check_simulated(cfg)
    micro_batches = cfg.grad_accum if timeline or every_micro_batch else replayed(cfg.grad_accum)
    mem = Memory(timeline=[] if timeline else None)
    g = Graph(mem)
    model = build(g, cfg)
    weights = mem.live_bytes
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")
    targets = g.empty((B, T), "int64", "input", kind="input")
    inputs = mem.live_bytes - weights
    recipe = Recipe(g, model)
    micro_step(g, model, recipe, idx, targets, micro_batches)
    before = mem.live_bytes
    peaks = {}
    for k in range(micro_batches):
        mem.phase = "forward"
        mem.reset_peak()
        if k == 0:
            g.record_saves()
            g.flops, g.rebuilt_bytes = {}, 0
        loss = forward(g, model, idx, targets)
        if k == 0:
            terms, g.saved_terms = g.saved_terms, None
            retained = mem.live_bytes - before
        peaks["forward"] = (mem.peak_bytes, mem.peak_at)
        mem.phase = "backward"
        mem.reset_peak()
        recipe.backward(loss)
        del loss
        peaks["backward"] = (mem.peak_bytes, mem.peak_at)
        if k == 0:
            flops, rebuilt = dict(g.flops), g.rebuilt_bytes
    grads = mem.live_bytes - before
    mem.phase = "optimizer"
    mem.reset_peak()
    recipe.update()
    peaks["optimizer"] = (mem.peak_bytes, mem.peak_at)
    mem.phase = ""
    g.saved_terms, g.flops, g.rebuilt_bytes = terms, flops, rebuilt
    (fp, fa), (bp, ba), (op, oa) = peaks["forward"], peaks["backward"], peaks["optimizer"]
    phases = Phases(weights, inputs, before - inputs, retained, grads, fp, bp, op, fa, ba, oa)
    return phases, g, mem
