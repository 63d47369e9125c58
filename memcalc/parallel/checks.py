"""What a model, its sequence, the schedule and the stack's engine demand of a layout (check_layout), a
mixture of experts' among them (check_experts): one InputError line each. What a layout demands of itself
(its sizes, ZeRO, sequence parallel, offload, hybrid shard, the MoE folding) Layout checks when built."""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.model.layout import Layout
from memcalc.model.shape import ModelShape, moe_layer_count
from memcalc.model.tricks import Tricks

from .engines import check_engine
from .pipeline import layers_per_stage


def check_layout(layout: Layout, shape: ModelShape, seq_len: int, tricks: Tricks, micro_batches: int,
                 engine: str = "none") -> None:  # fmt: skip
    """What the model, the sequence, the schedule and the engine demand of a layout; one InputError line each."""
    check_engine(layout, engine)
    t, s = layout.tp, seq_len
    if shape.n_heads % t:
        raise InputError(f"tensor parallel {t} must divide the {shape.n_heads} attention heads")
    if shape.n_kv_heads % t:
        raise InputError(
            f"tensor parallel {t} must divide the {shape.n_kv_heads} KV heads (each rank keeps whole KV heads)"
        )
    if shape.ffn % t and moe_layer_count(shape) < shape.n_layers:
        raise InputError(f"tensor parallel {t} must divide the MLP width {shape.ffn}")
    check_experts(layout, shape, engine)
    layers_per_stage(layout, shape.n_layers, engine)  # the engine's split, or why it cannot split them
    if layout.vpp > 1 and micro_batches % layout.pp:
        raise InputError(f"the interleaved schedule needs the micro-batches per step ({micro_batches}) "
                         f"to be a multiple of pp ({layout.pp}) (Megatron-LM)")  # fmt: skip
    if layout.cp > 1 and not tricks.flash:
        raise InputError("context parallel needs flash attention: ring attention runs on the flash kernels")
    if layout.cp > 1 and s % (2 * layout.cp):
        raise InputError(f"context parallel {layout.cp} needs the sequence ({s}) divisible by 2·cp "
                         "(Megatron-LM splits it in 2·cp chunks to balance causal attention)")  # fmt: skip
    if layout.sp and (s // layout.cp) % t:
        raise InputError(f"sequence parallel needs the tokens per CP rank ({s // layout.cp}) divisible by tp ({t})")


def check_experts(layout: Layout, shape: ModelShape, engine: str = "none") -> None:
    """What expert parallelism demands of the model: experts to split, whole experts per GPU. A mixture of
    experts over GPUs is laid out as Megatron-LM folds it, on the reference engine or Megatron-LM's (its
    recipe's state, the distributed optimizer over dp and, for the experts, over their edp), its stages split
    as a dense model's (pipeline.stage_layers)."""
    if moe_layer_count(shape) and layout.world > 1:
        if engine not in ("none", "megatron"):
            raise InputError(f"a mixture of experts over GPUs is modelled on the reference stack's engine and "
                             f"Megatron-LM's, not {engine}'s (--stack reference or megatron)")  # fmt: skip
        if layout.first_layers or layout.last_layers:
            raise InputError("a mixture of experts splits its layers as memcalc's engine does (L/p a stage, else "
                             "the embedding and head weighed as a layer each): no --pp-layers")  # fmt: skip
    if layout.ep == layout.etp == 1:
        return
    if not moe_layer_count(shape):
        raise InputError("expert parallel (--ep, --etp) splits a mixture of experts; this model has none")
    if shape.n_experts % layout.ep:
        raise InputError(f"expert parallel {layout.ep} must divide the {shape.n_experts} experts (whole experts per GPU)")
    if shape.routed_ffn % layout.etp:
        raise InputError(f"expert tensor parallel {layout.etp} must divide the experts' MLP width {shape.routed_ffn}")
    if layout.tp > 1 and not layout.sp:
        raise InputError("MoE layers with tensor parallel need sequence parallel (--sp): Megatron-LM dispatches each "
                         "TP rank's share of the tokens")  # fmt: skip
