"""The peak memory of one GPU of each pipeline stage (StageMemory, stage_memory) and of the whole layout,
the stage that holds the most (LayoutMemory, layout_memory; LayoutPeak, layout_peak, the planner's): the
model state (memcalc.parallel.params) with the buffers its sharding adds (StageState), and the activations
the schedule keeps (memcalc.parallel.activations, memcalc.parallel.pipeline) with their transient buffers and
the logits (memcalc.parallel.buffers; StageActivations), as the stack's engine (memcalc.parallel.engines)
lays them out."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from memcalc.memory.estimate import Fits, Setup, state_for
from memcalc.memory.setup import host_share
from memcalc.memory.state import ModelState, weights_held_elsewhere
from memcalc.model.gpus import GPU
from memcalc.model.headroom import usable_bytes
from memcalc.model.layout import Layout
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


@record(slots=True)
class StageMemory(Fits):
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
        return kept_bytes(self.layer, self.held, self.moe_layer, self.moe_held, self.inputs)

    @property
    def rebuilt_bytes(self) -> int:
        return rebuilt_bytes(self.layer, self.moe_layer)

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
    def params(self) -> int:
        """The most parameters a stage's GPU holds (before ZeRO), of the stages kept."""
        return max(st.params for st in self.stages)

    @property
    def fits(self) -> bool:
        return all(st.fits for st in self.stages)


def stage_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, stage: int,
                 layers: int | None = None) -> StageMemory:  # fmt: skip
    """One GPU of pipeline stage `stage`, holding `layers` transformer layers (default: L/p), as the
    stack's engine (memcalc.parallel.engines) lays it out: the state it keeps (stage_state) and the
    activations it holds at its peak (stage_activations)."""
    layers = model.shape.n_layers // layout.pp if layers is None else layers
    kept = stage_state(model, setup, tricks, layout, stage, layers)
    held = stage_activations(model, setup, tricks, layout, stage, layers)
    return StageMemory(
        stage=stage, layers=held.layers, params=kept.params, state=kept.state, layer=held.layer, held=held.held,
        buffers=kept.buffers + held.buffers, logits=held.logits, usable_bytes=usable_bytes(gpu, layout.groups),
        host_usable_bytes=host_share(setup, layout), moe_layer=held.moe_layer, moe_held=held.moe_held,
        expert_params=kept.expert_params, inputs=held.inputs,
    )  # fmt: skip


@record(slots=True)
class StageState:
    """What one GPU of a stage keeps between steps and the buffers its sharding adds (ZeRO-3's gathered
    layers, the engine's buckets): the half of StageMemory that the micro-batch, the recompute mode, SP
    and interleaving leave alone. gpu_bytes: its state on the GPU plus those buffers."""

    params: int
    expert_params: int
    state: ModelState
    buffers: tuple[Term, ...]
    gpu_bytes: int
    host_bytes: int  # offloaded state


@record(slots=True)
class StageActivations:
    """The activations one GPU of a stage keeps at its peak, with their transient buffers (CP's ring, EP's
    all-to-all) and the last stage's logits: the half of StageMemory that ZeRO, offload and hybrid shard
    leave alone. gpu_bytes: the activations at their peak (one layer rebuilt) plus those buffers and logits."""

    layers: int
    layer: LayerActivations
    held: int
    buffers: tuple[Term, ...]
    logits: tuple[Term, ...]
    moe_layer: LayerActivations | None
    moe_held: int
    inputs: tuple[Term, ...]
    gpu_bytes: int


# What each half reads of the layout: the state every field but SP and interleaving, the activations every
# field but how the state is sharded and offloaded (tests/test_parallel.py holds that the two cover Layout).
STATE_FIELDS = ("tp", "pp", "cp", "dp", "zero", "hybrid", "offload_optimizer", "offload_params", "gpus_per_node", "ep",
                "etp", "first_layers", "last_layers", "reshard_after_forward")  # fmt: skip
ACTIVATION_FIELDS = ("tp", "pp", "cp", "dp", "sp", "vpp", "gpus_per_node", "ep", "etp", "first_layers", "last_layers")
state_key, activation_key = attrgetter(*STATE_FIELDS), attrgetter(*ACTIVATION_FIELDS)
HALVES: dict[tuple, StageState | StageActivations] = {}  # the planner asks for each half again and again


def remembered(key: tuple, compute: Callable[[], StageState | StageActivations]) -> StageState | StageActivations:
    found = HALVES.get(key)
    if found is None:
        if len(HALVES) >= 1 << 15:
            HALVES.clear()
        found = HALVES[key] = compute()
    return found


