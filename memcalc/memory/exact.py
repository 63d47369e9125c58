"""The verdict's memory: the chosen stack's training step replayed op by op (memcalc.exact), at its peak.

The textbook (memcalc.memory.estimate.memory_for) adds model state, activations at their backward peak
and the logits. What PyTorch holds at the step's peak is whatever is live then: at 8B with
checkpointing that is the optimizer step (the gradients and its temporaries beside the state), not the
backward pass. memcalc.exact.step.exact_step replays the step (one and two blocks, grown to the depth)
and is equal to the meta measurement to the byte; this module makes a per-GPU verdict of it.

The replay is of one GPU and the shape as built (its own parameter count, not a --params override).
ZeRO and offload shard or move the model state by formula (memcalc.memory.state); the step's
transients (activations, logits, gradients in flight, optimizer temporaries) stay one GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.exact.step import exact_step
from memcalc.model.gpus import GPU
from memcalc.model.shape import Model, layer_params, n_params
from memcalc.model.tricks import Tricks

from .setup import Budget, Setup
from .state import Parallel, model_state, weights_held_elsewhere, zero3_gather_bytes


@dataclass(slots=True)
class ExactMemory(Budget):
    """One trick set's whole-step peak per GPU, as the stack's step allocates it."""

    tricks: Tricks
    n_params: int  # the shape's own count: what the replay builds
    model_state_bytes: int  # weights, buffers, master and optimizer state: live between steps
    peak_bytes: int  # the step's peak with one GPU's state (before ZeRO and offload)
    peak_at: str  # the phase and the op at the peak ("backward: mul")
    state_change_bytes: int  # what ZeRO and offload take off the state (negative) or ZeRO-3 adds as buffers
    usable_bytes: int
    host_bytes: int
    host_usable_bytes: int

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


def exact_memory(model: Model, setup: Setup, gpu: GPU, tricks: Tricks) -> ExactMemory:
    """The verdict for one trick set: the replayed step's peak, its model state sharded as the setup says."""
    s = setup
    phases = exact_step(model.shape, s.seq_len, s.micro_batch, tricks, s.grad_accum, s.stack, s.optimizer).phases
    own = n_params(model.shape)
    one_gpu = model_state(own, tricks.precision, s.optimizer, Parallel(), s.stack.recipe)
    here = model_state(own, tricks.precision, s.optimizer, s.parallel, s.stack.recipe)
    change = here.total_bytes - one_gpu.total_bytes
    if s.parallel.gathers_layers:  # ZeRO-3 gathers layers back, as the textbook charges them
        change += zero3_gather_bytes(layer_params(model.shape), model.shape.n_layers, tricks.precision,
                                     weights_held_elsewhere(here))  # fmt: skip
    return ExactMemory(tricks, own, phases.state_bytes, phases.step_peak_bytes, peak_phase(phases), change,
                       gpu.usable_bytes, here.host_bytes, s.host_usable_bytes)  # fmt: skip


def peak_phase(phases) -> str:
    """Where the step peaks: the phase (and op) of the highest of its three peaks."""
    peaks = [(phases.forward_peak_bytes, phases.forward_peak_at), (phases.backward_peak_bytes, phases.backward_peak_at),
             (phases.optimizer_peak_bytes, phases.optimizer_peak_at)]  # fmt: skip
    return max(peaks, key=lambda p: p[0])[1]
