"""The verdict's memory: the chosen stack's training step replayed op by op (memcalc.exact), at its peak.

The textbook (memcalc.memory.estimate.memory_for) adds model state, activations at their backward peak
and the logits. What PyTorch holds at the step's peak is whatever is live then: at 8B with
checkpointing that is the optimizer step (the gradients and its temporaries beside the state), not the
backward pass. memcalc.exact.step.exact_step replays the step (two and three blocks, grown to the depth)
and is equal to the meta measurement to the byte; this module makes a per-GPU verdict of it.

The replay is of one GPU and the shape as built (its own parameter count, not a --params override).
ZeRO and offload shard or move the model state by formula (memcalc.memory.state); the step's
transients (activations, logits, gradients in flight, optimizer temporaries) stay one GPU's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from memcalc.exact.config import Phases, not_replayed, shape_not_replayed
from memcalc.exact.step import step_phases
from memcalc.model.gpus import GPU
from memcalc.model.shape import Model, ModelShape, largest_layer_params, n_params
from memcalc.model.tricks import Tricks

from .setup import Budget, Setup
from .state import Parallel, model_state, weights_held_elsewhere, zero3_gather_bytes


@dataclass(slots=True)
class ExactMemory(Budget):
    """One trick set's whole-step peak per GPU, as the stack's step allocates it."""

    tricks: Tricks
    n_params: int  # the shape's own count: what the replay builds
    phases: Phases  # the replayed step on one GPU: its state and the peak of each phase
    state_change_bytes: int  # what ZeRO and offload take off the state (negative), ZeRO-3's gathered layers
    usable_bytes: int
    host_bytes: int
    host_usable_bytes: int

    @property
    def model_state_bytes(self) -> int:
        """Weights, buffers, master and optimizer state between steps, on one GPU."""
        return self.phases.state_bytes

    @property
    def peak_bytes(self) -> int:
        """The step's peak on one GPU (before ZeRO and offload)."""
        return self.phases.step_peak_bytes

    @property
    def peak_at(self) -> str:
        """Where the step peaks: the phase and op ("optimizer: sqrt")."""
        p = self.phases
        peaks = [(p.forward_peak_bytes, p.forward_peak_at), (p.backward_peak_bytes, p.backward_peak_at),
                 (p.optimizer_peak_bytes, p.optimizer_peak_at)]  # fmt: skip
        return max(peaks, key=lambda x: x[0])[1]

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.state_change_bytes

    @property
    def state_bytes(self) -> int:
        """Model state per GPU between steps, after ZeRO and offload (and ZeRO-3's gathered layers)."""
        return self.model_state_bytes + self.state_change_bytes

    @property
    def transient_bytes(self) -> int:
        """Everything else live at the peak: activations, logits, gradients, temporaries, the inputs."""
        return self.peak_bytes - self.model_state_bytes


@functools.lru_cache(maxsize=4096)  # the toolbox and fit ask for the same configs again and again
def exact_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> ExactMemory:
    """The verdict for one trick set: the replayed step's peak, its model state sharded as the setup says."""
    s = setup
    phases = step_phases(model.shape, s.seq_len, s.micro_batch, tricks, s.grad_accum, s.stack, s.optimizer)
    own = n_params(model.shape)
    change = host = 0
    if s.parallel != Parallel():  # ZeRO or offload: the state per GPU by formula, as memcalc.memory.state shards it
        one_gpu = model_state(own, tricks.precision, s.optimizer, Parallel(), s.stack.recipe)
        here = model_state(own, tricks.precision, s.optimizer, s.parallel, s.stack.recipe)
        change, host = here.total_bytes - one_gpu.total_bytes, here.host_bytes
        if s.parallel.gathers_layers:  # ZeRO-3 gathers layers back, as the textbook charges them
            change += zero3_gather_bytes(largest_layer_params(model.shape), model.shape.n_layers, tricks.precision,
                                         weights_held_elsewhere(here))  # fmt: skip
    return ExactMemory(tricks, own, phases, change, gpu.usable_bytes, host, s.host_usable_bytes)


def not_replayed_for(setup: Setup, trick_sets, shape: ModelShape | None = None) -> str:
    """Why the exact model cannot replay these steps ("" when it can): then the verdict is the textbook's.
    The stack decides, and the shape where one is given (mixture-of-experts layers, latent attention)."""
    s = setup.stack
    reasons = [not_replayed(s.model, s.recipe, s.impl, setup.optimizer, t.precision) for t in trick_sets]
    reasons.append(None if shape is None else shape_not_replayed(shape, s.model, s.recipe, s.impl))
    if not setup.routing.balanced:  # verify's reference router is the balanced one
        reasons.append("the exact model replays balanced routing; a capacity factor or an imbalance is the textbook's")
    return next((r for r in reasons if r), "")
