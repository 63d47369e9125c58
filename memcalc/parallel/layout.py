"""Per-GPU memory when one model is split over many GPUs.

Five ways to split, composed as Megatron-LM composes them (rank order tp, cp, dp, pp: TP ranks are
neighbours, pipeline stages farthest apart):
  tp   tensor parallel: each layer's matmuls split by heads and MLP columns (Shoeybi et al. 2019)
  sp   sequence parallel: with tp, the norms and dropouts split along the sequence (Korthikanti et al. 2022)
  pp   pipeline parallel: layers in stages, micro-batches in flight (Narayanan et al. 2021)
  cp   context parallel: each sequence split over cp GPUs, K/V passed round a ring (Liu et al. 2023)
  dp   data parallel, with ZeRO stage 1/2/3 sharding (Rajbhandari et al. 2019); stage 3 is FSDP

ZeRO/FSDP shards over dp × cp, not dp alone: context-parallel ranks hold the same weights and see
other tokens of the same sequences, so their gradients are reduced together with the data-parallel
ones. Megatron-LM's distributed optimizer shards over that group (its "data parallel group with
context parallel"), and torchtitan's FSDP2 over the combined dp_shard × cp mesh dimension.
Hybrid shard (FSDP HYBRID_SHARD; Megatron-LM's distributed-optimizer instances) shards inside a node
and replicates across nodes.

Mixture-of-experts layers fold their own parallelism into the same GPUs (Megatron-LM's MoE parallel
folding): the tp · cp · dp ranks of a stage are etp · ep · edp for the routed experts. ep ranks hold
E/ep experts each (expert parallel, Lepikhin et al. 2021), etp split each expert's MLP as TP splits
a dense one, and ZeRO shards the experts' state over the edp ranks holding the same experts
(megatron/training/theoretical_memory_usage.py: expert_data_parallel_size = world / (etp · ep · pp)).

Pipeline stages hold L/p layers each when p divides L; otherwise (and always for FSDP2, as torchtitan
splits) the embedding and the head count as one layer each and the first and last stages take one layer
fewer (torchtitan/distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part); first_layers and
last_layers set the end stages as Megatron-LM's --decoder-first/last-pipeline-num-layers do.
The engine (memcalc.parallel.engines, chosen by the stack) adds its own model state, buffers and rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from memcalc.errors import InputError
from memcalc.memory.estimate import Budget, Setup
from memcalc.memory.state import MAX_GPUS, ModelState, Parallel, model_state, weights_held_elsewhere, zero3_gather_bytes
from memcalc.model.gpus import GPU
from memcalc.model.moe import routed_tokens
from memcalc.model.shape import (Model, ModelShape, attention_params, expert_params, is_moe_layer, mlp_params,
                                 mlp_params_of, moe_layer_count, mtp_params, n_params, norm_params)  # fmt: skip
from memcalc.model.tricks import Tricks, check_layer_uniform
from memcalc.terms import Term

from .engines import (
    ENGINES,
    MEGATRON,
    MEGATRON_MEMORY,
    check_engine,
    deepspeed_buffers,
    deepspeed_state,
    fsdp2_buffers,
    reshards_after_forward,
)

KORTHIKANTI_T2 = "Korthikanti et al. 2022, Table 2"


@dataclass(frozen=True)
class Layout:
    """How the GPUs of one job are arranged. world = tp · pp · cp · dp."""

    tp: int = 1  # tensor-parallel GPUs per layer
    pp: int = 1  # pipeline stages
    cp: int = 1  # context-parallel GPUs per sequence
    dp: int = 1  # data-parallel replicas
    zero: int = 0  # ZeRO stage over dp × cp: 1 optimizer state, 2 + gradients, 3 + weights (FSDP full shard)
    hybrid: bool = False  # shard inside a node, replicate across nodes (FSDP HYBRID_SHARD)
    sp: bool = False  # sequence parallel on the tp group
    vpp: int = 1  # virtual stages per GPU: the interleaved 1F1B schedule (Narayanan et al. 2021, sec. 2.2)
    offload_optimizer: bool = False  # fp32 master + moments in host memory, Adam on the CPU (ZeRO-Offload)
    offload_params: bool = False  # 16-bit weight and gradient shards in host memory too (FSDP CPUOffload)
    gpus_per_node: int = 8  # GPUs behind one NVLink switch
    ep: int = 1  # expert-parallel GPUs: each holds E/ep of a MoE layer's routed experts
    etp: int = 1  # expert tensor parallel: each expert's MLP split over etp GPUs
    first_layers: int = 0  # layers on the first pipeline stage (0: the default split)
    last_layers: int = 0  # layers on the last pipeline stage (0: the default split)
    reshard_after_forward: bool | None = None  # FSDP2: free gathered blocks after forward (None: torchtitan's default)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp", "vpp", "gpus_per_node", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_GPUS:
                raise InputError(f"{name} must be a whole number in [1, {MAX_GPUS}], got {value!r}")
        if self.world > MAX_GPUS:
            raise InputError(f"world size {self.world:,} is absurdly large (limit {MAX_GPUS:,})")
        if self.zero not in (0, 1, 2, 3):
            raise InputError(f"zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.sp and self.tp == 1:
            raise InputError("sequence parallel needs tensor parallel (tp > 1): it splits norms and dropouts over TP")
        if self.vpp > 1 and self.pp == 1:
            raise InputError("virtual pipeline stages (interleaving) need pipeline parallel (pp > 1)")
        for name in ("first_layers", "last_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPUS:
                raise InputError(f"{name} must be a whole number in [0, {MAX_GPUS}], got {value!r}")
        if (self.first_layers or self.last_layers) and self.pp == 1:
            raise InputError("layers on the first and last pipeline stages need pipeline parallel (pp > 1)")
        if self.offload_params and self.zero != 3:
            raise InputError("parameter offload needs ZeRO-3 / FSDP (DeepSpeed's offload_param is stage 3 only)")
        if self.offload_params and not self.offload_optimizer:
            raise InputError("parameter offload moves the gradients to the CPU too, so the optimizer must run "
                             "there: add optimizer offload (FSDP CPUOffload(offload_params=True))")  # fmt: skip
        if self.offload_optimizer and self.zero == 0 and self.shard_ranks > 1:
            raise InputError("optimizer offload over several data-parallel ranks needs ZeRO >= 1 "
                             "(DeepSpeed's offload_optimizer runs on ZeRO stages 1-3)")  # fmt: skip
        if self.hybrid and self.zero == 0:
            raise InputError("hybrid shard needs ZeRO >= 1: with ZeRO 0 nothing is sharded")
        if self.hybrid and (self.tp > self.gpus_per_node or self.gpus_per_node % self.tp
                            or self.shard_ranks % self.node_shard_ranks):  # fmt: skip
            raise InputError(f"hybrid shard needs whole data-parallel groups inside a node: tp {self.tp}, "
                             f"dp x cp {self.shard_ranks}, {self.gpus_per_node} GPUs per node")  # fmt: skip
        if self.hybrid and self.shard_ranks == self.node_shard_ranks:
            raise InputError(f"hybrid shard replicates across nodes, but the data-parallel group (dp x cp = "
                             f"{self.shard_ranks}) fits in one node of {self.gpus_per_node} GPUs, so nothing is "
                             "replicated: drop --hybrid")  # fmt: skip
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise InputError(f"expert parallel {self.ep} x expert tensor parallel {self.etp} must divide the "
                             f"tp x cp x dp = {self.tp * self.cp * self.dp} GPUs of a stage (Megatron-LM's MoE "
                             "parallel folding)")  # fmt: skip

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def shard_ranks(self) -> int:
        """The dp × cp ranks that hold the same weights and reduce their gradients together."""
        return self.dp * self.cp

    @property
    def node_shard_ranks(self) -> int:
        """Of those, how many sit in one node (ranks go tp first, so a node holds gpus_per_node/tp)."""
        return max(1, min(self.shard_ranks, self.gpus_per_node // self.tp))

    @property
    def shard_group(self) -> int:
        """How many ranks ZeRO/FSDP shards over: dp × cp, or its part inside a node (hybrid)."""
        if self.zero == 0:
            return 1
        return self.node_shard_ranks if self.hybrid else self.shard_ranks

    @property
    def expert_shard_ranks(self) -> int:
        """edp: the ranks of a stage that hold the same experts (tp · cp · dp / (etp · ep))."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def expert_shard_group(self) -> int:
        """How many ranks ZeRO shards the experts' state over: the edp ranks (1 without ZeRO)."""
        return 1 if self.zero == 0 else self.expert_shard_ranks

    @property
    def label(self) -> str:
        """'tp8 sp pp4 v2 cp1 dp2 zero1': every split in one short string."""
        parts = [
            f"tp{self.tp}" + (" sp" if self.sp else ""),
            f"pp{self.pp}" + (f" v{self.vpp}" if self.vpp > 1 else ""),
            f"cp{self.cp}",
            f"dp{self.dp}",
            f"zero{self.zero}" + (" hybrid" if self.hybrid else ""),
        ]
        if self.ep > 1 or self.etp > 1:
            parts.append(f"ep{self.ep}" + (f" etp{self.etp}" if self.etp > 1 else ""))
        if self.first_layers or self.last_layers:
            parts[1] += f" ({self.first_layers or '-'}/{self.last_layers or '-'})"
        if self.reshard_after_forward is not None:
            parts.append("reshard" if self.reshard_after_forward else "no reshard")
        if self.offload_params:
            parts.append("offload params+optimizer")
        elif self.offload_optimizer:
            parts.append("offload optimizer")
        return " ".join(parts)


