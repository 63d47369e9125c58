"""Activation offloading's host link traffic (issue 40): what the replay copied to pinned host memory in forward and
back in backward (memcalc.exact.sim.offload, memcalc.exact.base.config.Phases offloaded_bytes and reloaded_bytes), as
the step's traffic on the GPU's host link (memcalc.parallel.links: PCIe), and how much of it compute hides.

TRL's OffloadActivations copies on a side stream (trl 1.16.0 trl/models/activation_offloading.py: self.s1, each copy
waited for by an event later), so its copies run beside forward's and backward's kernels: hidden up to their time.
Transformers' checkpoint offload runs save_on_cpu's copy_ on the compute stream, blocking (torch/autograd/graph.py
save_on_cpu: packed.copy_(tensor), no non_blocking), so none of it hides.
"""

from __future__ import annotations

from memcalc.exact.step import step_phases
from memcalc.memory.setup import Setup
from memcalc.model.shape import Model
from memcalc.model.tricks import Tricks

from .links import Assumptions, Comm, Fabric, MicroBatch, send

TO_HOST = "activations GPU→host (offloaded)"
TO_GPU = "activations host→GPU (brought back)"


def activation_offload_comm(model: Model, setup: Setup, tricks: Tricks, fabric: Fabric, assume: Assumptions,
                            mb: MicroBatch) -> list[Comm]:  # fmt: skip
    """Each micro-batch's copies to the host behind its forward and back behind its backward (with the recompute);
    [] without offloading."""
    stack = setup.stack
    if not stack.savers.offload:
        return []
    phases = step_phases(model.shape, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, stack,
                         setup.optimizer)  # fmt: skip
    m, share = setup.grad_accum, 1.0 if stack.trl else 0.0  # a side stream's copies, or the compute stream's
    return [send(TO_HOST, "host", 1, fabric.host, m, m * phases.offloaded_bytes, "m · bytes offloaded", assume,
                 share, m * mb.forward),
            send(TO_GPU, "host", 1, fabric.host, m, m * phases.reloaded_bytes, "m · bytes brought back", assume,
                 share, m * mb.backward_window)]  # fmt: skip
