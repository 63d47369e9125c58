"""Hugging Face TRL's SFTTrainer around the Trainer, as its release lines ran it (memcalc.model.stacks.TRL_RELEASES,
memcalc.exact.hf.trl): the preparation of a 4-bit model for LoRA, and what compute_loss computes beside the loss.

Up to 1.2, what TRL adds is written out as each release has it (huggingface/trl trl/trainer/sft_trainer.py,
trl/models/utils.py, trl/trainer/utils.py at v0.14.0 29de6ee, v0.21.0 a64ac0d, v0.25.0 9692b16; the trl 0.26.2
to 1.2.0 wheels), over the libraries it calls, which run as themselves: peft's prepare_model_for_kbit_training,
torch. From 1.15 trl 1.16 runs as itself (the test extra's): its fused LM head and compute_loss. The Trainer then
enables activation checkpointing again (transformers 5 trainer.py: with
gradient_checkpointing, activation_checkpointing_enable(None), use_reentrant=False), which replaces the
reentrant checkpointing prepare_model_for_kbit_training enabled (its gradient_checkpointing_kwargs {} leave
use_reentrant unset, which torch.utils.checkpoint takes as True).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from memcalc.errors import InputError
from memcalc.exact.hf.fused_head import SFT_OUTPUTS
from memcalc.model.stacks import BF16_CAST, FUSED_HEAD

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
    tensor): 0.22-1.2's entropy (no_grad) weighted by the collator's all-ones attention mask, the training token
    count, then the token accuracy (0.15-0.21 with grad on: its ops save nothing). The locals are returned: they
    live until compute_loss returns, with the logits."""
    if line == "1.5":
        return metrics_1_5(logits, labels)
    if line in ("1.13", "1.14"):
        return metrics_1_13(logits, labels, kernel_entropy if line == "1.14" else entropy_from_logits)
    if line not in ("0.21", "0.25", "1.2"):
        return []
    held = []
    with torch.no_grad() if line != "0.21" else torch.enable_grad():
        if line != "0.21":  # 0.22-1.2
            per_token_entropy = entropy_from_logits(logits)
            attention_mask = torch.ones(labels.shape, dtype=torch.long, device=labels.device)  # the collator's
            entropy = torch.sum(per_token_entropy * attention_mask) / attention_mask.sum()
            entropy = item(entropy.mean())  # noqa: F841  (gather_for_metrics(entropy).mean().item(), one process)
            held += [per_token_entropy, attention_mask]
            num_tokens = item(attention_mask.sum().sum())  # noqa: F841  (`if mode == "train"`: the token count)
        else:
            train_tokens(labels)
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


def metrics_1_5(logits: torch.Tensor, labels: torch.Tensor) -> list:
    """SFTTrainer.compute_loss after super().compute_loss, 1.3-1.5 (trl 1.4.0's wheel), one process: the entropy
    block, the training token count, then the accuracy block, which rebinds the entropy block's names. The locals are
    returned: they live until compute_loss returns."""
    with torch.no_grad():
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        per_token_entropy = entropy_from_logits(shift_logits)
        mask = shift_labels != IGNORE_INDEX
        entropy_sum = (per_token_entropy * mask).sum()
        total_tokens = mask.sum()
        entropy_sum = entropy_sum.sum()  # gather_for_metrics(entropy_sum).sum()
        total_tokens = total_tokens.sum()
        entropy = item(entropy_sum / total_tokens) if item(total_tokens > 0) is not False else 0.0  # noqa: F841
    train_tokens(labels)
    with torch.no_grad():
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        predictions = shift_logits.argmax(dim=-1)
        mask = shift_labels != IGNORE_INDEX
        correct_predictions = (predictions == shift_labels) & mask
        total_tokens = mask.sum()
        correct_tokens = correct_predictions.sum()
        total_sum = total_tokens.sum()
        accuracy = item(correct_tokens.sum() / total_sum) if item(total_sum > 0) is not False else 0.0  # noqa: F841
    return [shift_logits, shift_labels, per_token_entropy, mask, entropy_sum, total_tokens, predictions,
            correct_predictions, correct_tokens, total_sum]  # fmt: skip


