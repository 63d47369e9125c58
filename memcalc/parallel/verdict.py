"""The verdict: what one GPU of a job holds at its step's peak, and so whether the job fits.

Wherever the exact model replays the step (memcalc.exact: the stack's model, recipe and optimizer, op by
op), the verdict is that replay on one GPU of the layout, its sharding applied inside the step, phase by
phase: one GPU's step; one data-parallel rank's under memcalc's generic ZeRO and offload
(memcalc.exact.replay.zero); one FSDP2 rank's as torchtitan runs it, hook by hook (memcalc.exact.replay.fsdp2, equal to
PyTorch's FSDP2 on the fake process group to the byte). Everywhere else (tensor, pipeline, context or
expert parallel; the engines and recipes the simulator does not replay) the textbook decides: the stage of
the layout that holds the most (memcalc.parallel.stage_memory), with the reason beside it. Every field is one
GPU's bytes, and none is negative.
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.errors import InputError
from memcalc.exact.allocator.replay import Reserved
from memcalc.exact.base.config import Phases, not_replayed, shape_not_replayed, window_not_built
from memcalc.exact.replay.zero import Sharding
from memcalc.exact.step import step_phases
from memcalc.memory.estimate import state_for
from memcalc.memory.setup import Fits, Setup, host_share
from memcalc.model.gpus import GPU
from memcalc.model.headroom import allocator_room, usable_bytes
from memcalc.model.layout import ONE_GPU, Layout
from memcalc.model.shape import Model, n_params
from memcalc.model.stacks import check_tricks
from memcalc.model.tricks import Tricks, layout_counts
from memcalc.records import record

from .checks import check_layout
from .engines import DEEPSPEED_DEFAULTS, engine_layout
from .params import sharded_state
from .stage_memory import LayoutPeak, layout_memory


@record(slots=True)
class Verdict(Fits):
    """One trick set's peak on one GPU of the job, and what it was counted from."""

    tricks: Tricks
    state_bytes: int  # live between steps: weights, master, optimizer state (what this GPU keeps of them)
    peak_bytes: int  # the step's highest live bytes on this GPU
    peak_at: str  # where the step peaks: "optimizer: sqrt" (replayed), "stage 0" (the textbook's)
    usable_bytes: int  # the GPU's memory less the headroom (memcalc.model.headroom)
    host_bytes: int  # this GPU's model state in host memory (offload), and its activations offloaded (pinned)
    host_usable_bytes: int  # its share of the node's host memory
    phases: Phases | None  # the replayed step on this GPU; None where the textbook decides
    replay: str  # what was replayed ("one GPU's step", "ZeRO-3 over 64 ranks", ...), "" for the textbook
    textbook_reason: str  # why the textbook decides ("" where the step is replayed)
    n_params: int  # the parameters the replay builds: the shape's own count
    reserved: Reserved | None = None  # the caching allocator replayed over the run where it decides (allocator_verdict)
    keeps_share: bool = True  # usable keeps the allocator's share of the headroom back; False: its whole room

    @property
    def replayed(self) -> bool:
        return self.phases is not None

    @property
    def total_bytes(self) -> int:
        """What the verdict holds to the usable bytes: the allocator's reserve where it was replayed (over the step;
        the model's load, where it peaks, holds its tensors at least), else the peak."""
        return max(self.reserved.reserved_bytes, self.peak_bytes) if self.reserved is not None else self.peak_bytes

    @property
    def transient_bytes(self) -> int:
        """Live at the peak besides the state: activations, logits, gradients, buffers, temporaries, inputs."""
        return self.peak_bytes - self.state_bytes

    @property
    def retained_bytes(self) -> int:
        """What forward leaves alive for backward (saved tensors and the loss); 0 where not replayed."""
        return self.phases.retained_bytes if self.phases is not None else 0


