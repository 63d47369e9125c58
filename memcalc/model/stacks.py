"""Training stacks: whose code runs the step, and so what it allocates.

memcalc's numbers depend on four choices a stack makes (and --recipe, --optimizer-impl override):
  model      whose op sequence: memcalc's reference layer (verify/builder.py), or Hugging Face
             Transformers' modeling_<arch>.py (its RMSNorm upcasts, fp32 rotary tables, fp32 logits)
  recipe     how a 16-bit trick set trains:
               master    16-bit weights and grads, fp32 master and optimizer state (Micikevicius et al.
                         2018): 2 + 2 + 4 + 4 + 4 = 16 bytes/param with AdamW
               autocast  fp32 weights, grads and optimizer state; torch.autocast casts to 16 bits per op
                         and caches the weights' casts (torch/amp/autocast_mode.py): 4 + 4 + 4 + 4 = 16
               pure      16-bit weights, grads and optimizer state, no master (a model loaded in bf16;
                         torch.optim makes m and v zeros_like(param)): 2 + 2 + 2 + 2 = 8
             fp32 trains in fp32 whatever the recipe.
  impl       the optimizer's implementation: reference (verify/recipes.py's per-tensor AdamW, one
             temporary), loop (torch.optim with foreach=False), foreach (torch.optim's default on CUDA:
             list temporaries over all tensors at once), fused (one kernel per group, no temporaries)
  engine     who splits the model over GPUs (memcalc.parallel.engines): none (memcalc's generic ZeRO
             layouts), fsdp2 (torchtitan's FSDP2), megatron (Megatron-LM), deepspeed (DeepSpeed ZeRO)
  trl        Hugging Face TRL's SFTTrainer around Transformers' Trainer, by the release line whose code the
             replay follows (memcalc.exact.hf.trl): how it prepares a 4-bit model for LoRA and what its
             compute_loss computes beside the loss
The engine stacks also fix their recipe: torchtitan's fully_shard keeps fp32 sharded parameters (autocast:
the fp32 weights are the master), Megatron-LM an fp32 main_grad buffer beside bf16 weights (main_grad),
DeepSpeed ZeRO an fp32 copy of the gradient partition (grad_partition).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

from memcalc.errors import InputError
from memcalc.records import record

from .finetune import FULL, Finetune
from .savers import NO_SAVERS, Liger, Savers, check_liger, check_offload, check_offload_tricks

if TYPE_CHECKING:
    from .rl import OnlineRL, Ppo

MODELS = ("reference", "hf", "torchtune")
# the loss over the logits: full (cross-entropy over the whole logits, the head's output in one tensor: TRL's
# loss_type "nll"), chunked (torchtune's CEWithChunkedOutputLoss: the head and the loss in 8 chunks of the sequence,
# each upcast to fp32), or chunked_nll (TRL's loss_type "chunked_nll": the head and the loss 256 positions at a time,
# each under checkpointing: memcalc.exact.hf.chunked_nll)
LOSSES = ("full", "chunked", "chunked_nll")
RL = ("", "dpo", "grpo", "rloo", "ppo")  # --rl: preference and online RL training as TRL's trainers run them ("": SFT)
LOSS_SPELLINGS = {"nll": "full"}  # --loss nll: TRL's name for the cross-entropy over the whole logits
RECIPES = ("master", "autocast", "pure", "main_grad", "grad_partition")
IMPLS = ("reference", "loop", "foreach", "fused")
ENGINES = ("none", "fsdp2", "megatron", "deepspeed")
# TRL's SFTTrainer, by the last release of each line whose code differs in what it allocates
# (huggingface/trl trl/trainer/sft_trainer.py, trl/models/utils.py at each tag):
#   0.14  0.9-0.14: a 4-bit model prepared (peft prepare_model_for_kbit_training, then
#         peft_module_casting_to_bf16 under bf16)
#   0.21  0.15-0.21: and compute_loss's token accuracy (a contiguous copy of the shifted logits, its argmax)
#   0.25  0.22-0.25: and the logits' entropy (in chunks of 128 rows, no grad); the model called with use_cache=False
#   1.2   0.26-1.2: no k-bit preparation (gone in 0.26): a 4-bit model's trainable parameters cast to bf16 after
#         get_peft_model; compute_loss's metrics as 0.25's
#   1.5   1.3-1.5: the entropy over the shifted logits (copied), masked by the labels; the accuracy copies them again
#   1.6   1.6: one block over the shifted views (entropy_from_logits' reshape copies them); loss_type "chunked_nll"
#         (from 1.4, not the default) keeps the labelled positions (hidden[valid]) and runs each chunk's head in fp32
#   1.7   1.7: the same, chunked_nll the default (sft_config.py __post_init__, unless use_liger_kernel)
#   1.8   1.8: chunked_nll orders every position by the label mask (argsort) and tests the count against 0
#   1.9   1.9: the same (GRPOTrainer's loss rescales its normalizer to one accumulation window from 1.9.1, and
#         divides the logits by the temperature in place, logits.div_, up to 1.9)
#   1.10  1.10: the same (GRPOTrainer divides out of place: logits / temperature)
#   1.12  1.11-1.12: chunked_nll clamps the chunk count instead
#   1.13  1.13: chunked_nll's matmul in the rows' dtype (w.to(h.dtype)), its logits upcast after
#   1.14  1.14: the nll block's entropy by trl's Triton kernel (selective_log_softmax_and_entropy)
#   1.16  1.15-1.16: the same cast but for DoRA's magnitudes, and the loss from add_fused_lm_head's chunked
#         log-probabilities (no logits)
TRL_RELEASES = ("", "0.14", "0.21", "0.25", "1.2", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.12", "1.13", "1.14",
                "1.16")  # fmt: skip
TRL_FIRST = {"0.14": "0.9", "0.21": "0.15", "0.25": "0.22", "1.2": "0.26", "1.5": "1.3", "1.6": "1.6", "1.7": "1.7",
             "1.8": "1.8", "1.9": "1.9", "1.10": "1.10", "1.12": "1.11", "1.13": "1.13", "1.14": "1.14",
             "1.16": "1.15"}  # each line's first release  # fmt: skip


def line_of(version: str) -> str | None:
    """The --stack trl:LINE whose releases hold a TRL version ("1.6.0", "1.9.2"), or None (a development build,
    "1.6.0.dev0", sits between releases; a version outside every line)."""
    m = re.match(r"(\d+)\.(\d+)(\.\d+)*$", version.strip())
    if m is None:
        return None
    at = (int(m[1]), int(m[2]))
    return next((line for line, first in TRL_FIRST.items() if minor(first) <= at <= minor(line)), None)


def minor(version: str) -> tuple[int, int]:
    major, minor_, *_ = version.split(".")
    return int(major), int(minor_)


def releases(line: str) -> str:
    """'1.11-1.12', or '1.13' for a line of one release."""
    return line if TRL_FIRST[line] == line else f"{TRL_FIRST[line]}-{line}"


KBIT_PREPARED = ("0.14", "0.21", "0.25")  # the lines whose SFTTrainer runs peft's prepare_model_for_kbit_training
FUSED_HEAD = ("1.16",)  # the lines whose SFTTrainer takes the loss from its fused LM head (memcalc.exact.hf.fused_head)
# the lines whose DPOTrainer takes its log-probabilities from the full logits (selective_log_softmax: memcalc.exact.hf
# .dpo_logits): 1.3-1.5 over .contiguous() copies of the shifted logits (DPO_COPIES), 1.6-1.13 over views of them
DPO_LOGITS, DPO_COPIES = ("1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.12", "1.13"), ("1.5",)
# the lines whose GRPOTrainer takes its log-probabilities from the logits (memcalc.exact.hf.grpo_logits), and those
# that divide them by the temperature in place (logits.div_)
GRPO_LOGITS, GRPO_DIV_IN_PLACE = ("1.9", "1.10", "1.12", "1.13"), ("1.9",)
# the lines whose SFTTrainer casts a 4-bit model's trainable parameters to bf16: whether DoRA's magnitudes too
BF16_CAST = {"1.2": True, "1.5": True, "1.6": True, "1.7": True, "1.8": True, "1.9": True, "1.10": True, "1.12": True,
             "1.13": True, "1.14": True, "1.16": False}  # excluded from 1.15 (huggingface/trl #7268)
# the lines whose SFTTrainer runs loss_type="chunked_nll" (--loss chunked_nll; 1.4-1.5 have it too, inside the 1.3-1.5
# line, whose 1.3 has not), those where it is SFTConfig's default (1.7-1.14: the stack's loss), and those whose chunk
# runs the head in fp32 (h.float() @ w.float().t(), up to 1.12)
CHUNKED_NLL = ("1.6", "1.7", "1.8", "1.9", "1.10", "1.12", "1.13", "1.14")
CHUNKED_DEFAULT = ("1.7", "1.8", "1.9", "1.10", "1.12", "1.13", "1.14")
CHUNKED_FP32 = ("1.6", "1.7", "1.8", "1.9", "1.10", "1.12")
# what each line's compute_loss computes from the logits beside the loss (memcalc.exact.hf.trl)
METRICS = {"0.21": "token accuracy", "0.25": "entropy of the logits and token accuracy",
           "1.2": "entropy of the logits and token accuracy",
           "1.5": "entropy of the shifted logits (a copy) and token accuracy (another)",
           **{line: "entropy and token accuracy of the shifted logits (entropy_from_logits' reshape copies them)"
              for line in ("1.6", "1.7", "1.8", "1.9", "1.10", "1.12", "1.13")},
           "1.14": "entropy (trl's Triton kernel) and token accuracy of the shifted logits"}  # fmt: skip


@record(frozen=True)
class Stack:
    """Whose code trains: the model's op sequence, the 16-bit recipe, the optimizer, the engine."""

    key: str
    name: str
    model: str  # reference | hf: whose op sequence
    recipe: str  # master | autocast | pure: how the 16-bit trick sets train
    impl: str  # reference | loop | foreach | fused: the optimizer's implementation
    source: str  # where its choices come from
    engine: str = "none"  # none | fsdp2 | megatron | deepspeed: whose code splits the model over GPUs
    use_cache: bool = False  # hf: the forward keeps Transformers' DynamicCache (config.use_cache, its default)
    finetune: Finetune = FULL  # which weights train (memcalc.model.finetune): all, or LoRA's adapters, or all but some
    trl: str = ""  # TRL's SFTTrainer release line around the Trainer (TRL_RELEASES); "" for none
    loss: str = "full"  # LOSSES: how the logits become the loss
    in_backward: bool = False  # torchtune's optimizer_in_bwd: each parameter stepped as its gradient is made
    savers: Savers = NO_SAVERS  # the memory savers on: activation offloading (memcalc.model.savers)
    reentrant: bool = False  # hf: ckpt's checkpoint with use_reentrant=True (gradient_checkpointing_kwargs)
    rl: str = ""  # RL: "dpo", "grpo" or "rloo", that TRL trainer in place of its SFTTrainer; "" for none
    precompute_ref: bool = False  # DPOConfig.precompute_ref_log_probs: the reference's log-probs come with the batch
    online: OnlineRL | None = None  # under --rl grpo or rloo: GRPOConfig's and RLOOConfig's settings (memcalc.model.rl)
    ppo: Ppo | None = None  # under --rl ppo: PPOConfig's settings (memcalc.model.rl)

    def __post_init__(self) -> None:
        for what, value, known in (("model", self.model, MODELS), ("recipe", self.recipe, RECIPES),
                                   ("optimizer implementation", self.impl, IMPLS), ("engine", self.engine, ENGINES),
                                   ("TRL release line", self.trl, TRL_RELEASES),
                                   ("loss", self.loss, LOSSES), ("--rl", self.rl, RL)):  # fmt: skip
            if value not in known:
                raise InputError(f"unknown {what} {value!r}; known: {', '.join(known)}")

    @property
    def label(self) -> str:
        """'torch (autocast, foreach)': the key, and what it was changed to where it was."""
        base = STACKS.get(self.key)
        changed = [x for x, y in ((self.recipe, base and base.recipe), (self.impl, base and base.impl)) if x != y]
        if base and self.use_cache != base.use_cache:
            changed.append("cache" if self.use_cache else "no cache")
        if base and self.loss != base.loss and not self.rl:  # an RL trainer computes its own loss
            trl_name = f"loss_type {'nll' if self.loss == 'full' else self.loss}"
            changed.append(trl_name if self.trl else f"{self.loss} loss")
        if self.in_backward:
            changed.append("optimizer in backward")
        if self.reentrant:
            changed.append("reentrant checkpointing")
        if self.rl:
            changed.append(self.rl.upper() + (", reference precomputed" if self.precompute_ref else "") +
                           (f", {self.online.label}" if self.online else "") +
                           (f", {self.ppo.label}" if self.ppo else ""))  # fmt: skip
        if self.finetune.label:
            changed.append(self.finetune.label)
        changed += self.savers.labels
        return self.key + (f" ({', '.join(changed)})" if changed else "")