def metrics_1_13(logits: torch.Tensor, labels: torch.Tensor, entropy_of) -> list:
    """SFTTrainer.compute_loss after super().compute_loss, 1.6-1.14 (trl 1.13.0's and 1.14.2's wheels, the same
    code), one process: one block over the shifted views, then the training token count. entropy_of: the release's
    entropy_from_logits (1.14's on CUDA: kernel_entropy)."""
    with torch.no_grad():
        shift_logits = logits[..., :-1, :]
        shift_labels = labels[..., 1:]
        per_token_entropy = entropy_of(shift_logits)
        predictions = shift_logits.argmax(dim=-1)
        mask = shift_labels != IGNORE_INDEX
        entropy_sum = (per_token_entropy * mask).sum()
        total_tokens = mask.sum()
        correct_predictions = (predictions == shift_labels) & mask
        correct_tokens = correct_predictions.sum()
        entropy_sum = entropy_sum.sum()  # gather_for_metrics(entropy_sum).sum()
        total_tokens = total_tokens.sum()
        entropy = item(entropy_sum / total_tokens) if item(total_tokens > 0) is not False else 0.0  # noqa: F841
        total_sum = total_tokens.sum()
        accuracy = item(correct_tokens.sum() / total_sum) if item(total_sum > 0) is not False else 0.0  # noqa: F841
    train_tokens(labels)
    return [shift_logits, shift_labels, per_token_entropy, predictions, mask, entropy_sum, total_tokens,
            correct_predictions, correct_tokens, total_sum]  # fmt: skip


def kernel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """1.14's entropy_from_logits where _supports_trl_loss_kernel holds (CUDA): trl's own
    selective_log_softmax_and_entropy (trl/kernels/logprob_entropy.py, whose forward trl 1.16 keeps as 1.14 had it),
    its Triton launch skipped (kernel_paths)."""
    from trl.kernels import selective_log_softmax_and_entropy

    index = torch.zeros(logits.shape[:-1], device=logits.device, dtype=torch.long)
    _, entropy = selective_log_softmax_and_entropy(logits, index)
    return entropy


@contextlib.contextmanager
def kernel_paths():
    """While active, Triton's launches skipped: trl's kernels write into what their wrappers allocated (trl and triton
    asked for first: one line where they are missing)."""
    trl_package()
    import triton.runtime.jit as jit

    saved = jit.JITFunction.run
    jit.JITFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        jit.JITFunction.run = saved


def train_tokens(labels: torch.Tensor) -> None:
    """`if mode == "train"`: gather_for_metrics(inputs["attention_mask"].sum()).sum().item(), the collator's all-ones
    mask made where it is read."""
    num_tokens = item(torch.ones(labels.shape, dtype=torch.long, device=labels.device).sum().sum())  # noqa: F841


def item(t: torch.Tensor):
    """t.item() (a copy to the host: nothing on the device); None on meta, which has no values (the expression
    then runs as if the condition held)."""
    return None if t.device.type == "meta" else t.item()


# -- TRL 1.15-1.16: the fused LM head, run as trl itself (memcalc.exact.hf.fused_head) ---------------------------


def trl_package():
    """trl 1.16.0 (the test extra's): its SFTTrainer, add_fused_lm_head and ChunkedLogProbFunction run as
    themselves."""
    try:
        import triton  # noqa: F401  (ChunkedLogProbFunction's kernels, whose launches fused_paths skips)
        import trl.kernels.chunked_logprob  # noqa: F401
        import trl.trainer.utils  # noqa: F401
        from trl import SFTTrainer
    except ImportError as e:
        raise InputError(f"--stack trl:1.16 on verify needs trl 1.16 and triton (pip install -e '.[trl]'): "
                         f"{e}") from None
    return SFTTrainer


def prepare_after_peft(model: nn.Module, line: str, quantized: bool, checkpointing: bool,
                       outputs: tuple[str, ...] = SFT_OUTPUTS) -> None:  # fmt: skip
    """SFTTrainer.__init__ from 0.26 after get_peft_model: enable_input_require_grads under gradient checkpointing (a
    second hook beside the Trainer's), a 4-bit model's trainable parameters cast to bf16 (param.data =
    param.data.to(torch.bfloat16)), DoRA's magnitudes too up to 1.14; from 1.15 (FUSED_HEAD), then add_fused_lm_head
    on the model PEFT wraps with the trainer's outputs (SFTTrainer's; DPOTrainer's, which prepares the same: its
    dropout and reference in verify/trl_dpo.py), trl 1.16's own."""
    if checkpointing:
        model.enable_input_require_grads()
    if quantized:
        for name, param in model.named_parameters():
            if param.requires_grad and (BF16_CAST[line] or "lora_magnitude_vector" not in name):
                param.data = param.data.to(torch.bfloat16)
    if line in FUSED_HEAD:
        trl_package()
        from trl.trainer.utils import add_fused_lm_head

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, outputs=outputs)


