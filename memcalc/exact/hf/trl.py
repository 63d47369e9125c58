"""Hugging Face TRL's SFTTrainer around Transformers' Trainer, in bytes on memcalc.exact.sim: what it does to a
4-bit model before LoRA, and what its compute_loss computes beside the loss, by release line
(memcalc.model.stacks.TRL_RELEASES; huggingface/trl at each tag):

  0.9-0.25  SFTTrainer._prepare_peft_model (trl/models/utils.py prepare_peft_model from 0.22): a 4-bit model is
            prepared by peft's prepare_model_for_kbit_training (every fp16/bf16 parameter but the 4-bit layers'
            Params4bit cast to fp32: peft/utils/other.py), wrapped by get_peft_model, then under bf16=True
            peft_module_casting_to_bf16 casts the fp32 embeddings and head back to bf16 and keeps the norms in
            fp32 (trl/trainer/utils.py). An fp32 norm's weight times bf16 hidden states promotes them: the
            residual stream runs in fp32 (the 4-bit layers cast their input to the compute dtype and their
            output back to the input's: bitsandbytes nn/modules.py Linear4bit.forward).
  0.15-1.2  compute_loss's token accuracy: outputs.logits[..., :-1, :].contiguous() (a copy where the micro-batch
            has more than one sequence), its argmax, the labels' mask, and their counts.
  0.22-1.2  compute_loss's entropy under no_grad, before the accuracy: entropy_from_logits over the logits in
            chunks of 128 rows (log_softmax, exp, their product summed), the chunks' entropies concatenated,
            then weighted by the attention mask; and the model called with use_cache=False (the stack's).
  0.15-1.14 in training, the token count: gather_for_metrics(inputs["attention_mask"].sum()).sum().item().
  0.26-1.14 no k-bit preparation: a 4-bit model's trainable parameters cast to bf16 after get_peft_model
            (memcalc.model.stacks.bf16_adapters); the metrics as 0.25's up to 1.2.
  1.3-1.5   the entropy over the shifted logits, copied, masked by the labels; the accuracy copies them again
            (shifted_entropy, rebound_accuracy).
  1.6-1.14  one block over the shifted views (one_block); 1.14's entropy by trl's Triton kernel (kernel_entropy).
  1.4-1.14  under loss_type "chunked_nll" (the default from 1.7: memcalc.exact.hf.chunked_nll) no logits: the
            entropy and accuracy from the patched forward's counts (chunked_metrics).
  1.15-1.16 the loss and its metrics from the fused LM head (fused_compute_loss, memcalc.exact.hf.fused_head).
Each metric's tensors are compute_loss's locals: they die when it returns the loss, with the logits. Under
use_liger_kernel (0.15-0.25: `if not self.args.use_liger_kernel`, "liger doesn't return logits") neither metric is
computed.
"""

from __future__ import annotations

from memcalc.model.stacks import KBIT_PREPARED, METRICS

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .chunked_nll import ChunkedOutput
from .fused_head import FusedOutput

CAST_TO_BF16 = ("lm_head", "embed_tokens", "wte", "wpe")  # trl/trainer/utils.py peft_module_casting_to_bf16
ENTROPY_CHUNK = 128  # trl/trainer/utils.py entropy_from_logits(logits, chunk_size=128)
IGNORE_INDEX = -100
ONE_BLOCK = ("1.6", "1.7", "1.8", "1.9", "1.10", "1.12", "1.13", "1.14")  # the lines whose metrics are one block (one_block)


def prepared(cfg: StepConfig) -> bool:
    """Whether SFTTrainer prepared the model: a 4-bit base under TRL up to 0.25."""
    return cfg.stack.trl in KBIT_PREPARED and bool(cfg.finetune.quantize)


def prepared_dtype(name: str, cfg: StepConfig) -> str | None:
    """The dtype SFTTrainer's preparation leaves a parameter of a 4-bit model in (its 4-bit weights and LoRA's
    adapters apart), or None where it prepares nothing. peft_module_casting_to_bf16 runs under args.bf16: the
    autocast recipe in bf16 (TrainingArguments' bf16=True over a model loaded in bf16)."""
    if not prepared(cfg):
        return None
    module = name.rpartition(".")[0]
    bf16_args = cfg.recipe == "autocast" and cfg.precision == "bf16"
    if bf16_args and "norm" not in module and any(x in module for x in CAST_TO_BF16):
        return "bf16"  # an fp32 embedding or head back to bf16 (a norm stays fp32)
    return "fp32"


