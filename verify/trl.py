"""Hugging Face TRL's SFTTrainer around the Trainer, as its release lines ran it (memcalc.model.stacks.TRL_RELEASES,
memcalc.exact.hf.trl): the preparation of a 4-bit model for LoRA, and what compute_loss computes beside the loss.

TRL is not a dependency here: what it adds is written out as each release has it (huggingface/trl
trl/trainer/sft_trainer.py, trl/models/utils.py, trl/trainer/utils.py at v0.14.0 29de6ee, v0.21.0 a64ac0d,
v0.25.0 9692b16), over the libraries it calls, which run as themselves: peft's prepare_model_for_kbit_training,
torch. The Trainer then enables activation checkpointing again (transformers 5 trainer.py: with
gradient_checkpointing, activation_checkpointing_enable(None), use_reentrant=False), which replaces the
reentrant checkpointing prepare_model_for_kbit_training enabled (its gradient_checkpointing_kwargs {} leave
use_reentrant unset, which torch.utils.checkpoint takes as True).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def prepare_kbit(model: nn.Module, checkpointing: bool) -> nn.Module:
    """SFTTrainer._prepare_model_for_kbit_training (0.9-0.21; prepare_peft_model from 0.22): peft's
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
    gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {})."""
    from .lora import peft

    return peft().prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                                  gradient_checkpointing_kwargs={})  # fmt: skip


def peft_module_casting_to_bf16(model: nn.Module) -> None:
    """trl/trainer/utils.py peft_module_casting_to_bf16 (the same from 0.9 to 0.25), after get_peft_model when
    args.bf16 and the model is loaded in 4 bits."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
            module = module.to(torch.float32)
        elif any(x in name for x in ["lm_head", "embed_tokens", "wte", "wpe"]):
            if hasattr(module, "weight"):
                if module.weight.dtype == torch.float32:
                    module = module.to(torch.bfloat16)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """trl/trainer/utils.py entropy_from_logits (0.22-0.25)."""
    original_shape = logits.shape[:-1]  # all dims except num_classes
    num_classes = logits.shape[-1]
    flat_logits = logits.reshape(-1, num_classes)
    entropies = []
    for chunk in flat_logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
        entropies.append(chunk_entropy)
    entropies = torch.cat(entropies, dim=0)
    return entropies.reshape(original_shape)


def compute_loss_metrics(line: str, logits: torch.Tensor, labels: torch.Tensor) -> list:
    """SFTTrainer.compute_loss after super().compute_loss, on one process (gather_for_metrics returns its
    tensor): 0.22-0.25's entropy (no_grad) weighted by the collator's all-ones attention mask, then the token
    accuracy (0.15-0.21 with grad on: its ops save nothing). The locals are returned: they live until
    compute_loss returns, with the logits."""
    if line not in ("0.21", "0.25"):
        return []
    held = []
    with torch.no_grad() if line == "0.25" else torch.enable_grad():
        if line == "0.25":
            per_token_entropy = entropy_from_logits(logits)
            attention_mask = torch.ones(labels.shape, dtype=torch.long, device=labels.device)  # the collator's
            entropy = torch.sum(per_token_entropy * attention_mask) / attention_mask.sum()
            entropy = item(entropy.mean())  # noqa: F841  (gather_for_metrics(entropy).mean().item(), one process)
            held += [per_token_entropy, attention_mask]
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        predictions = shift_logits.argmax(dim=-1)
        mask = shift_labels != IGNORE_INDEX
        correct_predictions = (predictions == shift_labels) & mask
        total_tokens = mask.sum()
        correct_tokens = correct_predictions.sum()
        total_sum = total_tokens.sum()
        positive = item(total_sum > 0)  # `if total_sum > 0`: a 0-d bool on the device, gone once tested
        accuracy = item(correct_tokens.sum() / total_sum) if positive is not False else 0.0  # noqa: F841
        held += [shift_logits, shift_labels, predictions, mask, correct_predictions, total_tokens, correct_tokens,
                 total_sum]  # fmt: skip
    return held


def item(t: torch.Tensor):
    """t.item() (a copy to the host: nothing on the device); None on meta, which has no values (the expression
    then runs as if the condition held)."""
    return None if t.device.type == "meta" else t.item()
