"""--timeline: each trick set's step allocation by allocation (memcalc.exact.timeline), the same replay as
the verdict's (memcalc.parallel.verdict: one GPU's step, or one data-parallel rank's under ZeRO) run at
full depth with every allocation recorded, so that the series' highest point is the verdict's peak. A step
accumulating more micro-batches than memcalc.exact.reserved.MICRO_BATCHES is drawn over that many: each later
one starts from the same live bytes and runs the same allocations as the third (the verdict replays as many)."""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.exact.reserved import MICRO_BATCHES
from memcalc.exact.timeline import Timeline, step_timeline
from memcalc.parallel.engines import engine_layout
from memcalc.parallel.verdict import Verdict, replay_sharding, step_peak_at


def step_timelines(job, verdicts: tuple[Verdict, ...]) -> tuple[Timeline, ...]:
    """One Timeline per trick set of the job; refused where the verdict is not a replay it can record."""
    if not job.data_parallel:
        raise InputError("--timeline replays one GPU's whole step: drop --tp, --pp, --cp and --ep (data parallel "
                         "and ZeRO are replayed)")  # fmt: skip
    s, shape = job.setup, job.model.shape
    layout = engine_layout(job.layout, s.stack.engine)
    sharding = replay_sharding(s, layout)
    if sharding is None or sharding.fsdp2:
        raise InputError("--timeline records memcalc's ZeRO replay; FSDP2's is hook by hook, not recorded: "
                         "drop --stack fsdp2 or --zero 3")  # fmt: skip
    out = []
    for v in verdicts:
        if not v.replayed:
            raise InputError(f"--timeline: {v.tricks.label} is not replayed op by op: {v.textbook_reason}")
        drawn = min(s.grad_accum, MICRO_BATCHES)
        sharding = replay_sharding(s, layout, v.tricks.precision)  # DeepSpeed's bucket in the trick set's dtype
        t = step_timeline(shape, s.seq_len, s.micro_batch, v.tricks, s.grad_accum, s.stack, s.optimizer, sharding,
                          drawn)  # the step's accumulation (GRPO's generation batch is sized by it), drawn over a few
        t = replace(t, micro_batches=drawn, accumulated=s.grad_accum)
        step = (v.phases.step_peak_bytes, step_peak_at(v.phases))  # the step's (a load may peak above it: zero.py)
        if (t.peak_bytes, t.peak_at) != step:  # the full depth and the grown step disagree: a bug
            raise RuntimeError(f"{v.tricks.label}: the timeline peaks at {t.peak_bytes:,} B ({t.peak_at}), the "
                               f"verdict's step at {step[0]:,} B ({step[1]})")  # fmt: skip
        out.append(t)
    return tuple(out)
