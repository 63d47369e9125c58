"""The peak memory of one GPU of each pipeline stage (StageMemory, stage_memory; a mixture of experts'
in moe_stage_memory) and of the whole layout, the stage that holds the most (LayoutMemory, layout_memory):
the model state (memcalc.parallel.params), the activations the schedule keeps (memcalc.parallel.activations,
memcalc.parallel.pipeline) and the transient buffers and logits (memcalc.parallel.buffers), as the stack's
engine (memcalc.parallel.engines) lays them out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.memory.estimate import Budget, Setup
from memcalc.memory.state import ModelState, weights_held_elsewhere
from memcalc.model.gpus import GPU
from memcalc.model.shape import Model, moe_layer_count
from memcalc.model.tricks import Tricks
from memcalc.records import record
from memcalc.terms import Term

from .activations import LayerActivations, layer_activations, megatron_inputs, moe_layer_activations
from .buffers import cp_buffers, engine_buffers, ep_buffers, logits_terms, zero3_buffers
from .checks import check_layout
from .engines import deepspeed_state
from .params import expert_gpu_params, gpu_params, moe_sharded_state, sharded_state
from .pipeline import held_layers, layers_per_stage, moe_split

if TYPE_CHECKING:  # only for annotations: memcalc.parallel.layout imports this module
    from .layout import Layout


@record(slots=True)
class StageMemory(Budget):
    """The peak memory of one GPU in pipeline stage `stage`: every GPU of a stage holds the same."""

    stage: int
    layers: int  # transformer layers on this stage
    params: int  # parameters this GPU holds before ZeRO sharding
    state: ModelState
    layer: LayerActivations  # one layer, one micro-batch
    held: int  # layer-micro-batches of activations kept at the peak (pipeline in flight)
    buffers: tuple[Term, ...]  # transient: the engine's gathered layers and buckets, CP ring buffers
    logits: tuple[Term, ...]  # last stage only
    usable_bytes: int
    host_usable_bytes: int  # one GPU's share of its node's CPU memory
    moe_layer: LayerActivations | None = None  # a MoE layer (layer: its dense layers')
    moe_held: int = 0  # MoE layer-micro-batches kept at the peak (held: the dense ones)
    expert_params: int = 0  # routed-expert parameters on this GPU (in params), sharded over edp by ZeRO
    inputs: tuple[Term, ...] = ()  # activations outside the layers (Megatron-LM's first stage), all in flight

    @property
    def host_bytes(self) -> int:
        """Model state offloaded to CPU memory, this GPU's part."""
        return self.state.host_bytes

    @property
    def activation_bytes(self) -> int:
        moe = self.moe_held * self.moe_layer.per_layer_bytes if self.moe_layer else 0
        return self.held * self.layer.per_layer_bytes + moe + sum(t.value for t in self.inputs)

    @property
    def rebuilt_bytes(self) -> int:
        """One layer rebuilt while its backward runs: the larger kind."""
        return max(self.layer.rebuilt_bytes, self.moe_layer.rebuilt_bytes if self.moe_layer else 0)

    @property
    def activation_peak_bytes(self) -> int:
        """Kept activations plus one layer rebuilt while its backward runs."""
        return self.activation_bytes + self.rebuilt_bytes

    @property
    def buffer_bytes(self) -> int:
        return sum(t.value for t in self.buffers)

    @property
    def logits_bytes(self) -> int:
        return sum(t.value for t in self.logits)

    @property
    def total_bytes(self) -> int:
        """Model state + activations at their peak + buffers + logits (written flat: the planner calls it most)."""
        layer = self.layer
        if self.moe_layer is not None:
            return (self.state.total_bytes + self.activation_peak_bytes + sum(t.value for t in self.buffers)
                    + sum(t.value for t in self.logits))  # fmt: skip
        return (self.state.total_bytes + self.held * layer.per_layer_bytes + layer.rebuilt_bytes
                + sum(t.value for t in self.buffers) + sum(t.value for t in self.logits)
                + sum(t.value for t in self.inputs))  # fmt: skip


@record(slots=True)
class LayoutMemory:
    """Per-GPU memory of a layout, stage by stage; the peak is the stage that holds the most."""

    layout: Layout
    tricks: Tricks
    micro_batches: int  # m: micro-batches per step through each pipeline
    stages: tuple[StageMemory, ...]  # every stage, or those that can peak (the ends, and the second if uneven)
    stage_layers: tuple[int, ...] = ()  # transformer layers on every stage, first to last

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total_bytes)

    @property
    def total_bytes(self) -> int:
        return max(st.total_bytes for st in self.stages)

    @property
    def host_bytes(self) -> int:
        """Host memory per GPU (offload), at the stage that offloads the most."""
        return max(st.state.host_bytes for st in self.stages)

    @property
    def fits(self) -> bool:
        return all(st.fits for st in self.stages)