def layout_for(gpus: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None, **rest) -> Layout:
    """The layout for --gpus N --tp --pp --cp [--dp]: dp defaults to what is left; a given world must match."""
    if dp is None:
        if gpus is None:
            dp = 1
        elif gpus % (tp * pp * cp):
            raise InputError(f"{gpus} GPUs do not split into tp {tp} x pp {pp} x cp {cp} x a whole dp")
        else:
            dp = gpus // (tp * pp * cp)
    layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp, **rest)
    if gpus is not None:
        check_world(layout, gpus)
    return layout


def check_world(layout: Layout, gpus: int) -> None:
    if layout.world != gpus:
        raise InputError(f"world size: tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp {layout.dp} = "
                         f"{layout.world}, not the {gpus} GPUs given")  # fmt: skip


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
    if layout.vpp > 1 and shape.n_layers % (layout.pp * layout.vpp):
        raise InputError(f"pipeline {layout.pp} x virtual stages {layout.vpp} must divide the {shape.n_layers} layers")
    layers_per_stage(layout, shape.n_layers, engine)
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
    experts over GPUs is laid out as Megatron-LM folds it, on the reference engine and L/p layers a stage."""
    if moe_layer_count(shape) and layout.world > 1:
        if engine != "none":
            raise InputError(f"a mixture of experts over GPUs is modelled on the reference stack's engine, not {engine}'s "
                             "(--stack reference)")  # fmt: skip
        if layout.first_layers or layout.last_layers or shape.n_layers % layout.pp:
            raise InputError(f"a mixture of experts needs pipeline {layout.pp} to divide its {shape.n_layers} layers "
                             "evenly (no uneven stages)")  # fmt: skip
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


# ---- layers per pipeline stage ---------------------------------------------------------------


def layers_per_stage(layout: Layout, n_layers: int, engine: str = "none") -> tuple[int, ...]:
    """The transformer layers on each pipeline stage, first to last."""
    weighted = ENGINES[engine].weighted_split and layout.vpp == 1
    return stage_layers(layout.pp, layout.first_layers, layout.last_layers, n_layers, weighted)


@lru_cache(maxsize=4096)
def stage_layers(pp: int, first: int, last: int, n_layers: int, weighted: bool = False) -> tuple[int, ...]:
    """Layers per stage. first/last given: Megatron-LM's uneven split, the middle stages sharing the rest
    evenly (megatron/core/transformer/transformer_block.py get_num_layers_to_build). Else L/p each when p
    divides L and the split is not weighted; else torchtitan's: the embedding and the head weigh one layer
    each, L + 2 are dealt out evenly, the first stages taking the remainder, and the end stages give up one
    layer each for them (torchtitan/distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part)."""
    if pp == 1:
        return (n_layers,)
    if first or last:
        return megatron_split(pp, first, last, n_layers)
    if not weighted and n_layers % pp == 0:
        return (n_layers // pp,) * pp
    base, extra = divmod(n_layers + 2, pp)
    counts = [base + (i < extra) - (i == 0) - (i == pp - 1) for i in range(pp)]
    if min(counts) < 1:
        raise InputError(f"pipeline {pp} leaves a stage without layers: {n_layers} layers, with the embedding and "
                         f"the head counted as one layer each, give fewer than 2 per stage")  # fmt: skip
    return tuple(counts)


def megatron_split(pp: int, first: int, last: int, n_layers: int) -> tuple[int, ...]:
    """--decoder-first-pipeline-num-layers F, --decoder-last-pipeline-num-layers L: the stages between share
    what is left evenly (Megatron-LM asserts it divides)."""
    ends = (first > 0) + (last > 0)
    rest, middle = n_layers - first - last, pp - ends
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest // middle == 0)):
        given = " and ".join(x for x in (f"{first} layers on the first stage" if first else "",
                                         f"{last} on the last" if last else "") if x)  # fmt: skip
        raise InputError(f"{given}: the other {middle} stages cannot share the remaining {rest} of the {n_layers} "
                         "layers evenly (Megatron-LM's uneven pipeline split)")  # fmt: skip
    each = rest // middle if middle else 0
    return tuple(first if i == 0 and first else last if i == pp - 1 and last else each for i in range(pp))


# ---- parameters on one GPU ------------------------------------------------------------------


def tp_layer_params(shape: ModelShape, tp: int) -> int:
    """One layer's parameters on one TP rank (Shoeybi et al. 2019, sec. 3).

    Column-parallel, split by tp: W_q, W_k, W_v and their biases; the MLP's W_in (W_gate, W_up) and biases.
    Row-parallel, split by tp: W_o, W_down; their biases are replicated. Norms and q/k-norms are replicated.
    """
    replicated = 2 * norm_params(shape) + (2 * shape.head_dim if shape.qk_norm else 0)
    if shape.linear_bias:
        replicated += 2 * shape.hidden  # output-projection and W_down biases
    split = attention_params(shape) + mlp_params(shape) + 2 * norm_params(shape) - replicated
    return split // tp + replicated


def tp_moe_layer_params(shape: ModelShape, tp: int) -> int:
    """A MoE layer's parameters on one TP rank, its routed experts apart (expert_gpu_params): attention split as
    a dense layer's (latent attention's down projections and their norms replicated, as Megatron-LM's MLA), the
    shared experts split like an MLP, the router and the norms replicated."""
    replicated = 2 * norm_params(shape) + shape.hidden * shape.n_experts + (2 * shape.head_dim if shape.qk_norm else 0)
    if shape.is_mla:  # q_a, kv_a and their norms on every TP rank
        norm = 2 if shape.norm == "layernorm" else 1
        replicated += shape.q_lora_rank * (shape.hidden + norm) + shape.hidden * (shape.kv_lora_rank + shape.qk_rope_head_dim)
        replicated += norm * shape.kv_lora_rank
    shared = mlp_params_of(shape, shape.shared_ffn) if shape.n_shared_experts else 0
    split = attention_params(shape) + shared + 2 * norm_params(shape) + shape.hidden * shape.n_experts - replicated
    return split // tp + replicated


@lru_cache(maxsize=4096)
def moe_split(shape: ModelShape, pp: int, stage: int) -> tuple[int, int]:
    """(dense layers, MoE layers) of one pipeline stage's L/p consecutive layers."""
    per = shape.n_layers // pp
    moe = sum(is_moe_layer(shape, i) for i in range(stage * per, (stage + 1) * per))
    return per - moe, moe


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
    state = model_state(params, precision, optimizer, Parallel(shard_group, zero, offload_optimizer), recipe)
    if offload_params:
        parts = tuple(replace(p, on_host=True) if p.name in ("weights", "grads") else p for p in state.parts)
        state = replace(state, parts=parts)
    return state