def attention_dtype(cfg: StepConfig) -> str:
    """The dtype SDPA's kernels see: autocast's 16 bits where the recipe autocasts, else fp32 where TRL prepared
    the model (its fp32 norms' weights promote the residual stream, and a 4-bit layer returns its input's dtype:
    q, k and v come out fp32), else the trick set's."""
    if cfg.recipe == "autocast" and cfg.precision != "fp32":
        return cfg.precision
    return "fp32" if prepared(cfg) else cfg.precision


def compute_loss_metrics(g: Graph, cfg: StepConfig, logits: Tensor, labels: Tensor) -> list[Tensor]:
    """What SFTTrainer.compute_loss computes from outputs.logits beside the loss, as its release does: the
    tensors its frame holds until it returns (the caller lets them go with the logits)."""
    line = cfg.stack.trl
    held: list[Tensor] = []
    if line not in METRICS or cfg.stack.savers.liger is not None:  # use_liger_kernel: no logits
        return held
    outer, g.grad_enabled = g.grad_enabled, False  # torch.no_grad() from 0.22 (0.15-0.21: no node saves)
    try:
        with g.scoped("loss"):
            if line in ONE_BLOCK:
                return one_block(g, logits, labels, kernel=line == "1.14")
            if line == "1.5":
                frame = shifted_entropy(g, logits, labels)
                train_tokens(g, labels.shape)
                rebound_accuracy(g, logits, labels, frame)
                return list(frame.values())
            if line in ("0.25", "1.2"):  # 0.26-1.2 compute them as 0.25 does
                held += entropy(g, logits, labels)
                summed_twice(g, held[-1], "int64")  # the training token count, over the entropy's attention mask
            else:
                train_tokens(g, labels.shape)
            held += token_accuracy(g, logits, labels)
    finally:
        g.grad_enabled = outer
    return held


def entropy(g: Graph, logits: Tensor, labels: Tensor) -> list[Tensor]:
    """entropy_from_logits(outputs.logits): each chunk's log_softmax (held until the next replaces it: the loop's
    local), exp(logps) * logps summed and negated; the entropies concatenated (the list's chunks then go, the last
    chunk's log_softmax and entropy with the function's frame); then torch.sum(per_token_entropy *
    attention_mask) / attention_mask.sum() (the collator's all-ones mask, int64), .item()'d. compute_loss keeps
    per_token_entropy and the mask."""
    B, T, V = logits.shape
    per_token = entropy_from_logits(g, logits, B * T, copy=False)
    # the collator's attention mask (all ones: no padding), made here where compute_loss reads it; in a real run its
    # B·T int64 bytes come with the batch
    mask = g.empty((B, T), "int64", "ones", kind="input")
    weighted = made(g, (B, T), "mul", per_token, mask, dtype=logits.dtype)
    total = made(g, (), "sum", weighted, dtype=logits.dtype)
    del weighted
    count = made(g, (), "sum", mask, dtype="int64")
    mean = made(g, (), "div", total, count, dtype=logits.dtype)
    del total, count
    gathered = made(g, (), "mean", mean, dtype=logits.dtype)  # gather_for_metrics(entropy).mean().item()
    del mean, gathered
    return [per_token, mask]


def entropy_from_logits(g: Graph, logits: Tensor, rows: int, copy: bool) -> Tensor:
    """trl/trainer/utils.py entropy_from_logits over `rows` rows of the logits: logits.reshape(-1, V) (a copy where
    the logits are a strided view: copy), then each chunk of 128 rows' log_softmax (held until the next replaces it:
    the loop's local), exp(logps) * logps summed and negated; the entropies concatenated (the list's chunks then go,
    the last chunk's log_softmax and entropy with the function's frame, the reshaped copy too)."""
    V = logits.shape[-1]
    flat = made(g, (rows, V), "clone", logits, dtype=logits.dtype) if copy else g.view(logits, (rows, V))
    logps = chunk_entropy = None
    entropies = []
    for start in range(0, rows, ENTROPY_CHUNK):
        n = min(ENTROPY_CHUNK, rows - start)
        chunk = g.view(flat, (n, V))  # flat_logits.split(128): views of its rows
        new = made(g, (n, V), "_log_softmax", chunk, dtype=logits.dtype)
        logps = new  # the last chunk's held until the function returns
        del new, chunk
        exp = made(g, (n, V), "exp", logps, dtype=logps.dtype)
        product = made(g, (n, V), "mul", exp, logps, dtype=logps.dtype)
        del exp
        summed = made(g, (n,), "sum", product, dtype=logps.dtype)
        del product
        chunk_entropy = made(g, (n,), "neg", summed, dtype=logps.dtype)
        del summed
        entropies.append(chunk_entropy)
    per_token = made(g, (rows,), "cat", *entropies, dtype=logits.dtype)
    del entropies, flat, logps, chunk_entropy  # the list rebound, then the frame's locals
    return per_token