def replay_gap(model: Model, setup: Setup, tricks: Tricks, layout: Layout) -> str:
    """Why the exact model cannot replay one GPU of this job ("" when it can): the stack, the shape, the
    routing, and the layout (it replays data parallelism, with the generic engine's ZeRO or FSDP2's)."""
    s, shape = setup.stack, model.shape
    reason = (not_replayed(s.model, s.recipe, s.impl, setup.optimizer, tricks.precision)
              or shape_not_replayed(shape, s.model, s.recipe, s.impl)
              or window_not_built(shape, setup.seq_len, s.model))  # fmt: skip
    if reason:
        return reason
    if not setup.routing.balanced:  # verify's reference router is the balanced one
        return "the exact model replays balanced routing; a capacity factor or an imbalance is the textbook's"
    if max(layout.tp, layout.pp, layout.cp, layout.ep, layout.etp) > 1:
        return ("the exact model replays data parallelism (ZeRO, FSDP2, offload); tensor, pipeline, context and "
                "expert parallel are the textbook's")  # fmt: skip
    if s.engine == "fsdp2" and layout.zero == 3 and s.finetune.trains_all:
        return fsdp2_gap(setup, tricks, layout)
    if s.engine == "fsdp2" and tricks.precision != "bf16":  # tests/test_fsdp2_lora.py holds it to PyTorch at bf16
        return f"the FSDP2 replay of PEFT's model all-gathers in bf16 (MixedPrecisionPolicy), not {tricks.precision}"
    return ""


def plain_data_parallel(layout: Layout) -> bool:
    """Every GPU holds the whole model and its whole step (no ZeRO, offload, tensor, pipeline, context or expert
    parallel): where LoRA and frozen weights are replayed (memcalc.engine.job.check_finetune)."""
    splits = max(layout.tp, layout.pp, layout.cp, layout.ep, layout.etp) > 1
    return not (splits or layout.zero or layout.offload_optimizer or layout.offload_params)


def sharded_data_parallel(layout: Layout, engine: str = "none") -> bool:
    """Every GPU runs the whole model's step, its state sharded or not (ZeRO 0-3, FSDP), nothing offloaded: where
    LoRA and frozen weights are replayed (memcalc.engine.job.check_finetune). FSDP2 (engine fsdp2) over 2 or more
    ranks alone: its replay (memcalc.exact.replay.fsdp2_lora) is fully_shard's, not DDP's or one GPU's."""
    splits = max(layout.tp, layout.pp, layout.cp, layout.ep, layout.etp) > 1
    if engine == "fsdp2" and (layout.zero != 3 or layout.shard_group < 2):
        return False
    return not (splits or layout.offload_optimizer or layout.offload_params)


def fsdp2_gap(setup: Setup, tricks: Tricks, layout: Layout) -> str:
    """What memcalc.exact.replay.fsdp2's replay of one torchtitan rank does not cover (it runs torchtitan's step:
    one micro-batch, fused AdamW over fp32 shards on the GPU)."""
    if setup.optimizer != "adamw":
        return f"the FSDP2 replay runs torchtitan's fused AdamW, not {setup.optimizer}"
    if setup.grad_accum > 1:
        return "the FSDP2 replay runs one micro-batch per step, not gradient accumulation"
    if layout.offload_optimizer or layout.offload_params:
        return "the FSDP2 replay keeps everything on the GPU; CPUOffloadPolicy is the textbook's"
    if tricks.precision == "fp16" or tricks.mixed:
        return f"the FSDP2 replay runs bf16 and fp32, each block recomputed alike (none, selective, full or sac), not {tricks.label}"
    return ""