STACKS: dict[str, Stack] = {
    s.key: s
    for s in (
        Stack("reference", "memcalc's reference loop", "reference", "master", "reference",
              "verify/builder.py and verify/recipes.py: the lesson's 16 bytes/param"),  # fmt: skip
        Stack("torch", "stock PyTorch", "reference", "autocast", "foreach",
              "torch.autocast over fp32 weights; torch.optim.AdamW defaults to foreach on CUDA "
              "(torch/optim/optimizer.py, _default_to_fused_or_foreach)"),  # fmt: skip
        Stack("hf", "Hugging Face Transformers (Trainer)", "hf", "autocast", "fused",
              "TrainingArguments: optim adamw_torch_fused for torch >= 2.8, bf16=True autocasts "
              "(transformers/training_args.py); the model's config.use_cache, on by default, keeps a "
              "DynamicCache through forward (memcalc/exact/hf/dynamic_cache.py)", use_cache=True),  # fmt: skip
        *(Stack(f"trl:{line}", f"Hugging Face TRL {first}-{line}'s SFTTrainer", "hf", "autocast", "fused",
                f"huggingface/trl trl/trainer/sft_trainer.py and trl/models/utils.py @ v{line}.0 ({commit}): "
                f"SFTTrainer over Transformers' Trainer (bf16=True autocasts, adamw_torch_fused)", trl=line,
                use_cache=line != "0.25")  # compute_loss passes use_cache=False from 0.22
          for line, commit in (("0.14", "29de6eec7ba9"), ("0.21", "a64ac0d5dc6b"), ("0.25", "9692b1688e70"))
          for first in (TRL_FIRST[line],)),  # fmt: skip
        *(Stack(f"trl:{line}", f"Hugging Face TRL {releases(line)}'s SFTTrainer", "hf", "autocast", "fused",
                f"huggingface/trl trl/trainer/sft_trainer.py and trl/trainer/utils.py, as the trl {wheels} wheels "
                f"ship them (PyPI): SFTTrainer over Transformers' Trainer (bf16=True autocasts, adamw_torch_fused), a "
                f"4-bit model's trainable parameters cast to bf16, "
                + ("loss_type chunked_nll (SFTConfig's default: compute_loss's metrics from its counts; under nll, "
                   f"its {METRICS[line]})" if line in CHUNKED_DEFAULT else f"compute_loss's {METRICS[line]}"), trl=line,
                loss="chunked_nll" if line in CHUNKED_DEFAULT else "full")
          for line, wheels in (("1.2", "0.26.2 to 1.2.0"), ("1.5", "1.3.0 to 1.5.1"), ("1.6", "1.6.0"),
                               ("1.7", "1.7.1"), ("1.8", "1.8.0"), ("1.9", "1.9.0 to 1.9.2"), ("1.10", "1.10.0"),
                               ("1.12", "1.11.0 and 1.12.0"),
                               ("1.13", "1.13.0"), ("1.14", "1.14.0 to 1.14.2"))),
        # fmt: skip
        Stack("trl:1.16", "Hugging Face TRL 1.15-1.16's SFTTrainer", "hf", "autocast", "fused",
              "huggingface/trl trl/trainer/sft_trainer.py, trl/trainer/utils.py add_fused_lm_head and "
              "trl/kernels/chunked_logprob.py, as the trl 1.16.0 wheel ships them (PyPI): SFTTrainer over "
              "Transformers' Trainer (bf16=True autocasts, adamw_torch_fused), the loss from the fused LM head",
              trl="1.16"),  # fmt: skip
        Stack("torchtune", "torchtune's single-device recipes", "torchtune", "pure", "foreach",
              "pytorch/torchtune recipes/full_finetune_single_device.py and lora_finetune_single_device.py @ v0.6.1: "
              "the model built in its dtype (training.set_default_dtype, no autocast), torch.optim.AdamW "
              "(foreach on CUDA), CEWithChunkedOutputLoss(num_output_chunks=8) as its configs set it",
              loss="chunked"),  # fmt: skip
        Stack("fsdp2", "FSDP2 as torchtitan runs it", "reference", "autocast", "fused",
              "torchtitan/distributed/fsdp.py apply_fsdp_to_decoder: fully_shard per block with "
              "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 sharded parameters; "
              "torchtitan/components/optimizer/optimizer.py implementation 'fused'", "fsdp2"),  # fmt: skip
        Stack("megatron", "Megatron-LM", "reference", "main_grad", "fused",
              "megatron/training/arguments.py: bf16 params with fp32 main_grad accumulation; "
              "megatron/core/optimizer: fp32 main params and Adam state (TE/apex FusedAdam)", "megatron"),  # fmt: skip
        Stack("deepspeed", "DeepSpeed ZeRO", "reference", "grad_partition", "fused",
              "deepspeed/runtime/zero/stage_1_and_2.py and stage3.py: 16-bit params and grads, fp32 "
              "partitions of params, grads and Adam state (FusedAdam)", "deepspeed"),  # fmt: skip
    )
}
DEFAULT_STACK = STACKS["reference"]


