"""verify/meta.py's measured training step, run in bytes on memcalc.exact.sim.graph: the model built
(memcalc.exact.builder.model), a warm-up step, then the measured one under verify/recipes.py's recipe for the
stack (memcalc.exact.train.recipes), with every phase's peak; and trace(), the kernels of one step.
"""

from __future__ import annotations

from dataclasses import replace

from ..base.collection import no_collection
from ..base.config import Phases, StepConfig
from ..base.kernel import Kernel
from ..builder import model as reference
from ..builder.model import Transformer
from ..hf import model as hf
from ..sim.events import Recording
from ..sim.graph import Graph, layer_of, scope_of
from ..sim.tensors import LiveBytes, Tensor
from ..torchtune import model as torchtune
from ..train import recipes
from ..train.amp import AutocastRecipe
from ..train.recipes import Recipe, TorchRecipe, check_simulated
from .inductor import FusionGraph, fused
from .fsdp2_lora import Fsdp2Lora
from .zero import Sharding, Zero, ZeroGraph


def build(g: Graph, cfg: StepConfig) -> Transformer | hf.HFModel:
    """Whose model the stack trains (cfg.model): memcalc's reference layer, Transformers' classes, or torchtune's
    TransformerDecoder. The graph takes the config's watched: some backward formulas run as a dispatch mode sees them
    (memcalc.exact.sim.graph.Graph.watched)."""
    g.watched = cfg.watched
    return {"hf": hf.build, "torchtune": torchtune.build}.get(cfg.model, reference.build)(g, cfg)


def forward(g: Graph, model: Transformer | hf.HFModel, idx: Tensor, targets: Tensor) -> Tensor:
    """The model's loss; torchtune's is its recipe's (the loss step in memcalc.exact.train.torchtune)."""
    if model.cfg.model == "torchtune":
        return model.loop.forward(idx, targets)
    return (hf.forward if model.cfg.model == "hf" else reference.forward)(g, model, idx, targets)


def recipe_for(g: Graph, model: Transformer, sharded: bool = False) -> Recipe | TorchRecipe | AutocastRecipe:
    """How the step trains: torch.amp's loop where the model autocasts, else verify/recipes.py's; on Transformers'
    classes with a library's optimizer the Trainer's, which clips the gradients (memcalc.exact.train.clip) but where
    the model is sharded (memcalc's reference AdamW is its lesson's loop, which does not) or PPOTrainer's loop runs
    the step (it never clips)."""
    clip = model.cfg.model == "hf" and model.cfg.impl != "reference" and not sharded and model.cfg.stack.rl != "ppo"
    if getattr(model, "autocast", None) is None:
        return recipes.recipe_for(g, model, clip)
    return AutocastRecipe(g, model, clip)


def micro_step(g: Graph, model: Transformer, recipe: Recipe | TorchRecipe | AutocastRecipe, idx: Tensor,
               targets: Tensor, grad_accum: int, zero: Zero | None = None) -> None:  # fmt: skip
    """grad_accum forward-backward passes (grads add up in place), then the optimizer step."""
    for k in range(grad_accum):
        loss = forward_pass(g, model, idx, targets, zero)
        backward_pass(recipe, loss, zero)
        del loss
        if k < grad_accum - 1:
            after(g, model, "backward_done")
    update(recipe, zero)
    after(g, model, "stepped")


def after(g: Graph, model, when: str) -> None:
    """What a trainer's own loop runs after a micro-batch's backward (backward_done) or the optimizer step (stepped):
    PPO's metrics and its mini-batch's `del` (memcalc.exact.hf.ppo.PpoLoop); nothing for the others."""
    loop = getattr(model, "own_loop", None)
    if loop is not None:
        getattr(loop, when)(g, model)


def forward_pass(g: Graph, model, idx: Tensor, targets: Tensor, zero: Zero | None) -> Tensor:
    """forward, with a ZeRO rank's gathers at its unit boundaries (memcalc.exact.replay.zero)."""
    if zero is None:
        return forward(g, model, idx, targets)
    zero.start("forward")
    loss = forward(g, model, idx, targets)
    zero.end()
    return loss


