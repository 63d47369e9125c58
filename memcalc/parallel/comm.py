"""Bytes each GPU moves per training step, their time on the interconnect, and the step time of a layout.

The collectives' bytes and links: memcalc.parallel.links; expert parallel's: memcalc.parallel.experts; the
data-parallel and offload traffic: memcalc.parallel.data_parallel. Here: the tp, cp and pp traffic.

Step time: every stage's compute is the roofline of the kernels its GPU runs (memcalc.time.roofline
stage_kernels: one block traced on the shapes one TP rank holds, the tokens one CP rank holds, SP's
sequence-split norms, the optimizer over its shard), the same kernels the one-GPU estimate times, so a
layout of one GPU takes the one-GPU step time. A pipeline of p stages and m micro-batches takes
(m + (p − 1)/v) times the slowest stage's time per micro-batch (Narayanan et al. 2021); (p − 1)/v of them
are the bubble; the optimizer runs once after. Communication hides behind compute where the frameworks
overlap it; how much is a named assumption below, not a measurement; an engine's last gradient bucket
(Megatron-LM's buckets, DeepSpeed's reduce bucket, FSDP2's last unit) has no compute left to hide behind.

With --mfu X the step is the hardware FLOPs at X of peak on every GPU: X is an end-to-end rate, measured
over whole steps, so the bubble, the communication and the optimizer are inside it and are not added.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from memcalc.exact.kernels import step_flops
from memcalc.memory.estimate import Setup
from memcalc.model.finetune import frozen_params, quantized_weights, trained_params
from memcalc.model.gpus import GPU
from memcalc.model.layout import Layout
from memcalc.model.params import latent_attention_params
from memcalc.model.shape import Model, ModelShape
from memcalc.model.tricks import Tricks
from memcalc.records import record
from memcalc.time.calibration import Calibration, calibration_for
from memcalc.time.stages import StageKernels, block_lower_bound, stage_kernels

from .activation_offload import activation_offload_comm
from .data_parallel import cpu_adam_seconds, dp_comm, offload_comm, tied_embedding_comm, unit_fraction
from .engines import grad_reduce_bytes
from .experts import busiest_experts_flops, ep_comm, expert_dp_comm, moe_tokens
from .links import ASSUMPTIONS, Assumptions, Comm, Fabric, MicroBatch, fabric_for, link_for, ring, send
from .params import stage_weights
from .pipeline import bubble_fraction, layers_per_stage
from .stage_memory import LayoutMemory, LayoutPeak, layout_memory


@record(slots=True)
class StepTime:
    """One optimizer step of a layout: compute on the slowest stage, the bubble, exposed traffic, the optimizer."""

    layout: Layout
    tricks: Tricks
    tokens_per_step: int  # all GPUs: global batch × sequence
    model_flops_per_step: int  # all GPUs (Korthikanti sec. 6.3 convention, memcalc.model.flops.step_flops)
    hardware_flops_per_step: int  # with recompute
    peak_flops: float  # one GPU, dense, this precision
    utilization: float | None  # --mfu: the end-to-end fraction of peak; None: the roofline
    compute_seconds: float  # the slowest stage's forward, backward and gradient accumulation, all micro-batches
    recompute_seconds: float  # its recompute
    optimizer_seconds: float  # the optimizer step on the GPU that updates the most (roofline; 0 under --mfu)
    bubble_seconds: float  # pipeline fill and drain
    comms: tuple[Comm, ...]
    cpu_optimizer_seconds: float  # Adam on the host (optimizer offload)
    assumptions: Assumptions
    calibration: Calibration | None = None  # the roofline's efficiencies; None under --mfu
    micro_batch_seconds: float = 0.0  # one micro-batch through the slowest stage, with its exposed TP, CP, PP traffic

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def time_model(self) -> str:
        """'roofline' or 'mfu', as the one-GPU estimate's JSON says."""
        return "mfu" if self.utilization is not None else "roofline"

    @property
    def exposed_comm_seconds(self) -> float:
        return sum(c.exposed_seconds for c in self.comms)

    @property
    def step_seconds(self) -> float:
        compute = self.compute_seconds + self.recompute_seconds + self.optimizer_seconds
        return compute + self.bubble_seconds + self.exposed_comm_seconds + self.cpu_optimizer_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs / (step time · GPUs · peak)."""
        return self.model_flops_per_step / (self.step_seconds * self.world * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops_per_step / (self.step_seconds * self.world * self.peak_flops)

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds of the step by cause: compute, recompute, the optimizer, bubble, exposed traffic per group,
        CPU optimizer."""
        out = {"compute": self.compute_seconds, "recompute": self.recompute_seconds,
               "optimizer": self.optimizer_seconds, "bubble": self.bubble_seconds}  # fmt: skip
        for c in self.comms:
            out[c.group] = out.get(c.group, 0.0) + c.exposed_seconds
        out["cpu optimizer"] = self.cpu_optimizer_seconds
        return out