@lru_cache(maxsize=4096)  # the toolbox, fit and plan ask for the same jobs again and again
def gpu_verdict(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout = ONE_GPU,
                allocator: bool = True) -> Verdict:  # fmt: skip
    """The verdict for one trick set on one GPU of the layout. allocator=False: the tensors' peak against the
    allocator's room, its replay left out (the searches' cheap first pass: the reserve holds at least the peak)."""
    layout = engine_layout(layout, setup.stack.engine)
    check_tricks(setup.stack, tricks)
    check_layout(layout, model.shape, setup.seq_len, tricks, setup.grad_accum, setup.stack.engine)
    gap = replay_gap(model, setup, tricks, layout)
    if gap:
        return textbook_verdict(model, setup, gpu, tricks, layout, gap)
    shape, s, g = model.shape, setup, layout.shard_group
    sharding = replay_sharding(setup, layout, tricks.precision)
    if sharding is None:
        from memcalc.exact.replay.fsdp2 import fsdp2_step

        phases = fsdp2_step(shape, s.seq_len, s.micro_batch, tricks, g, layout.reshard_after_forward)
        replay = f"one FSDP2 rank of {g}, hook by hook"
    else:
        phases = step_phases(shape, s.seq_len, s.micro_batch, tricks, s.grad_accum, s.stack, s.optimizer, sharding)
        replay = replay_text(sharding)
    own = n_params(shape)
    if s.stack.finetune.trains_all:
        state_host = sharded_state(own, tricks.precision, s.optimizer, g, layout.zero, layout.offload_optimizer,
                                   layout.offload_params, s.stack.recipe).host_bytes  # fmt: skip
    else:  # what trains of a fine-tuned model: its paged optimizer state, if any (it offloads nothing)
        state_host = state_for(shape, own, s, tricks.precision, layout)[2]
    # the allocator is replayed over the step, where the step's peak comes near its room (a load that peaks above
    # the step holds its tensors, Verdict.total_bytes)
    usable, reserved = allocator_verdict(model, setup, gpu, tricks, layout, sharding, phases.step_peak_bytes,
                                         allocator)  # fmt: skip
    host = state_host + phases.offloaded_bytes  # one micro-batch's offloaded activations, pinned till backward
    return Verdict(tricks, phases.state_bytes, phases.run_peak_bytes, peak_at(phases), usable, host,
                   host_share(setup, layout), phases, replay, "", own, reserved,
                   keeps_share=usable != allocator_room(gpu, layout.groups))  # fmt: skip


# Where the tensors' peak comes within REPLAY_BAND of the allocator's room, the verdict replays the caching
# allocator over the run (memcalc.exact.reserved). Across 152 one-GPU runs (benchmarks/allocator_margin.md: GPT-2
# to Llama-3-8B, the reference and hf stacks, fp32 to checkpointing, three shapes each) the least room in which
# the allocator did not run out was 1.7% above the tensors' peak at the median, 21.9% at most: below the band
# the run fits.
REPLAY_BAND = 1 / 3


def allocator_verdict(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout,
                      sharding: Sharding | None, peak: int,
                      replay: bool = True) -> tuple[int, Reserved | None]:  # fmt: skip
    """The bytes a replayed step's peak is held to, and the allocator's replay where it decides: the allocator's
    room (memcalc.model.headroom.allocator_room), replayed over one GPU's step or ZeRO rank's
    (memcalc.exact.reserved.step_reserved) or over an FSDP2 rank's, its streams apart (sharding None:
    fsdp2_reserved); with --headroom, or for a mixture of experts, the usable bytes that keep its share back.
    replay=False: the room alone."""
    if gpu.headroom_spec or model.shape.is_moe:  # MoE: every expert's own allocations make the replay take
        return usable_bytes(gpu, layout.groups), None  # tens of seconds (9-28 s for Qwen3-30B-A3B to 235B)
    room = allocator_room(gpu, layout.groups)
    if not replay or peak > room or peak < room * (1 - REPLAY_BAND):
        return room, None
    from memcalc.exact.reserved import fsdp2_reserved, step_reserved

    s, expandable = setup, gpu.expandable_segments
    if sharding is None:
        return room, fsdp2_reserved(model.shape, s.seq_len, s.micro_batch, tricks, layout.shard_group,
                                    layout.reshard_after_forward, room, expandable)  # fmt: skip
    return room, step_reserved(model.shape, s.seq_len, s.micro_batch, tricks, s.grad_accum, s.stack, s.optimizer,
                               sharding, room, expandable)  # fmt: skip


