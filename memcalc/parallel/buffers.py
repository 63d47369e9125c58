"""The transient memory of one GPU of a layout, beside its model state and activations: the engine's
gathered layers and buckets (engine_buffers, ZeRO-3's zero3_buffers), context parallel's ring K/V buffers
(cp_buffers), expert parallel's all-to-all buffers (ep_buffers), and the last stage's logits (logits_terms)."""

from __future__ import annotations

from functools import lru_cache

from memcalc.memory.state import ModelState, weights_held_elsewhere, zero3_gather_bytes
from memcalc.model.layout import Layout
from memcalc.model.moe import routed_tokens
from memcalc.model.shape import Model, ModelShape, norm_params
from memcalc.model.tricks import Tricks
from memcalc.terms import Term

from .engines import deepspeed_buffers, fsdp2_buffers, reshards_after_forward
from .params import tp_layer_params


def engine_buffers(model: Model, tricks: Tricks, layout: Layout, state: ModelState, stage: int, layers: int,
                   engine: str) -> tuple[Term, ...]:  # fmt: skip
    """The transient buffers of the stack's engine on one GPU of a stage (memcalc.parallel.engines)."""
    stage_params = state.params
    shape, tp, p = model.shape, layout.tp, layout.pp
    w = 4 if tricks.precision == "fp32" else 2  # the weights' and gradients' dtype while computing
    if engine == "deepspeed":
        return deepspeed_buffers(shape, tp, layout.zero, w, stage == 0, stage == p - 1, p, layers, layout.shard_group)
    if layout.zero != 3 or not (layout.shard_group > 1 or layout.offload_params):
        return ()
    if engine == "fsdp2":
        head = 0
        if stage == p - 1 and (not shape.tied_embeddings or p > 1):
            head = -(-shape.vocab // tp) * shape.hidden + norm_params(shape)
        return fsdp2_buffers(tp_layer_params(shape, tp), layers, head, w, reshards_after_forward(layout),
                             stage_params, p > 1)  # fmt: skip
    return (zero3_buffers(shape, tp, tricks.precision, weights_held_elsewhere(state)),)


@lru_cache(maxsize=1024)
def zero3_buffers(shape: ModelShape, tp: int, precision: str, held_elsewhere: int) -> Term:
    """ZeRO-3/FSDP working memory of one TP shard: see memcalc.memory.state.zero3_gather_bytes."""
    p_layer = tp_layer_params(shape, tp)
    value = zero3_gather_bytes(p_layer, shape.n_layers, precision, held_elsewhere)
    source = "FSDP2 fully_shard: one module's all-gather prefetched ahead"
    if value == held_elsewhere:  # a model this shallow is gathered whole: its weights held on other ranks
        return Term("ZeRO-3 gathered layers (the whole model: the weights held elsewhere)", value,
                    "w·P_GPU − this GPU's weights", source)  # fmt: skip
    if shape.n_layers == 1:
        return Term("ZeRO-3 gathered layers (1 weight + 1 gradient)", value, "2·w·P_layer/{t}", source)
    return Term("ZeRO-3 gathered layers (2 weights + 1 gradient)", value, "3·w·P_layer/{t}", source)


@lru_cache(maxsize=1024)
def cp_buffers(shape: ModelShape, seq_len: int, micro_batch: int, tp: int, cp: int, act_bytes: int) -> Term:
    """Ring attention's K/V exchange buffers, one layer at a time (Liu et al. 2023; TransformerEngine's
    AttnFuncWithCPAndKVP2P): in backward each rank holds a K/V chunk arriving and one leaving, and the same
    for their gradients: 4 chunks of 2·(s/cp)·b·(kv heads·d)/t elements.
    """
    kv_chunk = 2 * (seq_len // cp) * micro_batch * shape.kv_dim // tp * act_bytes
    formula = f"4·2·({{s}}/{{c}})·{{b}}·{{k}}·{{d}}/{{t}}·{act_bytes}"
    return Term("CP ring K/V send + receive buffers (and their gradients)", 4 * kv_chunk, formula,
                "Liu et al. 2023 (ring attention)")  # fmt: skip


@lru_cache(maxsize=1024)
def ep_buffers(shape: ModelShape, seq_len: int, micro_batch: int, tp: int, sp: bool, cp: int, ep: int, act_bytes: int,
               routing) -> Term:  # fmt: skip
    """The all-to-all's buffers, one MoE layer at a time: this GPU's T·k routed token copies going out and the R
    coming in (Megatron-LM's MoEAlltoAllTokenDispatcher permutes, then all-to-alls into a new tensor)."""
    T = seq_len // cp * micro_batch // (tp if sp else 1)
    R = routed_tokens(shape, T, routing, ep)
    value = (T * shape.experts_per_token + R) * shape.hidden * act_bytes
    return Term("EP all-to-all send + receive buffers", value, f"(T·k + R)·{{h}}·{act_bytes}",
                "Megatron-LM MoEAlltoAllTokenDispatcher")  # fmt: skip


@lru_cache(maxsize=1024)
def logits_terms(shape: ModelShape, seq_len: int, micro_batch: int, precision: str, tp: int,
                 cp: int) -> tuple[Term, ...]:  # fmt: skip
    """The last stage's logits for one micro-batch: vocab split over tp (Megatron's vocab-parallel
    cross-entropy keeps its fp32 logits split too), tokens over cp. At tp = cp = 1: activations.logits_memory."""
    tokens_vocab = (seq_len // cp) * micro_batch * -(-shape.vocab // tp)
    v = "{v}" if tp == 1 else "⌈{v}/{t}⌉"
    s = "{s}" if cp == 1 else "({s}/{c})"
    if precision == "fp32":
        return (Term("logits (fp32)", 4 * tokens_vocab, f"4·{{b}}·{s}·{v}", "lm_head output, vocab-parallel"),)
    upcast = "logits fp32 upcast for cross-entropy"
    return (
        Term("logits (16-bit)", 2 * tokens_vocab, f"2·{{b}}·{s}·{v}", "lm_head output, vocab-parallel"),
        Term(upcast, 4 * tokens_vocab, f"4·{{b}}·{s}·{v}", "vocab-parallel cross-entropy"),
    )