def backward_pass(recipe, loss: Tensor, zero: Zero | None) -> None:
    """recipe.backward, with a ZeRO rank's gathers and reduce-scatters at its unit boundaries."""
    if zero is not None:
        zero.start("backward")
    recipe.backward(loss)
    if zero is not None:
        zero.end()


def update(recipe, zero: Zero | None) -> None:
    """The optimizer step: the recipe's, or a ZeRO rank's over its shards."""
    if zero is None:
        recipe.update()
    else:
        zero.update(recipe)


def trace(cfg: StepConfig) -> list[Kernel]:
    """The kernels of one steady-state training step: one micro-batch's forward and backward (and
    checkpoint recompute), what each further micro-batch adds into the gradients (AccumulateGrad's
    in-place add, phase "accumulate"), and the optimizer step. The reference recipe's first step runs
    the same kernels as any other (making AdamW's m and v is not a kernel there), so it is traced with
    no warm-up; the libraries' optimizers make their state at the first step (zeros, SGD's clone), as
    the autocast recipe's GradScaler does (full), so their trace is of a second step, the first run
    unrecorded."""
    with no_collection():
        return traced_step(cfg)


def traced_step(cfg: StepConfig) -> list[Kernel]:
    """trace's step, simulated."""
    check_simulated(cfg)
    g = FusionGraph(LiveBytes()) if cfg.compile else Graph(LiveBytes())
    g.kernels = []
    model = build(g, cfg)
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")
    targets = g.empty((B, T), "int64", "input", kind="input")
    recipe = recipe_for(g, model)
    if not isinstance(recipe, Recipe):  # the libraries' optimizers, GradScaler: their state made at the first step
        built, g.kernels = g.kernels, None
        micro_step(g, model, recipe, idx, targets, 1)
        g.kernels = built
    loss = forward(g, model, idx, targets)
    recipe.backward(loss)
    del loss
    g.stage = "accumulate"
    for p in g.each(model.params):  # a later micro-batch's gradient, added into this one
        if p.grad is not None:
            g.layer, g.scope = layer_of(p.name), scope_of(p.name)
            g.accumulate(p)
    g.layer, g.scope = None, ""
    recipe.update()
    return fused(g) if cfg.compile else g.kernels


def replayed(grad_accum: int, cfg: StepConfig | None = None) -> int:
    """How many of a step's micro-batches must be simulated: the first, whose gradients AccumulateGrad
    steals into .grad, and one later one, which adds its gradients into them in place. Every later
    micro-batch starts from the same live bytes and allocates and frees the same tensors in the same
    order (nothing marks the last one), so the second stands for the middle ones and the last. Under PPO's own
    loop the last is marked (its metrics follow the optimizer step, the others' precede the next forward): a
    middle one and the last."""
    return min(grad_accum, 3 if cfg is not None and cfg.stack.rl == "ppo" else 2)


def frozen_params(model) -> list[Tensor]:
    """The parameters that do not train (LoRA's base, QLoRA's packed 4-bit weights), in parameters() order."""
    if not isinstance(model, hf.HFModel):  # memcalc's reference model trains every weight
        return []
    trained = {id(p) for p in model.params}
    return [p for p in model.p.values() if id(p) not in trained]


def simulate(cfg: StepConfig, timeline: bool = False, every_micro_batch: bool = False,
             warm_up: bool = True, sharding: Sharding | None = None,
             drawn: int | None = None) -> tuple[Phases, Graph, LiveBytes]:  # fmt: skip
    """Build, one warm-up step, then the measured step (its last micro-batch's phases; the saved
    terms, rebuilt bytes and FLOPs of its first). Each step simulates replayed(grad_accum)
    micro-batches, equal to the byte to replaying all of them (every_micro_batch, or a timeline,
    which records every allocation, replays all), so the time does not grow with grad_accum.
    warm_up=False makes the state a first step leaves (Recipe.first_step_state) instead of running
    one: the same phases for half the work (tests/test_exact_depth.py). sharding: one data-parallel rank's
    step under ZeRO (memcalc.exact.replay.zero), None (or a trivial one) for one GPU's. drawn: with a timeline,
    the first `drawn` of the step's micro-batches only (what the step holds for all of them, such as GRPO's
    generation batch, still sized by cfg.grad_accum)."""
    with no_collection():
        return simulated(cfg, timeline, every_micro_batch, warm_up, sharding, drawn)


