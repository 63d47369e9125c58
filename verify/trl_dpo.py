"""TRL's DPOTrainer (--rl dpo) as itself: its preparation of the model and its _compute_loss, run over Transformers
and PEFT: 1.16's through its fused LM head (memcalc.exact.hf.dpo replays the same), or an earlier release's over the
full logits (--stack trl:1.5 to trl:1.13, memcalc.exact.hf.dpo_logits), whichever trl is installed: the test extra's
1.16, or an earlier release put first on the path (tests/test_dpo_logits.py).

The batch is DataCollatorForPreference's: the chosen rows, then the rejected ones, input_ids and completion_mask
(the harness's two inputs: the labels' slot holds the completion mask, filled with ones in place, every position
of every row a completion token: the most the step holds), the attention mask made where it is read (verify/trl.py
LazyInputs). The reference is the policy with its adapters disabled (no ref_model under PEFT), or a second model
(reference_model), run under no_grad with activation checkpointing turned off and on again; the Trainer then
divides the loss by the gradient accumulation steps (DPOTrainer.loss_is_scaled_for_ga is False).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from memcalc.errors import InputError
from memcalc.model.stacks import FUSED_HEAD, line_of, releases


@dataclass
class Dpo:
    """What DPOTrainer's step holds beside the trained model (not a module: nothing of it trains)."""

    precompute_ref: bool  # DPOConfig.precompute_ref_log_probs: the reference's log-probs come with the batch
    reference: nn.Module | None  # its ref_model: a second model where the policy is not PEFT's, else None
    checkpoint_kwargs: dict | None  # TrainingArguments.gradient_checkpointing_kwargs, which it enables again with


def dpo_setup(model: nn.Module, tf, config, dtype: torch.dtype, attention: str, device: str, lora: bool,
              precompute_ref: bool, checkpoint_kwargs: dict | None, line: str) -> Dpo:  # fmt: skip
    """DPOTrainer.__init__ beyond SFTTrainer's preparation (verify/trl.py prepare_after_peft, with DPO's outputs):
    disable_dropout_in_model (DPOConfig.disable_dropout True: every nn.Dropout's p set to 0, PEFT's lora_dropout
    too; it runs before the head is patched in, which no byte depends on), and its reference model. The installed
    trl must be a release of the stack's line: its _compute_loss is what runs."""
    installed_line(line)
    disable_dropout(model)
    second = not lora and not precompute_ref
    reference = reference_model(tf, config, dtype, attention, device, line in FUSED_HEAD) if second else None
    return Dpo(precompute_ref, reference, checkpoint_kwargs)


def installed_line(line: str, rl: str = "dpo", trainer: str = "DPOTrainer") -> None:
    """Refuse a stack whose TRL line is not the installed trl's (verify runs the installed trainer)."""
    import trl

    if line_of(trl.__version__.split("+")[0]) != line:
        raise InputError(f"--stack trl:{line} --rl {rl} on verify runs the installed trl's {trainer}, "
                         f"{trl.__version__}, not a {releases(line)} release: pip install trl=={line}.* (apart: pip "
                         "install --target DIR, then PYTHONPATH=DIR)")  # fmt: skip


def disable_dropout(model: nn.Module) -> None:
    from trl.trainer.utils import disable_dropout_in_model

    disable_dropout_in_model(model)


class Accelerator:
    """What _compute_loss asks of the Accelerator on one process: its tensors back, the model unwrapped."""

    num_processes = 1
    parallelism_config = None

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def gather_for_metrics(x):
        return x

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def unwrap_model(model):
        return model


class Inputs(dict):
    """The collator's batch: input_ids and completion_mask given; the all-ones attention mask made where compute_loss
    reads it and not handed to the model (verify/trl.py LazyInputs), and so each pair's precomputed reference
    log-probs (precompute_ref_log_probs: fp32, one per pair)."""

    def __getitem__(self, key):
        ids = super().__getitem__("input_ids")
        if key == "attention_mask":
            return torch.ones(ids.shape, dtype=torch.long, device=ids.device)
        if key in ("ref_chosen_logps", "ref_rejected_logps"):
            return torch.zeros(ids.shape[0] // 2, dtype=torch.float32, device=ids.device)
        return super().__getitem__(key)


def dpo_loss(model: nn.Module, idx: torch.Tensor, completion_mask: torch.Tensor,
             autocast: tuple[str, torch.dtype] | None, dpo: Dpo) -> torch.Tensor:  # fmt: skip
    """The installed trl's DPOTrainer._compute_loss itself (loss_type sigmoid, beta 0.1, reverse KL, no ld_alpha, no
    weighting), its self a stand-in holding what it reads on one process in training (dpo: its reference and
    arguments); then the Trainer's
    training_step division by the accumulation steps (1). autocast: the forward Accelerator.prepare_model sets on
    the model (verify/amp.py amp_forward), which the reference's call goes through too."""
    from trl import DPOTrainer

    completion_mask.fill_(1)
    reference = dpo.reference
    args = SimpleNamespace(gradient_checkpointing_kwargs=dpo.checkpoint_kwargs)  # disable_gradient_checkpointing's
    this = SimpleNamespace(model=model, accelerator=Accelerator(idx.device), aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=dpo.precompute_ref, ref_model=reference, f_divergence_type="reverse_kl",
                           loss_types=["sigmoid"], loss_weights=[1.0], beta=0.1, use_weighting=False, args=args,
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)  # fmt: skip
    inputs = Inputs(input_ids=idx, completion_mask=completion_mask)
    models = [m for m in (model, reference) if m is not None]
    own = [m.__dict__.get("forward") for m in models]  # add_fused_lm_head's, where the model is not PEFT's
    if autocast is not None:
        from .amp import amp_forward

        for m in models:
            m.forward = amp_forward(m.forward, *autocast)
    try:
        loss = DPOTrainer._compute_loss(this, model, inputs, return_outputs=False)
    finally:
        if autocast is not None:
            for m, forward in zip(models, own):
                del m.forward
                if forward is not None:
                    m.forward = forward
    return loss / 1  # Trainer.training_step: loss / current_gradient_accumulation_steps


def reference_model(tf, config, dtype: torch.dtype, attention: str, device: str, fused: bool = True) -> nn.Module:
    """DPOTrainer's ref_model where the policy is not PEFT's: create_model_from_path in the policy's dtype (loaded
    as from_pretrained leaves it, in eval mode), disable_dropout_in_model, from 1.15 (fused) add_fused_lm_head with
    its default outputs (log_probs); Accelerator.prepare_model(evaluation_mode=True) wraps its forward in the same
    autocast (dpo_loss)."""
    with torch.device(device):
        ref = tf.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    ref.eval()
    disable_dropout(ref)
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(ref)
    return ref
