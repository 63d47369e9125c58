"""The layout: how the GPUs of one job split one model, and what it demands of itself.

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

This is the one record of how a job's GPUs are laid out: one GPU is Layout(), --gpus N alone is
Layout(dp=N). What a layout holds and how long its step takes are memcalc.parallel's (checks, pipeline,
params, activations, buffers, stage_memory, comm); the textbook's model state shards as the layout says
(memcalc.memory.state.state_sharding).
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

from .sizes import MAX_GPUS


@record(frozen=True)
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
    def groups(self) -> tuple[int, ...]:
        """The parallel groups' sizes: an NCCL communicator each where more than one (memcalc.model.headroom)."""
        return (self.tp, self.cp, self.pp, self.dp, self.ep)

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


ONE_GPU = Layout()


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