def replay_sharding(setup: Setup, layout: Layout, precision: str = "bf16") -> Sharding | None:
    """How the verdict's replay shards the step (layout as engine_layout gives it): memcalc's generic ZeRO
    and offload over the shard group (memcalc.exact.replay.zero; trivial for one GPU's step), with DeepSpeed's
    reduce bucket where the Trainer runs it (the hf and TRL stacks: accelerate's ZeRO is DeepSpeed's, its
    defaults as accelerate's config writes none), FSDP2 over a LoRA model, all-gathering in the precision
    (memcalc.exact.replay.fsdp2_lora), or None where FSDP2's own replay (memcalc.exact.replay.fsdp2) runs it."""
    if setup.stack.engine == "fsdp2" and layout.zero == 3:
        if not setup.stack.finetune.trains_all:
            return Sharding(3, layout.shard_group, fsdp2=precision)
        return None
    deepspeed = setup.stack.model == "hf" and layout.zero > 0 and layout.shard_group > 1
    return Sharding(layout.zero, layout.shard_group, layout.offload_optimizer, layout.offload_params,
                    bucket_numel=DEEPSPEED_DEFAULTS.reduce_bucket_size if deepspeed else 0,
                    bucket_dtype=precision if precision in ("bf16", "fp16") else "fp32")  # fmt: skip


def textbook_verdict(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout, reason: str) -> Verdict:
    """The textbook's verdict: the layout's stage that holds the most, per GPU (memcalc.parallel.stage_memory); under
    sac each block's saved bytes are memcalc.exact's on the TP shard (activations.sac_layer_activations)."""
    if tricks.mixed:  # the per-stage textbook counts one kind of layer; the replay counts ckpt:N's two
        raise InputError(f"{tricks.label}: the textbook's layouts count ckpt, not ckpt:N, and {reason}")
    if not layout_counts(tricks, model.shape.is_moe) or (tricks.recompute == "op" and layout.world == 1):
        # one GPU's sac is its replay's: where that is missing, there is nothing the textbook can add
        raise InputError(f"{tricks.label}: the textbook has no formula for sac, and {reason}")
    memory = layout_memory(model, setup, gpu, tricks, layout)
    st = memory.peak
    where = f"stage {st.stage}" if layout.pp > 1 else "the textbook's peak"
    return Verdict(tricks, st.state.total_bytes, st.total_bytes, where, st.usable_bytes, memory.host_bytes,
                   st.host_usable_bytes, None, "", reason, model.n_params)  # fmt: skip


def replay_text(sharding: Sharding) -> str:
    """What the replay was, in a few words."""
    if sharding.trivial:
        return "one GPU's step"
    if sharding.fsdp2:
        return f"one FSDP2 rank of {sharding.ranks} over the LoRA model, hook by hook"
    engine = "DeepSpeed " if sharding.bucket_numel else ""  # the Trainer's: its reduce bucket replayed
    parts = [f"{engine}ZeRO-{sharding.zero} over {sharding.ranks} ranks" if sharding.shards > 1 else "one GPU's step"]
    if sharding.offload:
        parts.append("parameters and optimizer offloaded" if sharding.offload_params else "optimizer offloaded")
    return ", ".join(parts)


def peak_at(p: Phases) -> str:
    """Where the run peaks: the step's peak (step_peak_at), or the model's load where it holds more than the step
    (memcalc.exact.replay.zero: a quantized model under DeepSpeed's ZeRO-3)."""
    if p.load_bytes > p.step_peak_bytes:
        return "load: the whole quantized model on each GPU, before DeepSpeed's ZeRO-3 partitions it"
    return step_peak_at(p)


def step_peak_at(p: Phases) -> str:
    """Where the step peaks: the phase and op ("optimizer: sqrt"); the first to reach it on a tie."""
    peaks = [(p.forward_peak_bytes, p.forward_peak_at), (p.backward_peak_bytes, p.backward_peak_at),
             (p.optimizer_peak_bytes, p.optimizer_peak_at)]  # fmt: skip
    return max(peaks, key=lambda x: x[0])[1]


def verdict_fit(model: Model, setup: Setup, gpu: GPU, tricks: Tricks, layout: Layout,
                peak: LayoutPeak) -> tuple[int, bool]:  # fmt: skip
    """gpu_verdict's peak and fit for the planner's thousands of layouts, given the textbook's (layout_peak):
    the replay where the simulator replays the job (its tensors against the allocator's room: the planner
    replays the allocator over the layouts it shows, memcalc.parallel.plan.confirmed), else the textbook's
    stage that peaks."""
    if not replay_gap(model, setup, tricks, engine_layout(layout, setup.stack.engine)):
        v = gpu_verdict(model, setup, gpu, tricks, layout, allocator=False)
        return v.total_bytes, v.fits
    return peak.total_bytes, peak.fits