def stage_state(model: Model, setup: Setup, tricks: Tricks, layout: Layout, stage: int, layers: int) -> StageState:
    """StageState of one GPU of stage `stage`, remembered by what it reads."""
    key = ("state", model, tricks.precision, setup.optimizer, setup.stack, state_key(layout), stage, layers)
    return remembered(key, lambda: state_of(model, setup, tricks, layout, stage, layers))


def stage_activations(model: Model, setup: Setup, tricks: Tricks, layout: Layout, stage: int,
                      layers: int) -> StageActivations:  # fmt: skip
    """StageActivations of one GPU of stage `stage`, remembered by what it reads (the whole setup: the planner
    keeps one per micro-batch size, whose hash is computed once)."""
    key = ("activations", model, setup, tricks, activation_key(layout), stage, layers)
    return remembered(key, lambda: activations_of(model, setup, tricks, layout, stage, layers))


def state_of(model: Model, setup: Setup, tricks: Tricks, layout: Layout, stage: int, layers: int) -> StageState:
    """The model state of a stage's GPU (memcalc.parallel.params), sharded by the layout's ZeRO stage; a
    mixture of experts' non-expert state over the dp × cp shard group and its routed experts' over their
    edp group (Megatron-LM theoretical_memory_usage.py weight_and_optimizer_memory); the engine's buffers. LoRA
    and frozen weights (plain data parallelism alone: memcalc.engine.job) hold the textbook's state for them
    (memcalc.memory.estimate.state_for), whatever the layout's ZeRO would have sharded."""
    shape, p, engine = model.shape, layout.pp, setup.stack.engine
    if not setup.stack.finetune.trains_all:
        params = gpu_params(model, 1, 1, 0)
        state = state_for(shape, params, setup, tricks.precision, layout)[0]
        return StageState(params, 0, state, (), state.total_bytes, state.host_bytes)
    if moe_layer_count(shape):
        params = gpu_params(model, layout.tp, p, stage)
        experts = expert_gpu_params(shape, layout, stage)
        state = moe_sharded_state(params, experts, tricks.precision, setup.optimizer, layout.shard_group,
                                  layout.expert_shard_group, layout.zero, layout.offload_optimizer,
                                  layout.offload_params, setup.stack.recipe)  # fmt: skip
        buffers = ()
        if layout.zero == 3 and (layout.shard_group > 1 or layout.offload_params):
            buffers = (zero3_buffers(shape, layout.tp, tricks.precision, weights_held_elsewhere(state)),)
        params += experts
    else:
        params, experts = gpu_params(model, layout.tp, p, stage, layers), 0
        state = sharded_state(params, tricks.precision, setup.optimizer, layout.shard_group, layout.zero,
                              layout.offload_optimizer, layout.offload_params, setup.stack.recipe)  # fmt: skip
        if engine == "deepspeed":
            state = deepspeed_state(state, layout.zero, layout.offload_optimizer)
        buffers = engine_buffers(model, tricks, layout, state, stage, layers, engine)
    gpu_bytes = state.total_bytes + sum(t.value for t in buffers)
    return StageState(params, experts, state, tuple(buffers), gpu_bytes, state.host_bytes)