def stage_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, stage: int,
                 layers: int | None = None) -> StageMemory:  # fmt: skip
    """One GPU of pipeline stage `stage`, holding `layers` transformer layers (default: L/p), as the
    stack's engine (memcalc.parallel.engines) lays it out."""
    if moe_layer_count(model.shape):
        return moe_stage_memory(model, setup, gpu, tricks, layout, stage)
    shape, p, engine = model.shape, layout.pp, setup.stack.engine
    layers = shape.n_layers // p if layers is None else layers
    params = gpu_params(model, layout.tp, p, stage, layers)
    state = sharded_state(params, tricks.precision, setup.optimizer, layout.shard_group, layout.zero,
                          layout.offload_optimizer, layout.offload_params, setup.stack.recipe)  # fmt: skip
    if engine == "deepspeed":
        state = deepspeed_state(state, layout.zero, layout.offload_optimizer)
    layer = layer_activations(shape, setup.seq_len, setup.micro_batch, tricks, layout.tp, layout.sp, layout.cp,
                              "megatron" if engine == "megatron" else "none")  # fmt: skip
    held = held_layers(layout, stage, setup.grad_accum, shape.n_layers, layers)
    inputs = ()
    if engine == "megatron" and stage == 0:
        inputs = megatron_inputs(shape, setup.seq_len, setup.micro_batch, layout.tp, layout.sp, layout.cp, held, layers)
    buffers = list(engine_buffers(model, tricks, layout, state, stage, layers, engine))
    if layout.cp > 1:
        buffers.append(cp_buffers(shape, setup.seq_len, setup.micro_batch, layout.tp, layout.cp, tricks.act_bytes))
    logits = ()
    if stage == p - 1:
        logits = logits_terms(shape, setup.seq_len, setup.micro_batch, tricks.precision, layout.tp, layout.cp)
    return StageMemory(
        stage=stage,
        layers=layers,
        params=params,
        state=state,
        layer=layer,
        held=held,
        buffers=tuple(buffers),
        logits=logits,
        usable_bytes=gpu.usable_bytes,
        host_usable_bytes=host_share(setup, layout),
        inputs=inputs,
    )


def moe_stage_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, stage: int) -> StageMemory:
    """stage_memory for a mixture of experts: the non-expert state over the dp × cp shard group and the routed
    experts' over their edp group (Megatron-LM theoretical_memory_usage.py weight_and_optimizer_memory); dense
    and MoE layers' activations apart (the MTP module, on the last stage, as one more MoE layer); the
    all-to-all's buffers; the last stage's logits once more per MTP module."""
    shape, p, s = model.shape, layout.pp, setup
    params = gpu_params(model, layout.tp, p, stage)
    experts = expert_gpu_params(shape, layout, stage)
    state = moe_sharded_state(params, experts, tricks.precision, s.optimizer, layout.shard_group,
                              layout.expert_shard_group, layout.zero, layout.offload_optimizer,
                              layout.offload_params, s.stack.recipe)  # fmt: skip
    dense, moe = moe_split(shape, p, stage)
    last = stage == p - 1
    if last:
        moe += shape.mtp_layers
    held = held_layers(layout, stage, s.grad_accum, shape.n_layers)  # layer-micro-batches of the stage's L/p
    per = shape.n_layers // p
    buffers = []
    if layout.zero == 3 and (layout.shard_group > 1 or layout.offload_params):
        buffers.append(zero3_buffers(shape, layout.tp, tricks.precision, weights_held_elsewhere(state)))
    if layout.cp > 1:
        buffers.append(cp_buffers(shape, s.seq_len, s.micro_batch, layout.tp, layout.cp, tricks.act_bytes))
    if layout.ep > 1:
        buffers.append(ep_buffers(shape, s.seq_len, s.micro_batch, layout.tp, layout.sp, layout.cp, layout.ep,
                                  tricks.act_bytes, s.routing))  # fmt: skip
    logits = ()
    if last:
        logits = logits_terms(shape, s.seq_len, s.micro_batch, tricks.precision, layout.tp, layout.cp)
        logits *= 1 + shape.mtp_layers
    return StageMemory(
        stage=stage, layers=per + (shape.mtp_layers if last else 0), params=params + experts, state=state,
        layer=layer_activations(shape, s.seq_len, s.micro_batch, tricks, layout.tp, layout.sp, layout.cp),
        held=-(-held * dense // per), buffers=tuple(buffers), logits=logits, usable_bytes=gpu.usable_bytes,
        host_usable_bytes=host_share(s, layout),
        moe_layer=moe_layer_activations(shape, s.seq_len, s.micro_batch, tricks, layout.tp, layout.sp, layout.cp,
                                        layout.ep, layout.etp, s.routing),
        moe_held=-(-held * moe // per), expert_params=experts,
    )  # fmt: skip


def layout_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout,
                  ends_only: bool = False) -> LayoutMemory:  # fmt: skip
    """Per-GPU memory of every pipeline stage (or only those that can peak: the first and the last, and
    the second when stages are uneven).

    setup.micro_batch is b, setup.grad_accum the micro-batches m each pipeline runs per step;
    setup.parallel is not read: the layout replaces it. With tp = pp = cp = 1 every number equals
    memcalc.memory.estimate's with Parallel(dp, zero, offload) (ZeRO-3 adds its gathered-layer buffers).
    """
    engine = setup.stack.engine
    check_layout(layout, model.shape, setup.seq_len, tricks, setup.grad_accum, engine)
    counts = layers_per_stage(layout, model.shape.n_layers, engine)
    p = layout.pp
    which = range(p)
    if ends_only:
        which = sorted({0, p - 1} | ({1} if len(set(counts)) > 1 and p > 2 else set()))
    stages = tuple(stage_memory(model, setup, gpu, tricks, layout, i, counts[i]) for i in which)
    return LayoutMemory(layout, tricks, setup.grad_accum, stages, counts)


def host_share(setup: Setup, layout: Layout) -> int:
    """One GPU's share of its node's host memory, which offload fills: the job's GPUs on a node split it."""
    return setup.host_memory // min(layout.world, layout.gpus_per_node)