def token_accuracy(g: Graph, logits: Tensor, labels: Tensor) -> list[Tensor]:
    """outputs.logits[..., :-1, :].contiguous() and labels[..., 1:].contiguous() (copies unless the micro-batch
    is one sequence, whose slices are contiguous already), the argmax, the mask of labels not IGNORE_INDEX,
    (predictions == labels) & mask, and the counts."""
    B, T, V = logits.shape
    if B == 1:
        shift_logits, shift_labels = g.view(logits, (1, T - 1, V)), g.view(labels, (1, T - 1))
    else:
        shift_logits = made(g, (B, T - 1, V), "clone", logits, dtype=logits.dtype)
        shift_labels = made(g, (B, T - 1), "clone", labels, dtype="int64")
    predictions = made(g, (B, T - 1), "argmax", shift_logits, dtype="int64")
    mask = made(g, (B, T - 1), "ne", shift_labels, dtype="bool")
    equal = made(g, (B, T - 1), "eq", predictions, shift_labels, dtype="bool")
    correct = made(g, (B, T - 1), "bitwise_and", equal, mask, dtype="bool")
    del equal
    total = made(g, (), "sum", mask, dtype="int64")
    correct_tokens = made(g, (), "sum", correct, dtype="int64")
    total_sum = made(g, (), "sum", total, dtype="int64")
    accuracy(g, correct_tokens, total_sum)
    return [shift_logits, shift_labels, predictions, mask, correct, total, correct_tokens, total_sum]


def fused_compute_loss(g: Graph, outputs: FusedOutput, num_items_in_batch: Tensor) -> Tensor:
    """SFTTrainer.compute_loss (1.15-1.16) after model(**inputs, fused_lm_head=True), loss_type "nll", one process:
    per_token_loss = -outputs.log_probs, its sum / torch.as_tensor(num_items_in_batch).clamp(min=1), times
    num_processes // tp_size (average_tokens_across_devices); then the metrics, each gather_for_metrics(x.sum())
    .sum() (gather_for_metrics returns its tensor on one process): the label mask's count, the entropy's sum, the
    top-1 count, each ratio .item()'d after a `> 0` test; and the collator's attention mask counted, made where
    compute_loss reads it (in a real run its B·T int64 bytes come with the batch). The locals, the per-token fields
    among them, die as it returns."""
    with g.scoped("loss"):
        per_token_loss = aten.neg(g, outputs.log_probs)
        summed = aten.sum_all(g, per_token_loss)
        count = made(g, (), "clamp", num_items_in_batch, dtype=num_items_in_batch.dtype)
        loss = aten.div_tensor(g, summed, count)
        del summed, count
        loss = aten.mul_scalar(g, loss)  # loss * (num_processes // tp_size)
        num_valid = summed_twice(g, outputs.label_mask, "int64")
        entropy_sum = summed_twice(g, outputs.entropy, outputs.entropy.dtype)
        num_correct = summed_twice(g, outputs.is_top1, "int64")
        ratio(g, entropy_sum, num_valid)
        ratio(g, num_correct, num_valid)
        B, T = outputs.label_mask.shape[0], outputs.label_mask.shape[1] + 1
        train_tokens(g, (B, T))
        del per_token_loss, num_valid, entropy_sum, num_correct
    return loss


def chunked_metrics(g: Graph, outputs: ChunkedOutput, shape: tuple) -> None:
    """SFTTrainer.compute_loss (1.4-1.14) after super().compute_loss under loss_type "chunked_nll", one process:
    num_valid = gather_for_metrics(outputs.num_valid_tokens).sum() and entropy_sum likewise, their ratio .item()'d
    after a `> 0` test; in training the token count over the collator's mask; then gather_for_metrics(
    outputs.num_correct_tokens).sum() and the accuracy's ratio. Its locals die as it returns."""
    with g.scoped("loss"):
        num_valid = made(g, (), "sum", outputs.num_valid_tokens, dtype="int64")
        entropy_sum = aten.sum_all(g, outputs.entropy_sum)  # the chunks' entropies carry grad: SumBackward0
        ratio(g, entropy_sum, num_valid)
        train_tokens(g, shape)
        correct = made(g, (), "sum", outputs.num_correct_tokens, dtype=outputs.num_correct_tokens.dtype)
        ratio(g, correct, num_valid)
        del num_valid, entropy_sum, correct