def stack_for(name: str = "reference", recipe: str | None = None, impl: str | None = None,
              no_cache: bool = False, offload: bool = False, liger: Liger | None = None,
              reentrant: bool = False) -> Stack:  # fmt: skip
    """--stack NAME, with --recipe, --optimizer-impl, --no-cache, --offload-activations, --liger (its record for
    the GPU: memcalc.model.savers.liger_for) and --reentrant changing what it picks."""
    key = name.strip().lower()
    if key not in STACKS:
        raise InputError(f"unknown stack {name!r}; known: {', '.join(STACKS)}")
    changes: dict = {k: v.strip().lower() for k, v in (("recipe", recipe), ("impl", impl)) if v is not None}
    if no_cache:
        if not STACKS[key].use_cache:
            raise InputError(f"--no-cache turns off Transformers' DynamicCache (--stack hf); --stack {key} keeps none")
        changes["use_cache"] = False
    if offload:
        check_offload(key, STACKS[key].model, STACKS[key].trl)
    if liger is not None:
        check_liger(key, STACKS[key].model, offload)
        if STACKS[key].trl in BF16_CAST and STACKS[key].trl not in FUSED_HEAD:  # from 1.15 its own fused LM head
            raise InputError(f"--liger on --stack {key}: SFTTrainer from 0.26 asks Liger's cross-entropy for the token "
                             "accuracy (return_token_accuracy), which is not replayed; --stack trl:0.25 or "
                             "hf")  # fmt: skip
    if offload or liger is not None:
        changes["savers"] = Savers(offload=offload, liger=liger)
    if reentrant:
        if STACKS[key].model != "hf":
            raise InputError("--reentrant is Transformers' gradient_checkpointing_kwargs={'use_reentrant': True} "
                             f"(--stack hf or trl), not --stack {key}, whose checkpointing is non-reentrant")  # fmt: skip
        if offload:
            raise InputError("--reentrant with --offload-activations is not replayed")
        changes["reentrant"] = True
    return replace(STACKS[key], **changes) if changes else STACKS[key]


