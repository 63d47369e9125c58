"""TRL's DPOConfig in a TRL arguments file (`trl dpo --config FILE`), read where --rl dpo is typed beside --from: the
keys DPOConfig adds to TrainingArguments (huggingface/trl trl/trainer/dpo_config.py in the trl 1.16.0 wheel), as
memcalc.exact.hf.dpo replays DPOTrainer. The rest of the file (max_length, the batch, bf16, checkpointing, PEFT)
is read as for SFTConfig, whose keys and defaults DPOConfig shares (memcalc.cli.fromfile.trainer).
"""

from __future__ import annotations

from .grpo import GRPO_KEYS
from .ledger import KeyLedger

# keys DPOConfig has and neither TrainingArguments nor SFTConfig has: the file is a DPOConfig
DPO_KEYS = ("beta", "disable_dropout", "precompute_ref_log_probs", "precompute_ref_batch_size", "loss_weights",
            "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "label_smoothing", "use_weighting",
            "discopop_tau", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")  # fmt: skip
NO_BYTES = {  # keys that change the loss's numbers, not what the step holds
    "beta": "the loss's temperature", "label_smoothing": "the loss's smoothing", "discopop_tau": "DiscoPOP's tau",
    "f_alpha_divergence_coef": "the alpha divergence's coefficient", "loss_weights": "each loss type's weight",
    "precompute_ref_batch_size": "the pass before training that precomputes the reference",
    "ref_model_mixup_alpha": "the reference's sync (a copy between steps)",
    "ref_model_sync_steps": "the reference's sync (a copy between steps)",
}  # fmt: skip


# (key, the value refused, why, what the other value means)
REFUSED = (
    ("disable_dropout", False, "dropout left on is not replayed under --rl dpo (DPOTrainer's default turns every "
                               "nn.Dropout off)", "every nn.Dropout off, LoRA's too"),
    ("use_weighting", True, "WPO's weights (the fused head's log_sum_sq_probs) are not replayed", "off"),
    ("sync_ref_model", True, "TR-DPO's reference sync is not replayed (it needs a reference model)", "off"),
)  # fmt: skip


def dpo_config(ledger: KeyLedger, typed: dict) -> bool:
    """Whether the file is read as DPOTrainer's (--rl dpo typed). A file with DPOConfig's keys and no --rl dpo is
    refused at the first of them: memcalc would answer for SFT."""
    rl = (typed.get("rl") or "").strip().lower()
    if rl == "grpo" or any(ledger.has(key) for key in GRPO_KEYS):  # a GRPOConfig: its beta is its own
        return False
    dpo = rl == "dpo"
    if not dpo:
        first = next((key for key in DPO_KEYS if ledger.has(key)), None)
        if first is not None:
            ledger.refuse(first, "a DPOConfig key: give --rl dpo to answer for DPOTrainer")
        return False
    for key, what in NO_BYTES.items():
        if ledger.has(key):
            ledger.used(key, f"{what}: no bytes")
    loss = ledger.raw("loss_type")
    kinds = loss if isinstance(loss, list) else [loss] if loss is not None else []
    if kinds and kinds != ["sigmoid"]:
        ledger.unmodelled("loss_type", f"{', '.join(map(str, kinds))}: the verdict is loss_type sigmoid's (each "
                                       "differs by a few (pairs,) tensors)")  # fmt: skip
    elif kinds:
        ledger.used("loss_type", "sigmoid, DPO's")
    else:
        ledger.default(None, None, "loss_type", "DPOConfig's default", "sigmoid")
    if ledger.flag("precompute_ref_log_probs"):
        ledger.set("precompute_ref", True, "precompute_ref_log_probs", "--precompute-ref: no reference in the step")
    elif ledger.has("precompute_ref_log_probs"):
        ledger.used("precompute_ref_log_probs", "off: the reference runs in the step")
    for key, refused, why, fine in REFUSED:
        if ledger.has(key) and ledger.flag(key) is refused:
            ledger.refuse(key, why)
        elif ledger.has(key):
            ledger.used(key, fine)
    if ledger.has("ld_alpha") and ledger.raw("ld_alpha") is not None:
        ledger.unmodelled("ld_alpha", "LD-DPO's masks over the completion (a few (2 x pairs, seq) tensors)")
    if ledger.has("f_divergence_type") and ledger.text("f_divergence_type") != "reverse_kl":
        ledger.unmodelled("f_divergence_type", "the verdict is reverse KL's (a few (pairs,) tensors apart)")
    elif ledger.has("f_divergence_type"):
        ledger.used("f_divergence_type", "reverse KL, DPO's")
    return True