def summed_twice(g: Graph, x: Tensor, dtype: str) -> Tensor:
    """gather_for_metrics(x.sum()).sum() on one process: two 0-d tensors, the first gone once the second is made."""
    first = made(g, (), "sum", x, dtype=dtype)
    del x
    return made(g, (), "sum", first, dtype=dtype)


def shifted(g: Graph, logits: Tensor, labels: Tensor, contiguous: bool) -> tuple[Tensor, Tensor]:
    """outputs.logits[..., :-1, :] and labels[..., 1:], .contiguous()'d where `contiguous` (a copy where the
    micro-batch has more than one sequence; one sequence's slice is contiguous already), else the views."""
    B, T, V = logits.shape
    if B == 1 or not contiguous:
        return g.view(logits, (B, T - 1, V)), g.view(labels, (B, T - 1))
    return (made(g, (B, T - 1, V), "clone", logits, dtype=logits.dtype),
            made(g, (B, T - 1), "clone", labels, dtype="int64"))  # fmt: skip


def masked_entropy(g: Graph, per_token: Tensor, mask: Tensor) -> list[Tensor]:
    """(per_token_entropy * mask).sum() and mask.sum(), each gather_for_metrics(...).sum()'d (the first 0-d goes as
    the name is rebound), then (entropy_sum / total_tokens).item() after a `> 0` test: the two 0-d kept."""
    product = made(g, mask.shape, "mul", per_token, mask, dtype=per_token.dtype)
    entropy_sum = made(g, (), "sum", product, dtype=per_token.dtype)
    del product
    total_tokens = made(g, (), "sum", mask, dtype="int64")
    return [entropy_sum, total_tokens]