def activations_of(model: Model, setup: Setup, tricks: Tricks, layout: Layout, stage: int,
                   layers: int) -> StageActivations:  # fmt: skip
    """The activations a stage's GPU holds at its peak: the layer-micro-batches in flight (memcalc.parallel.
    pipeline), one layer by Korthikanti's Table 2 (a MoE layer's apart, the MTP module on the last stage as
    one more), CP's ring buffers and EP's all-to-all buffers, the last stage's logits (once more per MTP
    module), and Megatron-LM's first stage's inputs."""
    shape, p, s, engine = model.shape, layout.pp, setup, setup.stack.engine
    last, moe_model = stage == p - 1, moe_layer_count(shape) > 0
    kind = "megatron" if engine == "megatron" and not moe_model else "none"  # a MoE is laid out as the reference's
    layer = layer_activations(shape, s.seq_len, s.micro_batch, tricks, layout.tp, layout.sp, layout.cp, kind)
    buffers, moe_layer, moe_held, inputs = [], None, 0, ()
    if layout.cp > 1:
        buffers.append(cp_buffers(shape, s.seq_len, s.micro_batch, layout.tp, layout.cp, tricks.act_bytes))
    if moe_model:
        dense, moe = moe_split(shape, p, stage)
        per = dense + moe  # the stage's layers
        held = held_layers(layout, stage, s.grad_accum, shape.n_layers, per)  # layer-micro-batches of them
        moe += shape.mtp_layers if last else 0
        layers = per + (shape.mtp_layers if last else 0)
        if layout.ep > 1:
            buffers.append(ep_buffers(shape, s.seq_len, s.micro_batch, layout.tp, layout.sp, layout.cp, layout.ep,
                                      tricks.act_bytes, s.routing))  # fmt: skip
        moe_layer = moe_layer_activations(shape, s.seq_len, s.micro_batch, tricks, layout.tp, layout.sp, layout.cp,
                                          layout.ep, layout.etp, s.routing)  # fmt: skip
        held, moe_held = -(-held * dense // per), -(-held * moe // per)
    else:
        held = held_layers(layout, stage, s.grad_accum, shape.n_layers, layers, engine)
        if engine == "megatron" and stage == 0:
            inputs = megatron_inputs(shape, s.seq_len, s.micro_batch, layout.tp, layout.sp, layout.cp, held, layers)
    logits = ()
    if last:
        logits = logits_terms(shape, s.seq_len, s.micro_batch, tricks.precision, layout.tp, layout.cp)
        if moe_model:  # each MTP module's own logits
            logits *= 1 + shape.mtp_layers
    total = (kept_bytes(layer, held, moe_layer, moe_held, inputs) + rebuilt_bytes(layer, moe_layer)
             + sum(t.value for t in (*buffers, *logits)))  # fmt: skip
    return StageActivations(layers, layer, held, tuple(buffers), logits, moe_layer, moe_held, inputs, total)


def kept_bytes(layer: LayerActivations, held: int, moe_layer: LayerActivations | None, moe_held: int,
               inputs: tuple[Term, ...]) -> int:
    """The activations a stage keeps at its peak: its layer-micro-batches of each kind, and the inputs."""
    moe = moe_held * moe_layer.per_layer_bytes if moe_layer else 0
    return held * layer.per_layer_bytes + moe + sum(t.value for t in inputs)


def rebuilt_bytes(layer: LayerActivations, moe_layer: LayerActivations | None) -> int:
    """One layer rebuilt while its backward runs: the larger kind."""
    return max(layer.rebuilt_bytes, moe_layer.rebuilt_bytes if moe_layer else 0)


def layout_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout,
                  ends_only: bool = False) -> LayoutMemory:  # fmt: skip
    """Per-GPU memory of every pipeline stage (or only those that can peak: the first and the last, and
    the second when stages are uneven).

    setup.micro_batch is b, setup.grad_accum the micro-batches m each pipeline runs per step;
    With tp = pp = cp = 1 every number equals memcalc.memory.estimate's for the same layout (ZeRO-3 adds
    its gathered-layer buffers).
    """
    engine = setup.stack.engine
    check_layout(layout, model.shape, setup.seq_len, tricks, setup.grad_accum, engine)
    counts = layers_per_stage(layout, model.shape.n_layers, engine)
    which = peak_stages(layout.pp, counts) if ends_only else range(layout.pp)
    stages = tuple(stage_memory(model, setup, gpu, tricks, layout, i, counts[i]) for i in which)
    return LayoutMemory(layout, tricks, setup.grad_accum, stages, counts)


def peak_stages(p: int, counts: tuple[int, ...]) -> list[int]:
    """The stages that can hold the most: the first (the most micro-batches in flight) and the last (the
    logits), and the second when stages are uneven."""
    if p > 2 and min(counts) != max(counts):
        return [0, 1, p - 1]
    return [0, p - 1] if p > 1 else [0]


@record(slots=True)
class LayoutPeak:
    """What the planner asks of a layout's memory before it times it: layout_memory's peak per GPU
    (ends_only), whether every stage fits (the GPU, and its share of host memory under offload), the layers
    on every stage and the most parameters a stage's GPU holds."""

    total_bytes: int
    fits: bool
    stage_layers: tuple[int, ...]
    params: int


def layout_peak(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout) -> LayoutPeak:
    """layout_memory(ends_only=True)'s peak and fit, summed from each stage's two halves (stage_state,
    stage_activations) without building a StageMemory: the planner asks for tens of thousands of layouts,
    each of which it built valid (layout_memory checks the layout; tests/test_parallel.py holds the two equal)."""
    counts = layers_per_stage(layout, model.shape.n_layers, setup.stack.engine)
    host_usable, usable = host_share(setup, layout), usable_bytes(gpu, layout.groups)
    peak, fits, params = 0, True, 0
    for i in peak_stages(layout.pp, counts):
        kept = stage_state(model, setup, tricks, layout, i, counts[i])
        total = kept.gpu_bytes + stage_activations(model, setup, tricks, layout, i, counts[i]).gpu_bytes
        peak, params = max(peak, total), max(params, kept.params)
        fits = fits and total <= usable and kept.host_bytes <= host_usable
    return LayoutPeak(peak, fits, counts, params)

