"""The memory savers a fine-tuning stack turns on beside its step (issue 40): activation offloading.

  offload  the tensors autograd saves in forward copied to pinned host memory and brought back in backward, by
           a torch.autograd.graph.saved_tensors_hooks context (memcalc.exact.sim.offload replays it):
             trl   TRL's SFTConfig(activation_offloading=True): OffloadActivations around training_step
                   (trl 1.16.0 trl/models/activation_offloading.py, adapted from torchtune 0.6.1
                   torchtune/training/_activation_offloading.py): every saved tensor of 1,024 bytes or more but
                   parameters, on a side stream, the last five offloaded kept on the GPU until their copy is done,
                   a storage already in that stash not offloaded again; lm_head's forward excluded (NoOpManager)
             ckpt  Transformers' activation_checkpointing_kwargs={"offload": True} (transformers 5.25
                   modeling_utils.py _activation_checkpointing_enable): each checkpointed layer's call under
                   torch.autograd.graph.save_on_cpu(pin_memory=True), which packs the one tensor saved outside the
                   checkpoint's own hooks, the layer's input (torch/utils/checkpoint.py _NoopSaveInputs), on the
                   compute stream

The record travels with the stack (memcalc.model.stacks.Stack.savers), so the replay, its cache and the notes
read the same one.
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

OFFLOAD_MIN_BYTES = 1024  # OffloadActivations(min_offload_size=1024), torchtune 0.6.1 and trl 1.16.0
OFFLOAD_STASH = 5  # OffloadActivations(max_fwd_stash_size=5): offloaded tensors kept alive until their copy is done


@record(frozen=True)
class Savers:
    """The memory savers on: offload, the stack's activation offloading (TRL's OffloadActivations on a trl stack,
    Transformers' checkpoint offload on hf)."""

    offload: bool = False

    @property
    def labels(self) -> list[str]:
        """What the stack's label adds: ['activations offloaded'] or []."""
        return ["activations offloaded"] if self.offload else []


NO_SAVERS = Savers()


def offload_mode(trl: str) -> str:
    """Whose offloading the stack runs: "trl" (OffloadActivations) on a TRL stack, "ckpt" (the checkpoints' inputs
    under save_on_cpu) on the Trainer alone."""
    return "trl" if trl else "ckpt"


def check_offload(stack_key: str, model: str, trl: str) -> None:
    """--offload-activations where a stack's own code offloads: TRL's OffloadActivations (trl:0.25, the line
    replayed with SFTConfig's activation_offloading) or Transformers' checkpoint offload (--stack hf)."""
    if model != "hf":
        raise InputError(f"--offload-activations is replayed as TRL's and Transformers' trainers run it (--stack "
                         f"trl:0.25, or hf with ckpt), not on --stack {stack_key}")  # fmt: skip
    if trl and trl != "0.25":
        raise InputError(f"--offload-activations: SFTConfig(activation_offloading=True) is replayed on the TRL "
                         f"0.22-0.25 line (--stack trl:0.25), not {stack_key}")  # fmt: skip


def check_offload_tricks(stack_key: str, trl: str, recompute: str) -> None:
    """Transformers' Trainer offloads only checkpointed layers' inputs: without ckpt there is nothing it offloads."""
    if not trl and recompute != "full":
        raise InputError(f"--offload-activations on --stack {stack_key} is Transformers' activation_checkpointing_"
                         "kwargs={'offload': True}: it offloads the checkpointed layers' inputs, so it needs ckpt in "
                         "--tricks (or --stack trl:0.25: TRL's OffloadActivations offloads every saved "
                         "tensor)")  # fmt: skip


def offload_note(savers: Savers, trl: str) -> str:
    """Where the activations went, in a line for the verdict's notes; '' without offloading."""
    if savers.offload and trl:
        return ("activations offloaded (TRL's SFTConfig(activation_offloading=True): trl 1.16.0 "
                "trl/models/activation_offloading.py OffloadActivations): every saved tensor of 1,024 bytes or more "
                "but the parameters to pinned host memory on a side stream, the last five kept on the GPU until "
                "their copy is done, lm_head's input kept; brought back in backward, each freed after the next "
                "node that brings one back")  # fmt: skip
    if savers.offload:
        return ("activations offloaded (Transformers' activation_checkpointing_kwargs={'offload': True}: "
                "torch.autograd.graph.save_on_cpu around each checkpointed layer): each layer's checkpointed input "
                "in pinned host memory, copied on the compute stream, brought back for its recompute")  # fmt: skip
    return ""