def simulated(cfg: StepConfig, timeline: bool, every_micro_batch: bool, warm_up: bool,
              sharding: Sharding | None, drawn: int | None = None) -> tuple[Phases, Graph, LiveBytes]:  # fmt: skip
    """simulate's step."""
    check_simulated(cfg)
    if timeline:  # it records every allocation: each expert's, none standing for another
        cfg = replace(cfg, collapse=False)
    micro_batches = cfg.grad_accum if timeline or every_micro_batch else replayed(cfg.grad_accum, cfg)
    if timeline and drawn is not None:
        micro_batches = min(drawn, cfg.grad_accum)
    mem = LiveBytes(timeline=[] if timeline else None)
    sharded = sharding is not None and not sharding.trivial
    g = ZeroGraph(mem) if sharded else Graph(mem)
    if timeline:  # what each allocation is (memcalc.exact.sim.events), for memcalc.exact.timeline
        g.recording = Recording(mem)
    model = build(g, cfg)
    engine = Fsdp2Lora if sharded and sharding.fsdp2 else Zero
    zero = engine(g, model.params, sharding, frozen_params(model)) if sharded else None
    weights = mem.live_bytes
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")
    targets = g.empty((B, T), "int64", "input", kind="input")
    inputs = mem.live_bytes - weights
    if timeline:
        g.recording.loaded = len(mem.timeline)
    recipe = recipe_for(g, model if zero is None else zero.optimizer_model(model), zero is not None)
    if warm_up or not isinstance(recipe, Recipe):  # the libraries' optimizers make their state in their first step
        micro_step(g, model, recipe, idx, targets, micro_batches, zero)
    else:
        recipe.first_step_state()
    if zero is not None:
        zero.made_state(weights + inputs)
    before = mem.live_bytes
    peaks = {}
    for k in range(micro_batches):
        mem.phase = "forward"
        mem.reset_peak()
        if k == 0:
            g.record_saves()
            g.flops, g.rebuilt_bytes = {}, 0
        loss = forward_pass(g, model, idx, targets, zero)
        if k == 0:
            terms, g.saved_terms = g.saved_terms, None
            retained = mem.live_bytes - before
        peaks["forward"] = (mem.peak_bytes, mem.peak_at)
        mem.segments["forward"] = (dict(mem.segment_peaks), list(mem.blocks_seen))
        mem.phase = "backward"
        mem.reset_peak()
        backward_pass(recipe, loss, zero)
        del loss
        if k < micro_batches - 1:
            after(g, model, "backward_done")
        peaks["backward"] = (mem.peak_bytes, mem.peak_at)
        mem.segments["backward"] = (dict(mem.segment_peaks), list(mem.blocks_seen))
        if k == 0:
            flops, rebuilt = dict(g.flops), g.rebuilt_bytes
            moved = (g.offload.offloaded_bytes, g.offload.reloaded_bytes) if g.offload is not None else (0, 0)
    grads = mem.live_bytes - before
    mem.phase = "optimizer"
    mem.reset_peak()
    update(recipe, zero)
    after(g, model, "stepped")
    peaks["optimizer"] = (mem.peak_bytes, mem.peak_at)
    mem.segments["optimizer"] = (dict(mem.segment_peaks), list(mem.blocks_seen))
    mem.phase = ""
    g.saved_terms, g.flops, g.rebuilt_bytes = terms, flops, rebuilt
    (fp, fa), (bp, ba), (op, oa) = peaks["forward"], peaks["backward"], peaks["optimizer"]
    load = getattr(zero, "load_bytes", 0)  # the model whole on this GPU as it loads (zero.py)
    phases = Phases(weights, inputs, before - inputs, retained, grads, fp, bp, op, fa, ba, oa, *moved, load)
    return phases, g, mem