def shifted_entropy(g: Graph, logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """1.3-1.5's entropy block (no_grad): the shifted logits and labels .contiguous()'d, entropy_from_logits over
    them, the labels' mask, the masked sum and the count, gathered (summed again: new 0-d, the first going), the
    ratio .item()'d. Its locals, by name, stay compute_loss's until the accuracy block rebinds them."""
    B, T, _ = logits.shape
    shift_logits, shift_labels = shifted(g, logits, labels, contiguous=True)
    per_token = entropy_from_logits(g, shift_logits, B * (T - 1), copy=False)
    mask = made(g, (B, T - 1), "ne", shift_labels, dtype="bool")
    entropy_sum, total_tokens = masked_entropy(g, per_token, mask)
    entropy_sum = made(g, (), "sum", entropy_sum, dtype=per_token.dtype)  # gather_for_metrics(...).sum()
    total_tokens = made(g, (), "sum", total_tokens, dtype="int64")
    ratio(g, entropy_sum, total_tokens)
    return dict(shift_logits=shift_logits, shift_labels=shift_labels, per_token_entropy=per_token, mask=mask,
                entropy_sum=entropy_sum, total_tokens=total_tokens)  # fmt: skip


def rebound_accuracy(g: Graph, logits: Tensor, labels: Tensor, frame: dict[str, Tensor]) -> None:
    """1.3-1.5's accuracy block after the entropy block, in the same frame: shift_logits and shift_labels copied
    again (each old copy going once its new one is made), the argmax, the mask rebound, (predictions == labels) &
    mask, the counts (total_tokens rebound), total_sum, and the ratio .item()'d after a `> 0` test."""
    B, T, V = logits.shape
    if B > 1:  # .contiguous() copies again
        frame["shift_logits"] = made(g, (B, T - 1, V), "clone", logits, dtype=logits.dtype)
        frame["shift_labels"] = made(g, (B, T - 1), "clone", labels, dtype="int64")
    frame["predictions"] = made(g, (B, T - 1), "argmax", frame["shift_logits"], dtype="int64")
    frame["mask"] = made(g, (B, T - 1), "ne", frame["shift_labels"], dtype="bool")
    equal = made(g, (B, T - 1), "eq", frame["predictions"], frame["shift_labels"], dtype="bool")
    frame["correct_predictions"] = made(g, (B, T - 1), "bitwise_and", equal, frame["mask"], dtype="bool")
    del equal
    frame["total_tokens"] = made(g, (), "sum", frame["mask"], dtype="int64")
    frame["correct_tokens"] = made(g, (), "sum", frame["correct_predictions"], dtype="int64")
    frame["total_sum"] = made(g, (), "sum", frame["total_tokens"], dtype="int64")
    accuracy(g, frame["correct_tokens"], frame["total_sum"])


def ratio(g: Graph, numerator: Tensor, count: Tensor) -> None:
    """(numerator / count).item() if count > 0 else 0.0: a 0-d bool tested, a 0-d quotient .item()'d (true division:
    a floating numerator's dtype, the entropy's the logits'; fp32 for a count's). A numerator that carries grad
    (chunked_nll's entropy) makes a DivBackward0, which saves the count."""
    positive = made(g, (), "gt", count, dtype="bool")
    del positive
    if numerator.requires_grad:
        quotient = aten.div_tensor(g, numerator, count)
    else:
        dtype = "fp32" if numerator.dtype in ("int64", "int32", "bool") else numerator.dtype
        quotient = made(g, (), "div", numerator, count, dtype=dtype)
    del quotient


def accuracy(g: Graph, correct_tokens: Tensor, total_sum: Tensor) -> None:
    """(correct_tokens.sum() / total_sum).item() if total_sum > 0 else 0.0: the 0-d bool tested first, then the sum
    and the fp32 quotient, .item()'d."""
    positive = made(g, (), "gt", total_sum, dtype="bool")
    del positive
    summed = made(g, (), "sum", correct_tokens, dtype="int64")
    quotient = made(g, (), "div", summed, total_sum, dtype="fp32")
    del summed, quotient


def train_tokens(g: Graph, shape: tuple) -> None:
    """compute_loss in training (from 0.15): gather_for_metrics(inputs["attention_mask"].sum()).sum().item(), the
    collator's all-ones mask made where it is read (in a real run its B·T int64 bytes come with the batch) and gone
    once summed: nothing kept."""
    summed_twice(g, g.empty(shape, "int64", "ones", kind="input"), "int64")


def one_block(g: Graph, logits: Tensor, labels: Tensor, kernel: bool) -> list[Tensor]:
    """1.6-1.14's metrics, one no_grad block over the shifted views (not copied): entropy_from_logits (its reshape
    a copy where the micro-batch has more than one sequence; 1.14 on CUDA, kernel: trl's Triton kernel instead), the
    argmax, the labels' mask, the masked entropy sum and the count, (predictions == labels) & mask and its count;
    gathered, the two ratios .item()'d; then the training token count. Its locals are compute_loss's until it
    returns."""
    B, T, _ = logits.shape
    shift_logits, shift_labels = shifted(g, logits, labels, contiguous=False)
    if kernel:
        per_token = kernel_entropy(g, shift_logits)
    else:
        per_token = entropy_from_logits(g, shift_logits, B * (T - 1), copy=B > 1)
    predictions = made(g, (B, T - 1), "argmax", shift_logits, dtype="int64")
    mask = made(g, (B, T - 1), "ne", shift_labels, dtype="bool")
    entropy_sum, total_tokens = masked_entropy(g, per_token, mask)
    equal = made(g, (B, T - 1), "eq", predictions, shift_labels, dtype="bool")
    correct = made(g, (B, T - 1), "bitwise_and", equal, mask, dtype="bool")
    del equal
    correct_tokens = made(g, (), "sum", correct, dtype="int64")
    entropy_sum = made(g, (), "sum", entropy_sum, dtype=per_token.dtype)  # gather_for_metrics(...).sum()
    total_tokens = made(g, (), "sum", total_tokens, dtype="int64")
    ratio(g, entropy_sum, total_tokens)
    total_sum = made(g, (), "sum", total_tokens, dtype="int64")
    accuracy(g, correct_tokens, total_sum)
    train_tokens(g, labels.shape)
    return [shift_logits, shift_labels, per_token, predictions, mask, entropy_sum, total_tokens, correct,
            correct_tokens, total_sum]  # fmt: skip


def kernel_entropy(g: Graph, logits: Tensor) -> Tensor:
    """1.14's entropy_from_logits on CUDA (trl/trainer/utils.py, _supports_trl_loss_kernel: a 16- or 32-bit view whose
    last stride is 1): index = torch.zeros(logits.shape[:-1]) (int64), then trl/kernels/logprob_entropy.py
    selective_log_softmax_and_entropy: fp32 logprobs, entropy, log_z and expected_logit of that shape, one Triton
    kernel writing them (log_z and expected_logit go as the Function returns under no_grad); the index and the
    log-probabilities (`_`) go as entropy_from_logits returns."""
    rows = logits.shape[:-1]
    index = made(g, rows, "zeros", dtype="int64")
    logprobs = g.empty(rows, "fp32", "empty")
    entropy, log_z, expected_logit = (g.empty(rows, "fp32", "empty_like") for _ in range(3))
    g.kernel("logprob_entropy", (logits, index), (logprobs, entropy, log_z, expected_logit))
    del log_z, expected_logit, index, logprobs
    return entropy