def with_loop(stack: Stack, loss: str | None = None, in_backward: bool = False) -> Stack:
    """--loss and --optimizer-in-backward on the stack: the chunked loss is torchtune's own loss, and the step in
    backward its recipes' optimizer_in_bwd, so both are refused on the stacks whose code has neither."""
    changes: dict = {}
    if loss is not None:
        key = loss.strip().lower()
        key = LOSS_SPELLINGS.get(key, key)
        if key not in LOSSES:
            raise InputError(f"unknown --loss {loss!r}; known: {', '.join(LOSSES + tuple(LOSS_SPELLINGS))}")
        if key == "chunked" and stack.model != "torchtune":
            raise InputError(f"--loss chunked is torchtune's CEWithChunkedOutputLoss (--stack torchtune); --stack "
                             f"{stack.key}'s step computes the loss over the whole logits")  # fmt: skip
        if key == "chunked_nll" and stack.trl not in CHUNKED_NLL:
            raise InputError(f"--loss chunked_nll is TRL's SFTConfig(loss_type='chunked_nll'), replayed on "
                             f"{', '.join('trl:' + x for x in CHUNKED_NLL)} (1.6-1.14; 1.15 folded it into its fused "
                             f"LM head), not --stack {stack.key}")  # fmt: skip
        changes["loss"] = key
    if in_backward:
        if stack.model != "torchtune":
            raise InputError("--optimizer-in-backward is torchtune's optimizer_in_bwd (--stack torchtune); --stack "
                             f"{stack.key} steps the optimizer after backward")  # fmt: skip
        if stack.finetune.lora:
            raise InputError("--optimizer-in-backward: torchtune's LoRA recipe (lora_finetune_single_device) has no "
                             "optimizer_in_bwd; its full fine-tuning recipe has")  # fmt: skip
        changes["in_backward"] = True
    return replace(stack, **changes) if changes else stack


