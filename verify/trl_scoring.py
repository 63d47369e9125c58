"""TRL 1.16's scoring passes between generating and training, measured: GRPOTrainer's and RLOOTrainer's own
_get_per_token_logps_and_entropies over the padded generation batch as _generate_and_score_completions calls it
(torch.no_grad(), disable_gradient_checkpointing, chunks of per_device_train_batch_size rows), the policy's pass and
the reference's, on CPU tensors at reduced size under verify/track.py's LiveBytes. The batch's tensors and what runs
between the passes (RLOO's old_logps, GRPO's importance-sampling ratio under vLLM) are made as the trainer makes them
(trl/trainer/grpo_trainer.py and rloo_trainer.py, the trl 1.16.0 wheel).
"""

from __future__ import annotations

import math
import warnings

import torch

from memcalc.model.finetune import Finetune
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks

from .hf import build_hf, cuda_dropout
from .track import LiveBytes
from .trl_generate import EOS


def measure_scoring(shape: ModelShape, tricks: Tricks, rows: int, chunk: int, seq: int, settings, rl: str,
                    finetune: Finetune, autocast: bool, timeline: bool = False) -> LiveBytes:  # fmt: skip
    """The passes' live bytes on CPU tensors: the peak above the model (and the reference), the batch included.
    settings: memcalc.model.rl.OnlineRL."""
    from trl import GRPOTrainer, RLOOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer import grpo_trainer, rloo_trainer

    from .trl import fused_paths
    from .trl_grpo import prepared, stand_in

    torch.manual_seed(0)
    amp = ("cpu", torch.bfloat16) if autocast else None
    built = build_hf(shape, tricks, seq, device="cpu", autocast="cpu" if autocast else None, finetune=finetune,
                     trl="1.16", rl=rl, online=settings)  # fmt: skip
    model, reference = built.model, built.grpo.reference
    live = LiveBytes("cpu", timeline=timeline)
    live.track(list(model.parameters()) + list(model.buffers()))
    if reference is not None:
        live.track(list(reference.parameters()) + list(reference.buffers()))
    live.base = live.live_bytes
    C, grpo = settings.completion_len, rl == "grpo"
    trainer, module = (GRPOTrainer, grpo_trainer) if grpo else (RLOOTrainer, rloo_trainer)
    with live, torch.no_grad(), cuda_dropout(), fused_paths(), warnings.catch_warnings():  # the fused head's
        warnings.simplefilter("ignore", FutureWarning)  # CUDA path (verify/trl.py); is_gradient_checkpointing's note
        prompt_ids = torch.randint(EOS + 1, shape.vocab, (rows, seq - C))
        prompt_mask = torch.ones_like(prompt_ids)
        completion_ids = torch.randint(EOS + 1, shape.vocab, (rows, C))
        completion_mask = torch.ones_like(completion_ids)
        sampling = torch.zeros(rows, C) if grpo and settings.vllm else None
        num_items = completion_mask.sum().sum() if grpo else None  # accelerator.gather on one process: itself
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        live.reset_peak()
        this = stand_in(trainer, model, ids, amp)
        with prepared(model, amp, module), disable_gradient_checkpointing(model, {"use_reentrant": False}):
            old = between = None
            if not grpo or settings.vllm:  # RLOO always; GRPO where vLLM generated (importance sampling)
                old, _, _ = this._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=chunk)
                between = rloo_old(old, completion_mask) if not grpo else ratio(old, sampling, completion_mask)
            ref = None
            if settings.beta:
                ref = reference_logps(this, model, reference, ids, mask, C, chunk)
        del old, between, ref, sampling, num_items, ids, mask, prompt_ids, prompt_mask, completion_ids, completion_mask
    return live


def rloo_old(old: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """RLOOTrainer: old_logps = (old_per_token_logps * completion_mask).sum(1)."""
    return (old * completion_mask).sum(1)


def ratio(old: torch.Tensor, sampling: torch.Tensor, completion_mask: torch.Tensor) -> tuple:
    """GRPOTrainer's vllm_importance_sampling_correction, mode sequence_mask (its default), clip bounds unset: the
    locals it leaves in _generate_and_score_completions's frame."""
    per_token_logps_diff = (old - sampling) * completion_mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    vllm_importance_sampling_ratio = torch.exp(per_sequence_logps_diff)
    invalid_mis_mask = (vllm_importance_sampling_ratio < -math.inf) | (vllm_importance_sampling_ratio > math.inf)
    vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    return per_token_logps_diff, per_sequence_logps_diff, invalid_mis_mask, vllm_importance_sampling_ratio


def reference_logps(this, model, reference, ids, mask, C: int, chunk: int) -> torch.Tensor:
    """The reference's pass: its own model (a full fine-tune), or under PEFT the policy with its adapters disabled
    (trl's use_adapter(model, adapter_name=None))."""
    if reference is not None:
        return this._get_per_token_logps_and_entropies(reference, ids, mask, C, batch_size=chunk)[0]
    from trl.trainer.utils import use_adapter

    with use_adapter(model, adapter_name=None):
        return this._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=chunk)[0]