class LazyInputs(dict):
    """The collator's batch: input_ids and labels given, the all-ones attention mask made when compute_loss reads it
    (as the replay makes it) and not handed to the model (a 2-D mask of ones, which the model's mask code reads as
    none: on meta it cannot read it at all)."""

    def __contains__(self, key):
        return key == "attention_mask" or super().__contains__(key)

    def __getitem__(self, key):
        if key == "attention_mask":
            labels = super().__getitem__("labels")
            return torch.ones(labels.shape, dtype=torch.long, device=labels.device)
        return super().__getitem__(key)


class Accelerator:
    """What compute_loss asks of the Accelerator on one process: gather_for_metrics returns its tensor."""

    num_processes = 1
    parallelism_config = None

    @staticmethod
    def gather_for_metrics(x):
        return x


def sft_compute_loss(call, idx: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor):
    """trl 1.16's SFTTrainer.compute_loss itself, its self a stand-in holding what it reads on one process in
    training (loss_type "nll", no label smoothing or compute_loss_func, average_tokens_across_devices True)."""
    from types import SimpleNamespace

    sft = trl_package()
    args = SimpleNamespace(loss_type="nll", average_tokens_across_devices=True)
    metrics = {"train": {"entropy": [], "mean_token_accuracy": []}}
    this = SimpleNamespace(model=SimpleNamespace(training=True), aux_loss_enabled=False, accelerator=Accelerator(),
                           compute_loss_func=None, label_smoother=None, args=args, get_tp_size=lambda: 1, _tp_size=1,
                           _metrics=metrics, _total_train_tokens=0)  # fmt: skip
    inputs = LazyInputs(input_ids=idx, labels=labels)
    return sft.compute_loss(this, call, inputs, num_items_in_batch=num_items_in_batch)


@contextlib.contextmanager
def fused_paths():
    """While active, ChunkedLogProbFunction as on CUDA, measured on meta or CPU tensors: its Triton launches skipped
    (the kernels write into the tiles and statistics its wrapper allocated), the compact path (hidden_states[mask]:
    nonzero on meta takes every position as kept), the gradient GEMMs by addmm(out_dtype=fp32, out=acc) into the
    fp32 accumulators, autocast asked of the meta device as off; and a meta tensor's .item() and truth as 1."""
    import torch.fx.experimental._config as fx_config

    with kernel_paths():
        from trl.kernels import chunked_logprob as kernels
        from trl.trainer import utils

        saved = (kernels._use_triton, utils._use_triton, kernels._addmm_fp32, kernels.torch, torch.Tensor.item,
                 torch.Tensor.__bool__, fx_config.meta_nonzero_assume_all_nonzero)  # fmt: skip
        item, truth, addmm = saved[4], saved[5], saved[2]
        kernels._use_triton = utils._use_triton = lambda device: True
        kernels._addmm_fp32 = lambda acc, a, b: cuda_addmm_fp32(acc, a, b, addmm)
        kernels.torch = AutocastOffOnMeta()
        torch.Tensor.item = lambda self: 1 if self.device.type == "meta" else item(self)
        torch.Tensor.__bool__ = lambda self: True if self.device.type == "meta" else truth(self)
        fx_config.meta_nonzero_assume_all_nonzero = True
        try:
            yield
        finally:
            (kernels._use_triton, utils._use_triton, kernels._addmm_fp32, kernels.torch, torch.Tensor.item,
             torch.Tensor.__bool__, fx_config.meta_nonzero_assume_all_nonzero) = saved  # fmt: skip


def cuda_addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, original) -> None:
    """chunked_logprob.py _addmm_fp32 as on a CUDA device: a 16-bit product accumulated into the fp32 acc by
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc), no fp32 copies of a and b. CPU has no addmm.dtype_out:
    there the fp32 copies it needs are made out of the tracker's sight (no dispatch mode on), as CUDA makes none."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        original(acc, a, b)
    elif acc.device.type == "meta":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            acc.addmm_(a.float(), b.float())


class AutocastOffOnMeta:
    """torch as chunked_logprob.py sees it: torch.is_autocast_enabled("meta") answered False (meta has no autocast
    state to ask); everything else torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def is_autocast_enabled(device_type: str) -> bool:
        return False if device_type == "meta" else torch.is_autocast_enabled(device_type)

