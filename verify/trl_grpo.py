"""TRL 1.16's GRPOTrainer and RLOOTrainer (--stack trl:1.16 --rl grpo, rloo) as themselves: the training step's
_compute_loss over its fused LM head, Transformers and PEFT (memcalc.exact.hf.grpo and rloo replay the same).

The step reads one slice of the generation batch _generate_and_score_completions buffered (views of tensors made
once per generation, held across the steps that read them): prompt and completion ids and masks, the advantages, the
loss's token count, and, as the trainer's settings ask, the old log-probs and vLLM's importance-sampling ratio
(use_vllm, vllm_importance_sampling_mode "sequence_mask": one per sequence) and the reference's log-probs (beta > 0).
The harness's two inputs carry the first four (the ids: the prompt's positions, then the completion's; the labels'
slot: the attention mask, filled with ones: no padding, the most the step holds); the rest are made at the first step
and kept, as the buffer keeps them. RLOO's batch holds the old sequence log-probs and the advantages beside the ids.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import torch
from torch import nn

from .trl_dpo import Accelerator as DpoAccelerator


@dataclass
class Grpo:
    """What GRPOTrainer's step reads beside the trained model: GRPOConfig's settings that change its bytes, and the
    buffered generation batch's tensors made at the first step."""

    completion_len: int  # max_completion_length: the completion's positions of each row (the rest: its prompt)
    beta: float = 0.0  # GRPOConfig.beta: the KL term against the reference's log-probs where not 0
    use_vllm: bool = False  # the old log-probs and the importance-sampling ratio come with the batch
    reference: nn.Module | None = None  # its ref_model (a full fine-tune at beta > 0): held, not called in the step
    buffered: dict = field(default_factory=dict)
    rloo: bool = False  # RLOOTrainer's step: old_logps and advantages in the batch, its own loss


def grpo_setup(tf, config, dtype: torch.dtype, attention: str, device: str, lora: bool, settings, rl: str,
               line: str) -> Grpo:  # fmt: skip
    """GRPOTrainer.__init__ beyond SFTTrainer's preparation (verify/trl.py prepare_after_peft, with GRPO's outputs):
    with beta not 0 and no PEFT a reference model, as DPOTrainer makes it (verify/trl_dpo.py reference_model); it is
    read only in the scoring pass before the steps, so in a step it is only held. GRPOConfig.disable_dropout is
    False: nothing turned off. settings: memcalc.model.rl.OnlineRL. The installed trl must be a release of the
    stack's line: its _compute_loss is what runs."""
    from .trl_dpo import installed_line

    installed_line(line, rl, "GRPOTrainer" if rl == "grpo" else "RLOOTrainer")
    grpo = Grpo(settings.completion_len, settings.beta, bool(settings.vllm), rloo=rl == "rloo")
    if settings.beta and not lora:
        from .trl_dpo import reference_model

        grpo.reference = reference_model(tf, config, dtype, attention, device)
    return grpo


class Accelerator(DpoAccelerator):
    """DPO's stand-in with what GRPO asks besides: autocast() (Accelerate's, the Trainer's autocast region where the
    recipe has one) and reduce (one process: the tensor itself)."""

    def __init__(self, device: torch.device, autocast: tuple[str, torch.dtype] | None):
        super().__init__(device)
        self.amp = autocast

    def autocast(self):
        return contextlib.nullcontext() if self.amp is None else torch.autocast(self.amp[0], dtype=self.amp[1])

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def buffered(grpo: Grpo, rows: int, device: torch.device) -> dict:
    """The generation batch's tensors beyond the ids and masks, made once (the first step's) and kept: advantages
    (fp32, one per row), num_items_in_batch (gather(loss_mask.sum()).sum(): an int64 0-d), and as configured
    old_per_token_logps and importance_sampling_ratio (vLLM) and ref_per_token_logps (beta), fp32."""
    if not grpo.buffered and grpo.rloo:  # RLOOTrainer's: old_logps (always scored), advantages, fp32
        grpo.buffered.update(old_logps=torch.zeros(rows, device=device), advantages=torch.zeros(rows, device=device))
    if not grpo.buffered:
        C = grpo.completion_len
        made = {"advantages": torch.zeros(rows, device=device),
                "num_items_in_batch": torch.ones((), dtype=torch.long, device=device)}  # fmt: skip
        if grpo.use_vllm:
            made["old_per_token_logps"] = torch.zeros(rows, C, device=device)
            made["importance_sampling_ratio"] = torch.ones(rows, 1, device=device)
        if grpo.beta:
            made["ref_per_token_logps"] = torch.zeros(rows, C, device=device)
        grpo.buffered.update(made)
    return grpo.buffered