def trl_note(stack: Stack) -> str:
    """What the replay takes of TRL's SFTTrainer (memcalc.exact.hf.trl), in a line for the verdict's notes; ''
    without TRL."""
    line = stack.trl
    if not line:
        return ""
    if stack.rl == "ppo":
        from .rl import ppo_note

        return ppo_note(stack)
    parts = []
    if line in BF16_CAST and stack.finetune.quantize:
        parts.append("the 4-bit model's adapters cast to bf16, nothing else prepared")
    if (line in FUSED_HEAD or line in GRPO_LOGITS) and stack.online is not None:
        from .rl import online_note

        return online_note(stack)
    if line in FUSED_HEAD and stack.rl == "dpo":
        from .rl import dpo_reference

        parts.append(f"each pair's chosen and rejected sequences through add_fused_lm_head (no logits), then "
                     f"{dpo_reference(stack)}; dropout disabled; every position a completion token")
        return f"TRL {releases(line)}'s DPOTrainer (sigmoid loss): " + "; ".join(parts)
    if line in DPO_LOGITS and stack.rl == "dpo":
        from .rl import dpo_reference

        copies = ", .contiguous() copies of the shifted logits" if line in DPO_COPIES else ""
        parts.append(f"each pair's chosen and rejected sequences to their full logits (Accelerate's fp32 copy under "
                     f"autocast{copies}), selective_log_softmax row by row, then {dpo_reference(stack)} to its "
                     f"logits; entropy, mean logits and accuracy from the logits; dropout disabled; every position a "
                     f"completion token")  # fmt: skip
        return f"TRL {releases(line)}'s DPOTrainer (sigmoid loss): " + "; ".join(parts)
    if line in FUSED_HEAD:
        parts.append("the loss from add_fused_lm_head's chunked log-probabilities (no logits: 4096 x 32768 tiles, "
                     "fp32 per-token statistics)")  # fmt: skip
        return f"TRL {releases(line)}'s SFTTrainer: " + "; ".join(parts)
    if line in KBIT_PREPARED and stack.finetune.quantize:
        parts.append("the 4-bit model prepared by peft's prepare_model_for_kbit_training (what is not 4-bit in fp32: "
                     "its norms lift the residual stream to fp32) and, under bf16, peft_module_casting_to_bf16 "
                     "(embeddings and head back in bf16)")  # fmt: skip
    if stack.loss == "chunked_nll":
        parts.append("loss_type chunked_nll: the head and the loss 256 positions at a time, each under checkpointing "
                     "(no logits)" + (", a 16-bit head copied to fp32 per chunk" if line in CHUNKED_FP32 else ""))
    elif line in METRICS and stack.savers.liger is None:  # under use_liger_kernel compute_loss skips both: no logits
        parts.append(f"compute_loss's {METRICS[line]}")
    if line in CHUNKED_DEFAULT and stack.loss != "chunked_nll":
        parts.append("loss_type nll (SFTConfig's default from 1.7 is chunked_nll)")
    return f"TRL {releases(line)}'s SFTTrainer: " + ("; ".join(parts) or "the Trainer's step as it is")


