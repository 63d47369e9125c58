"""`memcalc estimate --format json`: one schema for every job (docs/output.md#json), the Answer serialised.

Every job gives the same top-level keys, one entry per trick set in every list, and the answer under the
same keys: `verdict` (the peak per GPU that decides, replayed where the exact model replays the job, and
the textbook's elsewhere, each field one GPU's bytes), `memory` (the textbook's peak per GPU; with a
pipeline at the stage that peaks), `time` (the one step time, and the MFU derived from it). What only
some jobs have is there, empty, in the others: the whole-model textbook terms (`activations`, `logits`)
and the toolbox of a data-parallel job; one GPU's roofline kernels; the stages of a layout.
"""

from __future__ import annotations

from memcalc.memory.activations import attention_detail
from memcalc.memory.estimate import Memory
from memcalc.model.flops import flops
from memcalc.model.tricks import Tricks
from memcalc.parallel.links import Comm
from memcalc.parallel.stage_memory import LayoutMemory
from memcalc.records import record

from .render import to_jsonable

# A roofline's readings that the step time gives: `time` carries them once.
STEP_READINGS = ("step_seconds", "tokens_per_second", "mfu", "hfu")


@record(slots=True)
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


def peak_memory(mem: LayoutMemory) -> Memory:
    """A layout's memory per GPU in the one-GPU estimate's terms: the stage that peaks (host memory: the
    stage that offloads the most), so that `fits` is the layout's."""
    st = mem.peak
    return Memory(mem.tricks, st.state.total_bytes, st.activation_peak_bytes, st.logits_bytes, st.buffer_bytes,
                  st.usable_bytes, mem.host_bytes, st.host_usable_bytes)  # fmt: skip


def answer_json(ans) -> dict:
    """One job's answer (memcalc.engine.answer.Answer), whatever its layout."""
    job, est = ans.job, ans.textbook
    model, setup, first = job.model, job.setup, ans.layouts[0]
    primary = next((e for e in ans.layouts if e.tricks.precision != "fp32"), first)  # the recipe the field trains with
    data_parallel = est is not None
    out = {
        "model": model, "setup": setup, "gpu": job.gpu, "layout": first.layout, "trick_sets": job.trick_sets,
        "model_state": est.model_state if data_parallel else primary.memory.peak.state,
        "flops": flops(model.shape, model.n_params, setup.seq_len),
        "attention": attention_detail(model.shape, setup.seq_len, setup.micro_batch),
        "activations": est.activations if data_parallel else [], "logits": est.logits if data_parallel else [],
        "memory": est.memory if data_parallel else [peak_memory(e.memory) for e in ans.layouts],
        "stages": [e.memory.stages if e.memory is not None else [] for e in ans.layouts],
        "verdict": ans.verdicts, "headroom": first.headroom, "not_replayed": next((v.textbook_reason for v in ans.verdicts if not v.replayed), ""),
        "time_model": first.time.time_model, "time": [layout_time(e.time) for e in ans.layouts],
        "roofline": [roofline_detail(t) for t in ans.roofline] if ans.roofline else [],
        "calibration": first.time.calibration, "assumptions": first.time.assumptions, "toolbox": ans.toolbox,
        "runs": ans.runs, "exact": ans.exact, "timeline": ans.timelines, "rollout": ans.rollout,
    }  # fmt: skip
    return to_jsonable(out)