def grpo_loss(model: nn.Module, idx: torch.Tensor, attention_mask: torch.Tensor,
              autocast: tuple[str, torch.dtype] | None, grpo: Grpo) -> torch.Tensor:  # fmt: skip
    """The installed trl's GRPOTrainer._compute_loss itself (1.16's over its fused LM head; 1.9-1.13's from the logits,
    logits_to_keep and temperature 1.0 as GRPOConfig's default; loss_type "dapo", importance_sampling_level "token",
    epsilon 0.2, no entropy mask, off-policy mask, entropy bonus or aux loss), its self a stand-in holding what it
    reads on one process in training (stand_in). The Trainer then calls backward on the loss as it is (dapo's
    normalizer already counts the accumulation). Under RLOO (grpo.rloo) rloo_loss instead."""
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    if grpo.rloo:
        return rloo_loss(model, idx, attention_mask, autocast, grpo)
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    this = stand_in(GRPOTrainer, model, idx, autocast, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                    importance_sampling_level="token", beta=grpo.beta, loss_type="dapo", args=args,
                    use_vllm=grpo.use_vllm, vllm_importance_sampling_correction=True,
                    current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, temperature=1.0,
                    model_kwarg_keys=forward_keys(model))  # fmt: skip
    with prepared(model, autocast, grpo_trainer):
        return GRPOTrainer._compute_loss(this, model, batch_of(idx, attention_mask, grpo))


def forward_keys(model: nn.Module):
    """GRPOTrainer.__init__'s model_kwarg_keys before 1.15 (read where the model supports logits_to_keep): the
    parameters of the model's forward, the base model's under PEFT, read before the wrappers replace it."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inspect.signature(type(base).forward).parameters.keys()


def rloo_loss(model: nn.Module, idx: torch.Tensor, attention_mask: torch.Tensor,
              autocast: tuple[str, torch.dtype] | None, grpo: Grpo) -> torch.Tensor:  # fmt: skip
    """trl 1.16's RLOOTrainer._compute_loss itself (epsilon 0.2, no aux loss), then the Trainer's training_step
    division by the accumulation steps (1: RLOOTrainer.loss_is_scaled_for_ga is False)."""
    from trl import RLOOTrainer
    from trl.trainer import rloo_trainer

    this = stand_in(RLOOTrainer, model, idx, autocast)
    with prepared(model, autocast, rloo_trainer):
        loss = RLOOTrainer._compute_loss(this, model, batch_of(idx, attention_mask, grpo))
    return loss / 1


def batch_of(idx: torch.Tensor, attention_mask: torch.Tensor, grpo: Grpo) -> dict:
    """The step's slice of the buffered generation batch: the prompt's and the completion's ids and masks (views of
    the harness's two inputs, the attention mask filled with ones) and the buffered tensors."""
    attention_mask.fill_(1)
    P = idx.shape[1] - grpo.completion_len
    return {"prompt_ids": idx[:, :P], "prompt_mask": attention_mask[:, :P], "completion_ids": idx[:, P:],
            "completion_mask": attention_mask[:, P:], **buffered(grpo, idx.shape[0], idx.device)}  # fmt: skip


def stand_in(trainer, model: nn.Module, idx: torch.Tensor, autocast, **reads) -> SimpleNamespace:
    """The trainer's self as its _compute_loss reads it on one process in training: the Accelerator, the model,
    epsilon 0.2 both sides, no aux loss, the metrics, reads; its _get_per_token_logps_and_entropies bound to it."""
    this = SimpleNamespace(accelerator=Accelerator(idx.device, autocast), aux_loss_enabled=False, epsilon_low=0.2,
                           epsilon_high=0.2, model=model, _metrics={"train": defaultdict(list)}, **reads)  # fmt: skip
    scoring = trainer._get_per_token_logps_and_entropies.__wrapped__  # profiling_decorator's timer: no tensor
    this._get_per_token_logps_and_entropies = partial(scoring, this)
    return this


@contextlib.contextmanager
def prepared(model: nn.Module, autocast: tuple[str, torch.dtype] | None, module):
    """While the step runs: the forward Accelerator.prepare_model sets where the recipe autocasts (verify/amp.py
    amp_forward, inside accelerator.autocast()), and the trainer module's nanmin / nanmax as on a device with values
    (finite)."""
    own = model.__dict__.get("forward")  # add_fused_lm_head's, where the model is not PEFT's
    if autocast is not None:
        from .amp import amp_forward

        model.forward = amp_forward(model.forward, *autocast)
    extremes = module.nanmin, module.nanmax
    module.nanmin, module.nanmax = (finite(f) for f in extremes)
    try:
        yield
    finally:
        module.nanmin, module.nanmax = extremes
        if autocast is not None:
            del model.forward
            if own is not None:
                model.forward = own


def finite(nan_extreme):
    """trl's nanmin / nanmax as on a device with values, where the gathered clip ratios are finite: on meta a
    tensor's truth is taken as True (verify/trl.py fused_paths), which would read isnan(x).all() as all NaN and take
    the other branch; here it reads as False for that call."""

    def call(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            return nan_extreme(tensor)
        truth = torch.Tensor.__bool__
        torch.Tensor.__bool__ = lambda self: False if self.device.type == "meta" else truth(self)
        try:
            return nan_extreme(tensor)
        finally:
            torch.Tensor.__bool__ = truth

    return call