def bf16_adapters(stack: Stack, magnitude: bool = False) -> bool:
    """SFTTrainer from 0.26 casts a 4-bit model's trainable parameters to bf16 after get_peft_model (sft_trainer.py:
    param.data = param.data.to(torch.bfloat16)), whatever bf16 or fp16 says, DoRA's magnitudes (magnitude) up to 1.14;
    before, PEFT's cast_adapter_dtype leaves them fp32."""
    cast = BF16_CAST.get(stack.trl)
    return cast is not None and bool(stack.finetune.quantize) and (cast or not magnitude)


def check_tricks(stack: Stack, tricks) -> None:
    """What the stack's own code can run. Transformers checkpoints every decoder layer or none
    (PreTrainedModel.gradient_checkpointing_enable wraps each GradientCheckpointingLayer): ckpt:N and
    torchtitan's per-op sac are not something its Trainer runs."""
    if tricks.flash and tricks.precision == "fp32" and stack.model != "hf":
        raise InputError("fp32,flash is Transformers' sdpa at fp32 (--stack hf: SDPA's memory-efficient kernel, or "
                         "its math path for grouped heads); FlashAttention needs 16 bits: combine flash with bf16 "
                         "or fp16")  # fmt: skip
    if stack.model in ("hf", "torchtune") and (tricks.mixed or tricks.recompute == "op"):
        raise InputError(f"{tricks.label}: --stack {stack.key} checkpoints every decoder layer or none "
                         "(gradient_checkpointing_enable, set_activation_checkpointing): use ckpt, or --stack torch "
                         "for ckpt:N and sac")  # fmt: skip
    if stack.model == "torchtune":
        check_torchtune_tricks(stack, tricks)
    if stack.savers.offload:
        check_offload_tricks(stack.key, stack.trl, tricks.recompute)
    if stack.reentrant and tricks.recompute != "full":
        raise InputError(f"{tricks.label}: --reentrant is how ckpt checkpoints each layer (use_reentrant=True); "
                         "without ckpt in --tricks nothing is checkpointed")  # fmt: skip
    if stack.engine in ("megatron", "deepspeed") and (tricks.fp8 or tricks.compile):
        what = f"{tricks.fp8_name} ({FP8_WHAT[tricks.fp8]})" if tricks.fp8 else "compile (torch.compile of each block)"
        raise InputError(f"{tricks.label}: {what} is replayed on --stack fsdp2, torch or reference; --stack "
                         f"{stack.key}'s own Transformer Engine modules are not modelled")  # fmt: skip


def check_torchtune_tricks(stack: Stack, tricks) -> None:
    """What torchtune's recipes run: the model in one 16-bit dtype (training.set_default_dtype, no autocast),
    attention by SDPA (its flash kernel, causal in 16 bits), every layer checkpointed or none."""
    if tricks.precision != "bf16" or not tricks.flash:
        raise InputError(f"{tricks.label}: --stack torchtune replays its recipes' bf16 model (dtype: bf16) with "
                         "SDPA's flash attention: use bf16,flash (with ckpt for enable_activation_checkpointing)")  # fmt: skip
    if tricks.recompute not in ("none", "full") or tricks.fp8 or tricks.compile:
        raise InputError(f"{tricks.label}: --stack torchtune replays enable_activation_checkpointing (ckpt) and "
                         "nothing else of the trick set (compile, fp8, selective checkpointing: not replayed)")  # fmt: skip


FP8_WHAT = {"tensorwise": "torchao's float8", "rowwise": "torchao's float8", "te": "Transformer Engine's te.Linear"}
