"""`memcalc estimate --format json`: one schema with or without a layout (docs/output.md#json).

Both modes give the same top-level keys, one entry per trick set in every list, and the answer under the
same keys: `memory` (the textbook's peak per GPU; with a layout at the stage that peaks), `time` (the
one step time, and the MFU derived from it). What only one mode has is there, empty, in the other:
one GPU's replayed step (`verdict`), its whole-model terms (`activations`, `logits`), its toolbox and its
roofline kernels; a layout's stages (`stages`) and traffic (`time`'s `comms`, `assumptions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.memory.activations import attention_detail
from memcalc.memory.estimate import Memory
from memcalc.model.flops import flops
from memcalc.model.tricks import Tricks
from memcalc.parallel.links import Comm
from memcalc.parallel.layout import Layout, LayoutMemory

from .render import to_jsonable

# A roofline's readings that the step time gives: `time` carries them once.
STEP_READINGS = ("step_seconds", "tokens_per_second", "mfu", "hfu")
LAYOUT_ONLY = ("a layout's memory is the textbook's, stage by stage (`stages`): the exact model replays one "
               "GPU's step (estimate without layout options), or one layer on one TP rank (--exact)")  # fmt: skip


@dataclass(slots=True)
class Time:
    """One trick set's step, as the estimate times it (the roofline, or --mfu's end-to-end rate): the
    whole job's tokens and FLOPs per step, one GPU's utilisation of its dense peak."""

    tricks: Tricks
    gpus: int
    step_seconds: float
    tokens_per_step: int  # all GPUs
    tokens_per_second: float  # all GPUs
    mfu: float  # model FLOPs / (step time · GPUs · peak)
    hfu: float  # executed FLOPs (recompute, flash's backward QKᵀ) / (step time · GPUs · peak)
    model_flops: int  # per step, all GPUs
    hardware_flops: int  # per step, all GPUs
    peak_flops: float  # one GPU, dense, this precision
    breakdown: dict[str, float]  # seconds of the step by cause
    comms: tuple[Comm, ...]  # each collective, with what overlap leaves exposed (a layout's)


def roofline_time(t, gpus: int) -> Time:
    """One GPU's roofline (memcalc.time.roofline.StepTime), on each of `gpus` data-parallel GPUs (perfect
    scaling: the one-GPU estimate counts no traffic). The optimizer's kernels and the recompute apart."""
    optimizer = sum(op.seconds for op in t.ops if op.phase == "optimizer")
    compute = t.step_seconds - t.recompute_seconds - optimizer
    return Time(t.tricks, gpus, t.step_seconds, t.tokens_per_step * gpus, t.tokens_per_second * gpus, t.mfu, t.hfu,
                t.model_flops * gpus, t.counted_flops * gpus, t.peak_flops,
                one_gpu_breakdown(compute, float(t.recompute_seconds), optimizer), ())  # fmt: skip


def mfu_time(c, gpus: int) -> Time:
    """One GPU's step at --mfu (memcalc.memory.estimate.Compute): the executed FLOPs at the assumed rate;
    what recompute executes beyond the model FLOPs apart, as a layout under --mfu splits it."""
    model = c.tokens_per_step * c.flops.model_per_token
    compute = model / (c.utilization * c.peak_flops)
    return Time(c.tricks, gpus, c.step_seconds, c.tokens_per_step * gpus, c.tokens_per_second * gpus, c.mfu, c.hfu,
                model * gpus, c.tokens_per_step * c.flops.hardware_per_token * gpus, c.peak_flops,
                one_gpu_breakdown(compute, c.step_seconds - compute, 0.0), ())  # fmt: skip


def one_gpu_breakdown(compute: float, recompute: float, optimizer: float) -> dict[str, float]:
    """The causes a layout's step lists (memcalc.parallel.comm.StepTime.breakdown); one GPU has no
    pipeline and no host optimizer."""
    return {"compute": compute, "recompute": recompute, "optimizer": optimizer, "bubble": 0.0, "cpu optimizer": 0.0}


