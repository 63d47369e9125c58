"""TRL 1.4-1.14's loss_type "chunked_nll" (SFTConfig's default from 1.7; memcalc.exact.hf.chunked_nll), written out as
the trl 1.6.0 to 1.14.2 wheels have it (trl/trainer/sft_trainer.py _patch_chunked_ce_lm_head,
_chunked_cross_entropy_loss, _chunk and compute_loss's metrics), run over Transformers and PEFT as the rest of
verify/trl.py is.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

from .trl import item, train_tokens

CHUNK_SIZE = 256  # sft_trainer.py _CHUNKED_LM_HEAD_CHUNK_SIZE


def chunk_1_7(h, w, b, lbl, logit_scale, final_logit_softcapping):
    """_chunk, 1.4-1.7 (trl 1.6.0's and 1.7.1's wheels; 1.6 enters _maybe_gather_lm_head_ctx, a no-op on one
    process)."""
    logits = h.float() @ w.float().t()
    if b is not None:
        logits = logits + b.float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if final_logit_softcapping is not None:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    log_p = F.log_softmax(logits, dim=-1)
    chunk_loss = F.nll_loss(log_p, lbl, reduction="sum")
    chunk_correct = (logits.argmax(dim=-1) == lbl).sum().float()
    chunk_entropy = -(log_p.exp() * log_p).sum(dim=-1).sum()
    return chunk_loss, chunk_correct, chunk_entropy


def chunk_1_8(h, w, b, lbl, logit_scale, final_logit_softcapping, fp32=True):
    """_chunk, 1.8-1.14 (trl 1.10.0's, 1.12.0's and 1.14.2's wheels): up to 1.12 (fp32) h.float() @ w.float().t(),
    from 1.13 (h @ w.to(h.dtype).t()).float()."""
    if fp32:
        logits = h.float() @ w.float().t()
    else:
        logits = (h @ w.to(h.dtype).t()).float()
    if b is not None:
        logits = logits + b.float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if final_logit_softcapping is not None:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    log_p = F.log_softmax(logits, dim=-1)
    chunk_loss = F.nll_loss(log_p, lbl, ignore_index=-100, reduction="sum")
    valid = lbl != -100
    chunk_correct = ((logits.argmax(dim=-1) == lbl) & valid).sum().float()
    chunk_entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
    return chunk_loss, chunk_correct, chunk_entropy


def chunked_cross_entropy_loss(line: str, hidden_states, lm_head_weight, labels, num_items_in_batch,
                               final_logit_softcapping=None):  # fmt: skip
    """_chunked_cross_entropy_loss(hidden_states, lm_head.weight, 256, labels=labels, num_items_in_batch=...), as the
    release line has it: 1.4-1.7 keep the labelled rows (hidden[valid]); 1.8-1.10 order every row by the mask and
    test the count against 0; 1.11-1.14 clamp the chunk count instead. range() reads the count on the host (on meta,
    which has no values: every position labelled)."""
    from memcalc.exact.hf.chunked_nll import DROPPED, TESTED
    from memcalc.model.stacks import CHUNKED_FP32

    hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
    labels = labels[..., 1:].reshape(-1)
    valid = labels != -100
    if line in DROPPED:
        hidden = hidden[valid]
        labels = labels[valid]
        n_valid = hidden.size(0)
        correct = hidden.new_zeros((), dtype=torch.float32)
        entropy_sum = hidden.new_zeros((), dtype=torch.float32)
        n_valid_tensor = torch.tensor(n_valid, device=hidden.device, dtype=torch.long)
        n_padded, chunk = n_valid, chunk_1_7
    else:
        n_valid_tensor = valid.sum()
        correct = hidden.new_zeros((), dtype=torch.float32)
        entropy_sum = hidden.new_zeros((), dtype=torch.float32)
        if line in TESTED:
            item(n_valid_tensor == 0)  # `if n_valid_tensor == 0:` (not taken: every position is labelled)
        order = valid.to(torch.int8).argsort(descending=True, stable=True)
        hidden = hidden[order]
        labels = labels[order]
        if line in TESTED:
            n_padded = (n_valid_tensor / CHUNK_SIZE).ceil().to(torch.int64) * CHUNK_SIZE
        else:
            n_padded = (n_valid_tensor / CHUNK_SIZE).ceil().clamp(min=1).to(torch.int64) * CHUNK_SIZE
        chunk = functools.partial(chunk_1_8, fp32=line in CHUNKED_FP32)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, host_count(n_padded, hidden.size(0)), CHUNK_SIZE):
        h_chunk = hidden[start : start + CHUNK_SIZE]
        lbl_chunk = labels[start : start + CHUNK_SIZE]
        chunk_loss, chunk_correct, chunk_entropy = torch.utils.checkpoint.checkpoint(
            chunk, h_chunk, lm_head_weight, None, lbl_chunk, 1.0, final_logit_softcapping, use_reentrant=False)
        loss = loss + chunk_loss
        correct = correct + chunk_correct
        entropy_sum = entropy_sum + chunk_entropy
    loss = loss / num_items_in_batch.to(loss.device)
    return loss, correct, entropy_sum, n_valid_tensor


def host_count(n_padded, rows: int) -> int:
    """range(0, n_padded, 256)'s bound: n_padded itself (an int, or a device tensor read by __index__); on meta,
    which has no values, the rows rounded up to whole chunks (every position labelled)."""
    if isinstance(n_padded, torch.Tensor) and n_padded.device.type == "meta":
        return -(-rows // CHUNK_SIZE) * CHUNK_SIZE
    return n_padded


def patch_chunked(model: nn.Module, line: str) -> None:
    """SFTTrainer.__init__ under loss_type "chunked_nll": _patch_chunked_ce_lm_head on the model PEFT wraps, its forward
    with labels the backbone (use_cache=False), then the chunked loss over lm_head.weight; the output's counts
    returned beside the loss, no logits (_ChunkedCELMHeadOutput)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    softcap = getattr(target.config, "final_logit_softcapping", None)
    lm_head = target.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
        kwargs.pop("use_cache", None)
        outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        hidden_states = outputs.last_hidden_state
        loss, num_correct_tokens, entropy_sum, num_valid_tokens = chunked_cross_entropy_loss(
            line, hidden_states, lm_head.weight, labels, num_items_in_batch, softcap)
        return {"loss": loss, "logits": None, "num_correct_tokens": num_correct_tokens, "entropy_sum": entropy_sum,
                "num_valid_tokens": num_valid_tokens}  # fmt: skip

    target.forward = types.MethodType(forward, target)


def chunked_metrics(outputs, labels: torch.Tensor) -> None:
    """SFTTrainer.compute_loss after super().compute_loss under loss_type "chunked_nll" (1.4-1.14), one process: the
    entropy from the counts, the training token count, the accuracy."""
    num_valid = outputs["num_valid_tokens"].sum()  # gather_for_metrics(outputs.num_valid_tokens).sum()
    entropy_sum = outputs["entropy_sum"].sum()
    entropy = item(entropy_sum / num_valid) if item(num_valid > 0) is not False else 0.0  # noqa: F841
    train_tokens(labels)
    correct = outputs["num_correct_tokens"].sum()
    accuracy = item(correct / num_valid) if item(num_valid > 0) is not False else 0.0  # noqa: F841


@contextlib.contextmanager
def chunked_paths():
    """While active, a boolean index on meta takes every position as kept (1.4-1.7's hidden[valid]: nonzero)."""
    import torch.fx.experimental._config as fx_config

    saved, fx_config.meta_nonzero_assume_all_nonzero = fx_config.meta_nonzero_assume_all_nonzero, True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = saved
