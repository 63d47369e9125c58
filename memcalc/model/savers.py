"""The memory savers a fine-tuning stack turns on beside its step (issue 40): activation offloading, Liger's kernels.

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

  liger    TrainingArguments(use_liger_kernel=True): the Trainer's apply_liger_kernel (transformers 5.25
           integrations/liger.py) patches the model with liger-kernel 0.8.5's defaults (RoPE, RMSNorm, SwiGLU and
           the head fused with the cross-entropy), replayed by memcalc.exact.hf.liger. Its kernels are Triton's; what
           they hold is what their Python wrappers allocate, and three of those allocations follow the GPU (Liger)

The record travels with the stack (memcalc.model.stacks.Stack.savers), so the replay, its cache and the notes
read the same one.
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

OFFLOAD_MIN_BYTES = 1024  # OffloadActivations(min_offload_size=1024), torchtune 0.6.1 and trl 1.16.0
OFFLOAD_STASH = 5  # OffloadActivations(max_fwd_stash_size=5): offloaded tensors kept alive until their copy is done


@record(frozen=True)
class Liger:
    """What liger-kernel 0.8.5's wrappers allocate differently by device (liger_kernel/ops): sms, the rows of fp32
    partial weight gradients RMSNorm's backward writes (rms_norm.py rms_norm_backward: the GPU's
    multi_processor_count, 1 off CUDA); mm_out, the fused cross-entropy's logits chunk made once and reused
    (fused_linear_cross_entropy.py _can_use_mm_out: CUDA, not ROCm); addmm, the head's gradient accumulated in place
    (compute capability 8 or more), where else each chunk's product is a new tensor added to it."""

    sms: int
    mm_out: bool = True
    addmm: bool = True


@record(frozen=True)
class Savers:
    """The memory savers on: offload, the stack's activation offloading (TRL's OffloadActivations on a trl stack,
    Transformers' checkpoint offload on hf); liger, Liger's kernels as the Trainer applies them, on this GPU."""

    offload: bool = False
    liger: Liger | None = None

    @property
    def labels(self) -> list[str]:
        """What the stack's label adds: ['activations offloaded', 'Liger kernels'] or fewer."""
        return ["activations offloaded"] * self.offload + ["Liger kernels"] * (self.liger is not None)


NO_SAVERS = Savers()
ON_META = Liger(sms=1, mm_out=True, addmm=False)  # what verify/liger.py measures liger-kernel's wrappers running


def liger_for(gpu) -> Liger:
    """Liger's device-dependent allocations on this GPU (memcalc.model.gpus.GPU): its SM count, CUDA's mm into the
    logits buffer (not on ROCm: _can_use_mm_out), the head's gradient by addmm in place from compute capability 8
    (get_device_capability; ROCm's gfx9 cards report 9)."""
    if not gpu.sms:
        raise InputError(f"--liger: Liger's RMSNorm backward keeps one fp32 row per SM, and {gpu.name}'s SM count is "
                         "not known (give sms in the --gpu file)")  # fmt: skip
    if not gpu.rocm and gpu.capability is None:
        raise InputError(f"--liger: the head's gradient is added in place from compute capability 8, and {gpu.name}'s "
                         f"arch {gpu.arch!r} names none (sm80, sm90, ... in the --gpu file)")  # fmt: skip
    return Liger(gpu.sms, mm_out=not gpu.rocm, addmm=gpu.rocm or gpu.capability >= 80)


def check_liger(stack_key: str, model: str, offload: bool) -> None:
    """--liger where the replay has it: the Trainer's use_liger_kernel on Transformers' classes (--stack hf, or TRL's
    SFTTrainer over it), without activation offloading. (The families and recipes it replays:
    memcalc.exact.hf.liger.not_replayed.)"""
    if model != "hf":
        raise InputError(f"--liger is the Trainer's use_liger_kernel on Transformers' classes (--stack hf or trl), "
                         f"not --stack {stack_key}")  # fmt: skip
    if offload:
        raise InputError("--liger with --offload-activations is not replayed")


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


def liger_note(savers: Savers, fused_head: bool = False) -> str:
    """What Liger changed, in a line for the verdict's notes; '' without it. fused_head: TRL's own fused LM head in
    place of Liger's fused cross-entropy (TRL from 1.15 sets liger_kernel_config fused_linear_cross_entropy False)."""
    liger = savers.liger
    if liger is None:
        return ""
    head = ("TRL's fused LM head in place of Liger's cross-entropy (liger_kernel_config fused_linear_cross_entropy "
            "False)" if fused_head else "the head fused with the cross-entropy (no logits: the input's gradient made "
            "in forward, in chunks of rows)")  # fmt: skip
    return ("Liger's kernels (TrainingArguments(use_liger_kernel=True), liger-kernel 0.8.5): RMSNorm saving its input "
            "and fp32 rstd, RoPE in place, SwiGLU saving gate and up and writing their gradients over them, "
            f"{head}; a trained norm's backward keeps {liger.sms} fp32 rows of partial gradients, one per "
            "SM")  # fmt: skip


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
