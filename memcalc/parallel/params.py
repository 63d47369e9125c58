"""The parameters one GPU of a layout holds and their model state: one layer's on one TP rank (dense and
MoE), the routed experts' (E/ep experts, 1/etp of each), a pipeline stage's with the embedding and the head
(stage_shape_params, gpu_params, stage_weights), and ZeRO's sharding of their state over the shard group,
the experts' over their own edp group (sharded_state, with_experts)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from memcalc.memory.state import ModelState, StateSharding, model_state
from memcalc.model.layout import Layout
from memcalc.model.params import block_norm_params
from memcalc.model.shape import (
    Model,
    ModelShape,
    attention_params,
    expert_params,
    is_moe_layer,
    mlp_params,
    mlp_params_of,  # fmt: skip
    moe_layer_count,
    mtp_params,
    n_params,
    norm_params,
)
from memcalc.records import record

from .pipeline import layers_per_stage, moe_split


def tp_layer_params(shape: ModelShape, tp: int) -> int:
    """One layer's parameters on one TP rank (Shoeybi et al. 2019, sec. 3).

    Column-parallel, split by tp: W_q, W_k, W_v and their biases; the MLP's W_in (W_gate, W_up) and biases.
    Row-parallel, split by tp: W_o, W_down; their biases are replicated. Norms and q/k-norms are replicated.
    """
    replicated = block_norm_params(shape)
    if shape.linear_bias:
        replicated += 2 * shape.hidden  # output-projection and W_down biases
    split = attention_params(shape) + mlp_params(shape) + shape.norms_per_layer * norm_params(shape) - replicated
    return split // tp + replicated


def tp_moe_layer_params(shape: ModelShape, tp: int) -> int:
    """A MoE layer's parameters on one TP rank, its routed experts apart (expert_gpu_params): attention split as
    a dense layer's (latent attention's down projections and their norms replicated, as Megatron-LM's MLA), the
    shared experts split like an MLP, the router and the norms replicated."""
    replicated = block_norm_params(shape) + shape.hidden * shape.n_experts
    if shape.is_mla:  # q_a, kv_a and their norms on every TP rank
        norm = 2 if shape.norm == "layernorm" else 1
        replicated += shape.q_lora_rank * (shape.hidden + norm) + shape.hidden * (shape.kv_lora_rank + shape.qk_rope_head_dim)
        replicated += norm * shape.kv_lora_rank
    shared = mlp_params_of(shape, shape.shared_ffn) if shape.n_shared_experts else 0
    split = (attention_params(shape) + shared + shape.norms_per_layer * norm_params(shape) + shape.hidden * shape.n_experts
             - replicated)  # fmt: skip
    return split // tp + replicated


def expert_gpu_params(shape: ModelShape, layout: Layout, stage: int) -> int:
    """The routed experts one GPU holds: E/ep experts of each MoE layer on its stage, each 1/etp of its MLP
    (megatron/training/theoretical_memory_usage.py expert_sharded_params / (etp · ep)); the MTP module's, a MoE
    block, on the last stage."""
    if not moe_layer_count(shape):
        return 0
    layers = moe_split(shape, layout.pp, stage)[1]
    if stage == layout.pp - 1 and shape.mtp_layers and is_moe_layer(shape, shape.n_layers - 1):
        layers += shape.mtp_layers
    return layers * (shape.n_experts // layout.ep) * expert_params(shape) // layout.etp


def stage_shape_params(shape: ModelShape, tp: int, pp: int, stage: int, layers: int | None = None) -> int:
    """The shape's parameters on one GPU of a pipeline stage.

    Stage 0 holds the token embedding (vocab split over tp, Megatron's VocabParallelEmbedding) and the
    learned positions (replicated); the last stage the final norm and the output layer, vocab split.
    With tied embeddings and pp > 1 the last stage keeps its own copy of the embedding (Megatron-LM
    all-reduces the two copies' gradients); with pp = 1 the one table serves both.
    """
    layers = (shape.n_layers // pp if layers is None else layers) * tp_layer_params(shape, tp)
    if moe_layer_count(shape):  # dense and MoE layers (routed experts apart), and the MTP module on the last stage
        dense, moe = moe_split(shape, pp, stage)
        layers = dense * tp_layer_params(shape, tp) + moe * tp_moe_layer_params(shape, tp)
        if stage == pp - 1 and shape.mtp_layers:
            experts = shape.n_experts * expert_params(shape) if is_moe_layer(shape, shape.n_layers - 1) else 0
            layers += shape.mtp_layers * (mtp_params(shape) - experts) // tp
    vocab_rows = -(-shape.vocab // tp) * shape.hidden
    first, last = stage == 0, stage == pp - 1
    extra = 0
    if first:
        extra += vocab_rows + (shape.max_positions * shape.hidden if shape.positions == "learned" else 0)
    if last:
        extra += norm_params(shape)
        if not shape.tied_embeddings or pp > 1:
            extra += vocab_rows
    return layers + extra


@lru_cache(maxsize=4096)
def gpu_params(model: Model, tp: int, pp: int, stage: int, layers: int | None = None) -> int:
    """Parameters one GPU holds before ZeRO sharding; with --params N the shape's share of N (rounded up)."""
    own = n_params(model.shape)
    return -(-stage_shape_params(model.shape, tp, pp, stage, layers) * model.n_params // own)


@lru_cache(maxsize=4096)
def sharded_state(params: int, precision: str, optimizer: str, shard_group: int, zero: int,
                  offload_optimizer: bool, offload_params: bool, recipe: str = "master") -> ModelState:  # fmt: skip
    """ZeRO over the shard group (Rajbhandari et al. 2019, sec. 5); offload marks parts as host memory.

    Parameter offload (FSDP CPUOffload(offload_params=True)) puts the weight and gradient shards on the host.
    """
    state = model_state(params, precision, optimizer, StateSharding(shard_group, zero, offload_optimizer), recipe)
    if offload_params:
        parts = tuple(replace(p, on_host=True) if p.name in ("weights", "grads") else p for p in state.parts)
        state = replace(state, parts=parts)
    return state


@lru_cache(maxsize=4096)  # the planner asks for the same few states for every layout
def moe_sharded_state(params: int, experts: int, precision: str, optimizer: str, shard_group: int,
                      expert_shard_group: int, zero: int, offload_optimizer: bool, offload_params: bool,
                      recipe: str = "master") -> ModelState:  # fmt: skip
    """sharded_state of one GPU's non-expert parameters over the shard group, its routed experts' over
    their own (expert_shard_group), added part by part (with_experts)."""
    state = sharded_state(params, precision, optimizer, shard_group, zero, offload_optimizer, offload_params, recipe)
    if not experts:
        return state
    return with_experts(state, sharded_state(experts, precision, optimizer, expert_shard_group, zero,
                                             offload_optimizer, offload_params, recipe))  # fmt: skip


def with_experts(state: ModelState, experts: ModelState) -> ModelState:
    """One GPU's model state with its routed experts' added part by part (each part keeps its bytes per
    parameter; the experts are sharded over their own edp group)."""
    by_name = {p.name: p for p in experts.parts}
    parts = tuple(replace(p, bytes=p.bytes + by_name[p.name].bytes, formula=p.formula + " + experts")
                  if p.name in by_name and p.name != "loss_scale" else p for p in state.parts)  # fmt: skip
    return replace(state, params=state.params + experts.params, parts=parts)


@record(frozen=True, slots=True)
class StageWeights:
    """The parameters one GPU of a stage holds before ZeRO sharding, its routed experts' among them."""

    params: int
    expert_params: int


def stage_weights(model: Model, layout: Layout, engine: str = "none") -> tuple[StageWeights, ...]:
    """Every stage's weights per GPU, as stage_memory counts them (its params and expert_params), without
    the activations: what a step's time needs where the per-layer textbook has no formula (ckpt:N, sac)."""
    shape = model.shape
    counts = layers_per_stage(layout, shape.n_layers, engine)
    if moe_layer_count(shape):
        return tuple(StageWeights(gpu_params(model, layout.tp, layout.pp, i) + (e := expert_gpu_params(shape, layout, i)), e)
                     for i in range(layout.pp))  # fmt: skip
    return tuple(StageWeights(gpu_params(model, layout.tp, layout.pp, i, n), 0) for i, n in enumerate(counts))
