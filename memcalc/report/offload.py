"""The verdict's notes on activation offloading (issue 40): where the activations went, the pinned host memory they
need, and their copies on the host link with what compute hides of them (memcalc.parallel.activation_offload)."""

from __future__ import annotations

from memcalc.engine.answer import Answer
from memcalc.model.savers import offload_note
from memcalc.parallel.activation_offload import TO_GPU, TO_HOST
from memcalc.parallel.links import LINKS

from . import units as u


def offload_notes(ans: Answer, units: str) -> list[str]:
    """Where the activations went (the stack's offloading), then per trick set what it moved; [] without it."""
    stack = ans.job.setup.stack
    if not stack.savers.offload:
        return []
    lines = [offload_note(stack.savers, stack.trl)]
    for e in ans.layouts:
        v, comms = e.verdict, {c.name: c for c in e.time.comms}
        if v.phases is None or TO_HOST not in comms:
            continue
        out, back = comms[TO_HOST], comms[TO_GPU]
        link = LINKS[out.link]
        hidden = out.exposed_seconds + back.exposed_seconds == 0
        lines.append(f"{v.tricks.label}: {u.size(v.phases.offloaded_bytes, units)} of pinned host memory per GPU "
                     f"(one micro-batch's saved tensors); over {link.name} ({link.gb_per_s:g} GB/s a direction) "
                     f"{u.size(out.bytes, units)} to the host in {u.seconds(out.seconds)} and "
                     f"{u.size(back.bytes, units)} back in {u.seconds(back.seconds)} a step: "
                     + ("hidden under forward and backward" if hidden else
                        f"{u.seconds(out.exposed_seconds + back.exposed_seconds)} not hidden under compute, in the "
                        "step time"))  # fmt: skip
    return lines