@record(slots=True)
class Work:
    """The slowest stage's compute: one micro-batch, gradient accumulation, the optimizer."""

    micro_batch: MicroBatch
    accumulate: float  # per micro-batch after the first
    optimizer: float  # once per step


@lru_cache(maxsize=256)
def tp_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The shapes one TP rank computes on: a/t heads, k/t KV heads, f/t MLP columns, ⌈v/t⌉ vocabulary rows
    (Shoeybi et al. 2019; Megatron's vocab-parallel embedding and cross-entropy)."""
    if tp == 1:
        return shape
    moe = {}
    if shape.n_experts:  # routed experts whole (ep and etp split them); the shared ones split as an MLP
        each = shape.shared_ffn // shape.n_shared_experts if shape.n_shared_experts else None
        moe = dict(expert_ffn=shape.routed_ffn, shared_expert_ffn=None if each is None else -(-each // tp))
    return replace(shape, n_heads=shape.n_heads // tp, n_kv_heads=shape.n_kv_heads // tp, ffn=shape.ffn // tp,
                   vocab=-(-shape.vocab // tp), head_dim=shape.head_dim, **moe)  # fmt: skip


def roofline_work(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, stage_layers: tuple[int, ...],
                  cal: Calibration) -> Work:  # fmt: skip
    """Each stage's kernels on its GPU (memcalc.time.stages.stage_kernels); the slowest stage's."""
    grads = layout.shard_group if layout.zero >= 2 else 1
    experts = layout.ep * layout.etp
    k = stage_kernels(tp_shape(model.shape, layout.tp), setup.seq_len // layout.cp, setup.micro_batch, tricks, gpu,
                      cal, layout.tp if layout.sp else 1, layout.cp, grads, layout.shard_group, experts,
                      layout.expert_shard_group if layout.zero >= 2 else 1, layout.expert_shard_group,
                      setup.stack, setup.optimizer)  # fmt: skip
    p = layout.pp
    kinds = {(n, i == 0, i == p - 1) for i, n in enumerate(stage_layers)}  # a handful: the ends and the middle
    works = [stage_work(k, n, first, last) for n, first, last in sorted(kinds)]
    best = max(works, key=lambda w: w.micro_batch.seconds)
    best.optimizer = max(w.optimizer for w in works)
    return best


def stage_work(k: StageKernels, layers: int, first: bool, last: bool) -> Work:
    """One stage: its blocks, the embedding on the first, the head on the last. The optimizer's kernels
    outside the blocks (embedding, final norm, output layer) are charged whole to each end stage."""
    fwd = layers * k.block_forward + first * k.first_forward + last * k.last_forward
    bwd = layers * k.block_backward + first * k.first_backward + last * k.last_backward
    mb = MicroBatch(fwd, bwd, layers * k.block_recompute + last * k.last_recompute, layers * k.block_attention, layers)
    rest = k.optimizer_rest if first or last else 0.0
    return Work(mb, layers * k.block_accumulate + last * k.last_accumulate, layers * k.optimizer_block + rest)


def mfu_work(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, stage_layers: tuple[int, ...],
             mfu: float) -> Work:  # fmt: skip
    """--mfu X: each GPU's share of the step's hardware FLOPs at X of peak (forward a third, backward two;
    Kaplan et al. 2020). Only the windows of the traffic listed beside it come from this split."""
    f = step_flops(model.shape, setup.seq_len, tricks)
    tokens = setup.micro_batch * setup.seq_len
    rate = mfu * gpu.peak_flops(tricks.precision) * layout.tp * layout.cp * layout.pp
    model_s, extra_s = tokens * f.model_per_token / rate, tokens * (f.hardware_per_token - f.model_per_token) / rate
    layers = max(stage_layers)
    return Work(MicroBatch(model_s / 3, 2 * model_s / 3, extra_s, 0.0, layers), 0.0, 0.0)


def step_time(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, memory: LayoutMemory | None,
              assume: Assumptions = ASSUMPTIONS, timing: Calibration | float | None = None) -> StepTime:  # fmt: skip
    """The step of one layout, with setup.micro_batch b and setup.grad_accum m micro-batches per pipeline.

    timing: a Calibration (the roofline at it), None (the roofline at the GPU's shipped calibration), or a
    float X (--mfu: the step is the hardware FLOPs at X of peak, end to end).
      roofline   step = m · (slowest stage + its exposed TP, CP, PP traffic) · (1 + (p − 1)/(v·m))
                        + (m − 1) · accumulation + the optimizer + exposed data-parallel and offload traffic
                        + the CPU optimizer
      --mfu X    step = hardware FLOPs of the step / (GPUs · X · peak); the traffic is listed, not added
    """
    m, engine = setup.grad_accum, setup.stack.engine
    fabric = fabric_for(gpu, assume)
    if memory is None:  # the per-layer textbook has no formula for the trick set (ckpt:N, sac): its weights alone
        stage_layers, stages = layers_per_stage(layout, model.shape.n_layers, engine), stage_weights(model, layout, engine)
    else:
        stage_layers, stages = memory.stage_layers or (model.shape.n_layers // layout.pp,) * layout.pp, memory.stages
    mfu = timing if isinstance(timing, float) else None
    if mfu is not None:
        work = mfu_work(model, setup, gpu, tricks, layout, stage_layers, mfu)
    else:
        cal = timing if isinstance(timing, Calibration) else calibration_for(gpu.key)
        work = roofline_work(model, setup, gpu, tricks, layout, stage_layers, cal)
    busy = busiest_experts_flops(model, setup, layout)  # imbalance: the busiest GPU's extra expert work
    if busy:  # at the matmul rate, a third forward and two backward
        seconds = busy / (gpu.peak_flops(tricks.precision) * (mfu if mfu is not None else cal.matmul))
        work.micro_batch = replace(work.micro_batch, forward=work.micro_batch.forward + seconds / 3,
                                   backward=work.micro_batch.backward + 2 * seconds / 3)  # fmt: skip
    mb = work.micro_batch
    args = (layout, model, setup, tricks, fabric, assume, mb)
    per_mb = [x for x in (tp_comm(*args), cp_comm(*args), pp_comm(*args), *ep_comm(*args)) if x]
    slowest = mb.seconds + sum(x.exposed_seconds for x in per_mb)  # one micro-batch through the slowest stage
    per_step = [Comm(x.name, x.group, x.ranks, x.link, x.calls * m, x.bytes * m, x.formula, x.seconds * m,
                     x.exposed_seconds * m) for x in per_mb]  # fmt: skip
    experts = max(st.expert_params for st in stages)  # routed experts: synced over their edp group
    params = max(st.params - st.expert_params for st in stages)  # the stage with the most weights syncs longest
    w = 4 if tricks.precision == "fp32" else 2  # bytes of a weight while computing
    gw = grad_reduce_bytes(engine, tricks.precision)  # bytes of a gradient on the wire
    ft = setup.stack.finetune
    gathered = None
    if not ft.trains_all:  # data parallelism reduces what trains: LoRA's fp32 adapters, the unfrozen rest; ZeRO-3
        gathered = gathered_weight_bytes(model.shape, ft, w)  # gathers every weight, the frozen base too
        params, gw = trained_params(model.shape, ft), 4 if ft.lora else gw
    host, cpu = offload_comm(layout, max(st.params for st in stages), w, gw, m, fabric, assume, mb)
    host = host + activation_offload_comm(model, setup, tricks, fabric, assume, mb)
    unit = unit_fraction(model.shape, layout.tp, layout.pp) if engine == "fsdp2" else 0.0
    dp = dp_comm(layout, params, w, gw, m, fabric, assume, mb, engine, unit, gathered)
    dp += expert_dp_comm(layout, experts, w, gw, m, fabric, assume, mb)
    dp += tied_embedding_comm(layout, model.shape, gw, engine, fabric, assume) if ft.trains_all else []
    tokens = layout.dp * m * setup.micro_batch * setup.seq_len
    f = step_flops(model.shape, setup.seq_len, tricks)
    comms = tuple(per_step + dp + host)
    if mfu is not None:  # an end-to-end rate already holds the bubble, the traffic and the optimizer
        comms = tuple(replace(c, exposed_seconds=0.0) for c in comms)
    return StepTime(
        layout=layout,
        tricks=tricks,
        tokens_per_step=tokens,
        model_flops_per_step=tokens * f.model_per_token,
        hardware_flops_per_step=tokens * f.hardware_per_token,
        peak_flops=gpu.peak_flops(tricks.precision),
        utilization=mfu,
        compute_seconds=m * (mb.forward + mb.backward) + (m - 1) * work.accumulate,
        recompute_seconds=m * mb.recompute,
        optimizer_seconds=0.0 if layout.offload_optimizer else work.optimizer,  # offloaded: the CPU's (cpu_optimizer)
        bubble_seconds=0.0 if mfu is not None else slowest * m * bubble_fraction(layout, m),
        comms=comms,
        cpu_optimizer_seconds=0.0 if mfu is not None else cpu,
        assumptions=assume,
        calibration=None if mfu is not None else cal,
        micro_batch_seconds=slowest,
    )


def gathered_weight_bytes(shape: ModelShape, ft, w: int) -> int:
    """What ZeRO-3 and FSDP all-gather of a LoRA or part-frozen model: every weight in w bytes (FSDP2's
    param_dtype; DeepSpeed's bf16 copies), QLoRA's packed 4-bit ones, two to a byte, in their bf16 quant storage
    (their quantisation state is not a parameter: each rank keeps its own)."""
    packed = quantized_weights(shape)[0] if ft.quantize else 0
    return (frozen_params(shape, ft) - packed + trained_params(shape, ft)) * w + packed // 2


def step_lower_bound(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout,
                     memory: LayoutMemory | LayoutPeak,
                     assume: Assumptions = ASSUMPTIONS, timing: Calibration | float | None = None,
                     traced: bool = True) -> float:  # fmt: skip
    """A step time step_time never goes under, from the kernels of one sequence per micro-batch (one trace
    per TP shard, CP share and recompute mode, not per micro-batch size): the slowest stage's blocks at
    their lower bound (memcalc.time.stages.block_lower_bound) through the pipeline with its bubble, the
    gradient accumulation and the optimizer (which do not depend on the micro-batch), plus the TP and PP
    traffic no compute hides (overlap share 0). Under --mfu the step itself (it is cheap).
    traced=False: a looser bound that traces nothing, the blocks' matmuls alone at the matmul peak the
    roofline allows them (6 FLOPs per weight per token, forward and backward)."""
    if isinstance(timing, float):
        if isinstance(memory, LayoutPeak):  # step_time reads every kept stage's parameters
            memory = layout_memory(model, setup, gpu, tricks, layout, ends_only=True)
        return step_time(model, setup, gpu, tricks, layout, memory, assume, timing).step_seconds
    cal = timing if isinstance(timing, Calibration) else calibration_for(gpu.key)
    m, p = setup.grad_accum, layout.pp
    layers = max(memory.stage_layers or (model.shape.n_layers // p,))
    shape, seq, sp = tp_shape(model.shape, layout.tp), setup.seq_len // layout.cp, layout.tp if layout.sp else 1
    if traced:
        experts = layout.ep * layout.etp
        block = block_lower_bound(shape, seq, setup.micro_batch, tricks, gpu, cal, sp, layout.cp, experts, setup.stack,
                                  setup.optimizer)  # fmt: skip
        grads = layout.shard_group if layout.zero >= 2 else 1
        k = stage_kernels(shape, seq, 1, tricks, gpu, cal, sp, layout.cp, grads, layout.shard_group, experts,
                          layout.expert_shard_group if layout.zero >= 2 else 1, layout.expert_shard_group,
                          setup.stack, setup.optimizer)  # fmt: skip
        once = (m - 1) * layers * k.block_accumulate + (0.0 if layout.offload_optimizer else layers * k.optimizer_block)
    else:
        rate = gpu.peak_flops(tricks.precision) * cal.matmul
        block, once = block_matmul_flops(model, setup, layout) / rate, 0.0
    per_mb = layers * block
    fabric = fabric_for(gpu, assume)
    if layout.offload_optimizer:  # the CPU's Adam, on the critical path
        once += cpu_adam_seconds(layout, memory.params, assume)
    unhidden = unhidden_seconds(model, setup, tricks, layout, fabric, assume, layers)
    return (per_mb + unhidden) * (m + (p - 1) / layout.vpp) + once


# unhidden_seconds' answers: the planner asks again for every ZeRO and offload variant of a layout
UNHIDDEN: dict[tuple, float] = {}


def unhidden_seconds(model: Model, setup: Setup, tricks: Tricks, layout: Layout, fabric: Fabric,
                     assume: Assumptions, layers: int) -> float:  # fmt: skip
    """Per micro-batch, the TP, PP and EP traffic whose overlap share is 0, exposed whatever the compute;
    remembered by what tp_comm, pp_comm and ep_comm read (the model, sequence, micro-batch, routing, tricks,
    the layout's sizes, not its sharding)."""
    key = (model, setup.seq_len, setup.micro_batch, setup.routing, tricks, layout.tp,
           layout.sp, layout.pp, layout.vpp, layout.cp, layout.dp, layout.ep, layout.etp, layout.gpus_per_node, fabric,
           assume, layers)  # fmt: skip
    seconds = UNHIDDEN.get(key)
    if seconds is None:
        args = (layout, model, setup, tricks, fabric, assume, MicroBatch(0.0, 0.0, 0.0, 0.0, layers))
        shares = [(tp_comm(*args), assume.overlap_tp), (pp_comm(*args), assume.overlap_pp)]
        shares += [(c, assume.overlap_tp if c.name.startswith("ETP") else assume.overlap_ep) for c in ep_comm(*args)]
        seconds = sum(c.seconds for c, share in shares if c is not None and share == 0)
        if len(UNHIDDEN) > 1 << 16:
            UNHIDDEN.clear()
        UNHIDDEN[key] = seconds
    return seconds


def block_matmul_flops(model: Model, setup: Setup, layout: Layout) -> int:
    """One block's matmul FLOPs on one GPU for one micro-batch, forward and backward (6 per weight per token),
    no more than the block's kernels run: Q, K, V, O and the MLP split over tp; a mixture of experts' MoE
    layer as its R routed tokens through their experts and every token through the shared ones, or the
    dense layer's MLP where that is less (memcalc.model.moe.routed_tokens)."""
    shape, tokens = model.shape, setup.micro_batch * (setup.seq_len // layout.cp)
    flops = 6 * matmul_weights(shape, layout.tp) * tokens
    if shape.is_moe:
        n_in, h = (2 if shape.gated_mlp else 1), shape.hidden
        routed = moe_tokens(model, setup, layout)[1] * (n_in + 1) * h * shape.routed_ffn
        moe = routed + tokens * (n_in + 1) * h * shape.shared_ffn // layout.tp
        flops += 6 * min(moe, tokens * (n_in + 1) * h * shape.ffn // layout.tp)
    return flops


@lru_cache(maxsize=256)
def matmul_weights(shape: ModelShape, tp: int) -> int:
    """One block's matmul weights on one TP rank, at most: Q, K, V, O (latent attention's projections, less
    their norms' weights) and the MLP's matrices, split over tp; a mixture of experts' MLP left out
    (block_matmul_flops counts it by tokens)."""
    n_in = 2 if shape.gated_mlp else 1
    h = shape.hidden
    mlp = 0 if shape.n_experts else (n_in + 1) * h * shape.ffn
    if shape.is_mla:  # memcalc.model.params.latent_attention_params, norm weights left out
        norm = 2 if shape.norm == "layernorm" else 1
        attention = latent_attention_params(shape) - norm * (shape.q_lora_rank + shape.kv_lora_rank)
    else:
        attention = 2 * h * shape.q_dim + 2 * h * shape.kv_dim
    return (attention + mlp) // tp


def tp_comm(layout, model, setup, tricks, fabric, assume, mb) -> Comm | None:
    """Megatron TP: 2 all-reduces forward and 2 backward per layer, of (s/c)·b·h (Shoeybi et al. 2019, sec. 3);
    with SP each is a reduce-scatter + all-gather of the same volume (Korthikanti et al. 2022, sec. 4.2.2);
    full recompute runs the forward's 2 again. Per micro-batch, on the slowest stage's layers."""
    t = layout.tp
    if t == 1:
        return None
    per_layer = 4 + (2 if tricks.recompute == "full" else 0)
    act = tricks.act_bytes
    message = setup.seq_len // layout.cp * setup.micro_batch * model.shape.hidden * act
    name = "SP reduce-scatter + all-gather" if layout.sp else "TP all-reduce"
    calls = per_layer * mb.layers
    link = link_for(fabric, t, layout.gpus_per_node, t)
    formula = f"{per_layer}·L/p · 2(t−1)/t · (s/c)·b·h·{act}"
    return ring(name, "tp", t, link, calls, 2, message, formula, assume, assume.overlap_tp, mb.seconds)


def cp_comm(layout, model, setup, tricks, fabric, assume, mb) -> Comm | None:
    """Ring attention: per layer K and V go round the cp ranks (cp − 1 hops) in forward; K, V and their
    gradients in backward; full recompute adds a forward (TransformerEngine's P2P context parallel).
    Hidden behind the attention core's compute. Per micro-batch."""
    c = layout.cp
    if c == 1:
        return None
    passes = 3 + (1 if tricks.recompute == "full" else 0)
    act, layers = tricks.act_bytes, mb.layers
    chunk = 2 * (setup.seq_len // c) * setup.micro_batch * model.shape.kv_dim // layout.tp * act
    calls = passes * layers * (c - 1)
    link = link_for(fabric, layout.tp * c, layout.gpus_per_node)
    formula = f"{passes}·L/p·(c−1) · 2·(s/c)·b·kv_dim/t·{act}"
    return send("CP ring K/V exchange", "cp", c, link, calls, calls * chunk, formula, assume, assume.overlap_cp,
                mb.attention)  # fmt: skip


def pp_comm(layout, model, setup, tricks, fabric, assume, mb) -> Comm | None:
    """Each micro-batch crosses each GPU's stage boundary v times forward (activations) and v times
    backward (their gradients), (s/c)·b·h/t per send: Megatron's scatter/gather optimisation
    (Narayanan et al. 2021, sec. 4.1). Per micro-batch."""
    p, v = layout.pp, layout.vpp
    if p == 1:
        return None
    act = tricks.act_bytes
    message = setup.seq_len // layout.cp * setup.micro_batch * model.shape.hidden // layout.tp * act
    link = link_for(fabric, layout.tp * layout.cp * layout.dp * p, layout.gpus_per_node)
    formula = f"2·v · (s/c)·b·h/t·{act}"
    return send("PP send/recv", "pp", p, link, 2 * v, 2 * v * message, formula, assume, assume.overlap_pp, mb.seconds)