# ---- activations of one layer -----------------------------------------------------------------


@dataclass(slots=True)
class LayerActivations:
    """One layer, one micro-batch, one GPU: the bytes kept for backward and those rebuilt in it."""

    tricks: Tricks
    tp: int
    sp: bool
    cp: int
    terms: tuple[Term, ...]
    rebuilt: tuple[Term, ...]

    @property
    def per_layer_bytes(self) -> int:
        return sum(t.value for t in self.terms)

    @property
    def rebuilt_bytes(self) -> int:
        return sum(t.value for t in self.rebuilt)


@lru_cache(maxsize=4096)
def layer_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks,
                      tp: int = 1, sp: bool = False, cp: int = 1, engine: str = "none") -> LayerActivations:  # fmt: skip
    """Korthikanti et al. 2022, Table 2, per layer, with the sequence split over cp.

      TP          s·b·h·(10 + 24/t + 5·a·s/(h·t))
      TP+SP       (s·b·h/t)·(34 + 5·a·s/h)
      TP+selective   s·b·h·(10 + 24/t);   TP+SP+selective  34·s·b·h/t
      full recompute 2·s·b·h (the layer input; /t with SP, where the input is sequence-split)
    10·s·b·h are replicated on every TP rank without SP: both LayerNorm inputs (4), the QKV and MLP
    inputs (2 + 2), the two dropout masks (1 + 1). 24·s·b·h split with the heads: Q, K (4), V (2),
    the output-projection input (2), the GeLU input and output (8 + 8). FlashAttention drops the
    5·a·s²·b/t scores as selective recompute does. With t = cp = 1 these are activations.py's terms.

    Megatron-LM's own formula (theoretical_memory_usage.py compute_activation_memory) writes the MLP's
    16·s·b·h as 4·s·b·f, for any MLP width f: s·b·h·(18 + 4·f/h)/t with SP and selective recompute; the
    megatron engine charges that (equal to Table 2 at f = 4h).
    """
    check_layer_uniform(tricks, "the parallel layouts")
    x = 2 if tricks.precision == "fp32" else 1  # fp32 activations double every byte
    s, b, h, a, t = seq_len // cp, micro_batch, shape.hidden, shape.n_heads, tp
    sbh = s * b * h
    rep = t if sp else 1
    sym = "{s}·{b}·{h}" if cp == 1 else "({s}/{c})·{b}·{h}"
    by_t, by_rep = ("/{t}" if t > 1 else ""), ("/{t}" if rep > 1 else "")
    k = "2·" if x == 2 else ""
    where = " (split by SP)" if sp else " (replicated on TP ranks)"
    replicated = Term("norm inputs, QKV and MLP inputs, dropout masks", x * 10 * sbh // rep,
                      f"{k}10·{sym}{by_rep}", KORTHIKANTI_T2 + where)  # fmt: skip
    split = Term("Q, K, V, projection input, GeLU in/out", x * 24 * sbh // t, f"{k}24·{sym}{by_t}", KORTHIKANTI_T2)
    if engine == "megatron":
        sbf = s * b * shape.ffn
        sym_f = "{s}·{b}·{f}" if cp == 1 else "({s}/{c})·{b}·{f}"
        split = Term("Q, K, V, projection input (8·s·b·h), MLP activation in/out (4·s·b·f)",
                     x * (8 * sbh + 4 * sbf) // t, f"{k}(8·{sym} + 4·{sym_f}){by_t}",
                     f"{MEGATRON} {MEGATRON_MEMORY} compute_activation_memory: 18 + 4·f/h")  # fmt: skip
    s_sq = "{s}²" if cp == 1 else "({s}/{c})²"
    scores = Term("attention s×s (softmax, mask, dropout)", x * 5 * a * s * s * b // t,
                  f"{k}5·{{a}}·{s_sq}·{{b}}{by_t}", KORTHIKANTI_T2)  # fmt: skip
    layer_input = Term("layer input (checkpoint)", x * 2 * sbh // rep, f"{k}2·{sym}{by_rep}",
                       "Korthikanti et al. 2022, sec. 5 and Table 2")  # fmt: skip
    linear = (replicated, split)
    full_layer = linear if tricks.flash else (replicated, split, scores)
    if tricks.recompute == "full":
        return LayerActivations(tricks, tp, sp, cp, (layer_input,), full_layer)
    if tricks.recompute == "selective" and not tricks.flash:
        return LayerActivations(tricks, tp, sp, cp, linear, (scores,))
    return LayerActivations(tricks, tp, sp, cp, full_layer, ())


@lru_cache(maxsize=4096)
def moe_layer_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout,
                          routing) -> LayerActivations:  # fmt: skip
    """A MoE layer on one GPU of the layout: attention and norms as Korthikanti's Table 2 (the MLP's parts left
    out, latent attention's per-head tensors split by tp), then the MoE block of memcalc.memory.moe on this
    GPU's T = (s/c)·b/t tokens (sequence parallel) and the R tokens its E/ep experts receive (routed_tokens
    over the ep group; etp times as many with expert TP, each expert's MLP 1/etp wide)."""
    from memcalc.memory.moe import latent_attention_term

    x = 2 if tricks.precision == "fp32" else 1
    t, sp, c, h, E, k = layout.tp, layout.sp, layout.cp, shape.hidden, shape.n_experts, shape.experts_per_token
    s, b = seq_len // c, micro_batch
    sbh, rep = s * b * h, t if sp else 1
    if shape.is_mla:  # input and latents replicated, the per-head Q, K, V and projection input split
        mla = latent_attention_term(shape, s, b, x).value
        heads = x * s * b * (4 * shape.n_heads * shape.head_dim + 4 * shape.n_heads * shape.v_dim)
        linear = (mla - heads) // rep + heads // t
    else:  # 11sbh: its input and dropout mask replicated (3), Q, K, V and the projection input split (8)
        linear = x * 3 * sbh // rep + x * 8 * sbh // t
    attention = Term("attention (linear part) and norms", linear + x * 4 * sbh // rep, "", KORTHIKANTI_T2)
    scores = Term("attention s×s (softmax, mask, dropout)", x * 5 * shape.n_heads * s * s * b // t, "", KORTHIKANTI_T2)
    T = s * b // rep  # tokens this GPU routes
    R = routed_tokens(shape, T, routing, layout.ep) * layout.etp  # tokens its experts compute
    w = 2 * x
    per_token = 8 if shape.gated_mlp else 4
    fp32 = 4 * T * h if shape.router_fp32 and x == 1 else 0
    moe = Term("MoE: router, top-k, tokens received, experts, combine, shared experts",
               w * T * h + 4 * T * E + fp32 + 12 * T * k + 8 * T * k + w * R * h + x * per_token * R * shape.routed_ffn
               // layout.etp + w * T * k * h + w * T * k + 8 * T * k + x * 8 * T * shape.shared_ffn // t,
               "", "memcalc.memory.moe on this GPU's tokens (docs/moe.md)")  # fmt: skip
    layer_input = Term("layer input (checkpoint)", x * 2 * sbh // rep, "", "Korthikanti et al. 2022, sec. 5")
    linear_terms = (attention, moe)
    full_layer = linear_terms if tricks.flash else (attention, scores, moe)
    if tricks.recompute == "full":
        return LayerActivations(tricks, t, sp, c, (layer_input,), full_layer)
    if tricks.recompute == "selective" and not tricks.flash:
        return LayerActivations(tricks, t, sp, c, linear_terms, (scores,))
    return LayerActivations(tricks, t, sp, c, full_layer, ())


@lru_cache(maxsize=1024)
def ep_buffers(shape: ModelShape, seq_len: int, micro_batch: int, layout: Layout, act_bytes: int, routing) -> Term:
    """The all-to-all's buffers, one MoE layer at a time: this GPU's T·k routed token copies going out and the R
    coming in (Megatron-LM's MoEAlltoAllTokenDispatcher permutes, then all-to-alls into a new tensor)."""
    T = seq_len // layout.cp * micro_batch // (layout.tp if layout.sp else 1)
    R = routed_tokens(shape, T, routing, layout.ep)
    value = (T * shape.experts_per_token + R) * shape.hidden * act_bytes
    return Term("EP all-to-all send + receive buffers", value, f"(T·k + R)·{{h}}·{act_bytes}",
                "Megatron-LM MoEAlltoAllTokenDispatcher")  # fmt: skip


def with_experts(state: ModelState, experts: ModelState) -> ModelState:
    """One GPU's model state with its routed experts' added part by part (each part keeps its bytes per
    parameter; the experts are sharded over their own edp group)."""
    by_name = {p.name: p for p in experts.parts}
    parts = tuple(replace(p, bytes=p.bytes + by_name[p.name].bytes, formula=p.formula + " + experts")
                  if p.name in by_name and p.name != "loss_scale" else p for p in state.parts)  # fmt: skip
    return replace(state, params=state.params + experts.params, parts=parts)


def held_layers(layout: Layout, stage: int, micro_batches: int, n_layers: int, layers: int | None = None) -> int:
    """Layer-micro-batches whose activations a stage keeps at its peak (Korthikanti et al. 2022, sec. 4.2.3).

    1F1B: stage i runs min(p − i, m) forwards before its first backward, so stage 0 holds p micro-batches
    of its L/p layers: L layers' worth, whatever p. Interleaved with v virtual stages: Megatron-LM's
    warm-up of 2(p − i − 1) + (v − 1)·p chunks + 1, each of L/(p·v) layers; for stage 0 that is
    L·(1 + (p − 1)/(p·v)) layers' worth, Korthikanti's interleaving factor. layers: this stage's
    (uneven splits run 1F1B only).
    """
    p, v, m = layout.pp, layout.vpp, micro_batches
    if v == 1:
        return min(p - stage, m) * (n_layers // p if layers is None else layers)
    chunks = 2 * (p - stage - 1) + (v - 1) * p + 1
    return min(chunks, m * v) * (n_layers // (p * v))


# ---- transient buffers and logits ---------------------------------------------------------------


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


# ---- one GPU of one stage, and the whole layout ---------------------------------------------------


@dataclass(slots=True)
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


@dataclass(slots=True)
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
        host_usable_bytes=setup.host_memory // min(layout.world, layout.gpus_per_node),
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
    state = sharded_state(params, tricks.precision, s.optimizer, layout.shard_group, layout.zero,
                          layout.offload_optimizer, layout.offload_params, s.stack.recipe)  # fmt: skip
    if experts:
        state = with_experts(state, sharded_state(experts, tricks.precision, s.optimizer, layout.expert_shard_group,
                                                  layout.zero, layout.offload_optimizer, layout.offload_params,
                                                  s.stack.recipe))  # fmt: skip
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
        buffers.append(ep_buffers(shape, s.seq_len, s.micro_batch, layout, tricks.act_bytes, s.routing))
    logits = ()
    if last:
        logits = logits_terms(shape, s.seq_len, s.micro_batch, tricks.precision, layout.tp, layout.cp)
        logits *= 1 + shape.mtp_layers
    return StageMemory(
        stage=stage, layers=per + (shape.mtp_layers if last else 0), params=params + experts, state=state,
        layer=layer_activations(shape, s.seq_len, s.micro_batch, tricks, layout.tp, layout.sp, layout.cp),
        held=-(-held * dense // per), buffers=tuple(buffers), logits=logits, usable_bytes=gpu.usable_bytes,
        host_usable_bytes=s.host_memory // min(layout.world, layout.gpus_per_node),
        moe_layer=moe_layer_activations(shape, s.seq_len, s.micro_batch, tricks, layout, s.routing),
        moe_held=-(-held * moe // per), expert_params=experts,
    )  # fmt: skip


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
def megatron_inputs(shape: ModelShape, seq_len: int, micro_batch: int, tp: int, sp: bool, cp: int, held: int,
                    layers: int) -> tuple[Term, ...]:  # fmt: skip
    """The first stage's activations outside the layers, for each micro-batch in flight (held / layers of
    them: p under 1F1B, p·(1 + (p − 1)/(p·v)) interleaved), as Megatron-LM's formula counts them
    (theoretical_memory_usage.py compute_activation_memory): the token ids, int64 (8·s·b; not split over
    TP), and the embedding dropout's mask (s·b·h bytes, split by SP; only with dropout)."""
    s, b = seq_len // cp, micro_batch
    sym = "{s}·{b}" if cp == 1 else "({s}/{c})·{b}"
    source = f"{MEGATRON} {MEGATRON_MEMORY} compute_activation_memory, first stage"
    flight = f"·{held // layers}" if held % layers == 0 else f"·{held}/{layers}"
    out = [Term("token ids (int64), each micro-batch in flight", 8 * s * b * held // layers, f"8·{sym}{flight}",
                source)]  # fmt: skip
    if shape.dropout > 0:
        rep = tp if sp else 1
        by = "/{t}" if rep > 1 else ""
        out.append(Term("embedding dropout mask, each micro-batch in flight", s * b * shape.hidden // rep * held // layers,
                        f"{sym}·{{h}}{by}{flight}", source))  # fmt: skip
    return tuple(out)


@dataclass(frozen=True, slots=True)
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


def bubble_fraction(layout: Layout, micro_batches: int) -> float:
    """Pipeline idle over busy time: (p − 1)/m, and (p − 1)/(v·m) interleaved (Narayanan et al. 2021, sec. 2.2)."""
    return (layout.pp - 1) / (layout.vpp * micro_batches)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