def layout_time(t) -> Time:
    """A layout's step (memcalc.parallel.comm.StepTime): the slowest stage, the bubble, the exposed traffic."""
    return Time(t.tricks, t.world, t.step_seconds, t.tokens_per_step, t.tokens_per_second, t.mfu, t.hfu,
                t.model_flops_per_step, t.hardware_flops_per_step, t.peak_flops, t.breakdown, t.comms)  # fmt: skip


def roofline_detail(t) -> dict:
    """One GPU's roofline, kernel by kernel, without the readings `time` carries."""
    out = to_jsonable(t)
    for key in STEP_READINGS:
        del out[key]
    return out


def one_gpu_layout(parallel) -> Layout:
    """The layout the one-GPU estimate is: --gpus data-parallel replicas with --zero and --offload."""
    return Layout(dp=parallel.gpus, zero=parallel.zero, offload_optimizer=parallel.offload)


def peak_memory(mem: LayoutMemory) -> Memory:
    """A layout's memory per GPU in the one-GPU estimate's terms: the stage that peaks (host memory: the
    stage that offloads the most), so that `fits` is the layout's."""
    st = mem.peak
    return Memory(mem.tricks, st.state.total_bytes, st.activation_peak_bytes, st.logits_bytes, st.buffer_bytes,
                  st.usable_bytes, mem.host_bytes, st.host_usable_bytes)  # fmt: skip


def estimate_json(est, toolbox, runs, exacts=None, roofline=None) -> dict:
    """The one-GPU estimate (memcalc.memory.estimate.Estimate); roofline: (step times, calibration), or
    None when --mfu times the step."""
    gpus = est.setup.parallel.gpus
    times = [roofline_time(t, gpus) for t in roofline[0]] if roofline else [mfu_time(c, gpus) for c in est.compute]
    out = {
        "model": est.model, "setup": est.setup, "gpu": est.gpu, "layout": one_gpu_layout(est.setup.parallel),
        "trick_sets": est.trick_sets, "model_state": est.model_state, "flops": est.flops, "attention": est.attention,
        "activations": est.activations, "logits": est.logits, "memory": est.memory, "stages": [],
        "verdict": est.verdict, "not_replayed": est.not_replayed, "time_model": "mfu" if roofline is None else "roofline",
        "time": times, "roofline": [] if roofline is None else [roofline_detail(t) for t in roofline[0]],
        "calibration": None if roofline is None else roofline[1], "assumptions": None, "toolbox": toolbox,
        "runs": runs, "exact": exacts or [],
    }  # fmt: skip
    return to_jsonable(out)


def layouts_json(ests, runs, layers=None) -> dict:
    """One layout, one memcalc.parallel.plan.LayoutEstimate per trick set."""
    first = ests[0]
    setup, model = first.setup, first.model
    primary = next((e for e in ests if e.tricks.precision != "fp32"), first)  # as the one-GPU model_state
    timed = first.time
    out = {
        "model": model, "setup": setup, "gpu": first.gpu, "layout": first.layout,
        "trick_sets": [e.tricks for e in ests], "model_state": primary.memory.peak.state,
        "flops": flops(model.shape, model.n_params, setup.seq_len),
        "attention": attention_detail(model.shape, setup.seq_len, setup.micro_batch),
        "activations": [], "logits": [], "memory": [peak_memory(e.memory) for e in ests],
        "stages": [e.memory.stages for e in ests], "verdict": [], "not_replayed": LAYOUT_ONLY,
        "time_model": timed.time_model, "time": [layout_time(e.time) for e in ests], "roofline": [],
        "calibration": timed.calibration, "assumptions": timed.assumptions, "toolbox": None,
        "runs": runs, "exact": layers or [],
    }  # fmt: skip
    return to_jsonable(out)
