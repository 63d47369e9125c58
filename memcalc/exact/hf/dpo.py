"""TRL 1.16's DPOTrainer step (--rl dpo), op by op in bytes: trl/trainer/dpo_trainer.py DPOTrainer._compute_loss and
Transformers' Trainer.training_step around it (the trl 1.16.0 wheel; verify/trl_dpo.py runs it).

The batch is DataCollatorForPreference's: the chosen sequences, then the rejected ones (2 x the pairs per device),
input_ids and completion_mask; every position is taken to be a completion token (no prompt masked, no padding: the
most the step holds). _compute_loss then:
  labels     input_ids.masked_fill(completion_mask == 0, -100)
  policy     the model through its fused LM head (memcalc.exact.hf.fused_head, DPO's outputs: log_probs, entropy,
             mean_logits, is_top1), each row's log-probabilities summed
  reference  the same model with its LoRA adapters disabled (PEFT: no ref_model; use_adapter(model, None)), or
             a second copy of a model that is not PEFT's (reference_model), under no_grad with activation
             checkpointing turned off (disable_gradient_checkpointing): nothing saved, its temporaries on top of
             the policy's saved activations; with precompute_ref_log_probs (--precompute-ref) none: the batch
             brings each pair's two reference log-probs (and a full fine-tune keeps no second model)
  loss       sigmoid: -logsigmoid(beta * ((chosen - ref chosen) - (rejected - ref rejected))).mean()
  metrics    entropy, token count, mean logits, token accuracy, rewards, margins, log-probs: a few (B,) and 0-d
             tensors and their .item()
The Trainer divides the loss by the accumulation steps (DPOTrainer.loss_is_scaled_for_ga False). DPOConfig's
disable_dropout sets every nn.Dropout to p=0 (LoRA's too): the job takes lora_dropout 0 (memcalc.model.stacks with_rl).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from memcalc.model.finetune import FULL
from memcalc.model.rl import second_model

from .. import aten
from ..aten.arithmetic import pointwise
from ..aten.operands import made
from ..aten.views import split
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import lora
from .fused_head import FusedOutput, index_rows, sliced

if TYPE_CHECKING:
    from .family import HFModel


def compute_loss(g: Graph, m: HFModel, idx: Tensor, completion_mask: Tensor, causal_lm: Callable) -> Tensor:
    """DPOTrainer._compute_loss (loss_type sigmoid, reverse KL, no ld_alpha, no weighting), then training_step's
    loss / gradient_accumulation_steps. Locals live until it returns, as in its frame. causal_lm: the model's forward
    (memcalc.exact.hf.model's, which calls this)."""
    B2, T = idx.shape
    with g.scoped("loss"):
        masked = made(g, (B2, T), "eq", completion_mask, dtype="bool")  # completion_mask == 0
        labels = made(g, (B2, T), "masked_fill", idx, masked, dtype="int64")
        del masked
    outputs = model_call(g, m, idx, labels, causal_lm)
    with g.scoped("loss"):
        per_token_logps = sliced(g, outputs.log_probs, (B2, T - 1))  # outputs.log_probs[:, -seq_len:]
        logps = aten.sum_last(g, per_token_logps)  # (2B,): chosen, then rejected
        halves = (B2 // 2,)
        chosen_logps, rejected_logps = split(g, logps, [B2 // 2, B2 // 2], 0)  # logps.chunk(2, dim=0)
    if m.cfg.stack.precompute_ref:  # inputs["ref_chosen_logps"], inputs["ref_rejected_logps"], made where read
        ref_outputs = ref_per_token_logps = ref_logps = None
        with g.scoped("loss"):
            ref_chosen_logps, ref_rejected_logps = made(g, halves, "zeros"), made(g, halves, "zeros")
    else:
        ref_outputs = reference_call(g, m, idx, labels, causal_lm)
        with g.scoped("loss"):
            ref_per_token_logps = g.view(ref_outputs.log_probs, (B2, T - 1))  # no_grad: a view
            ref_logps = made(g, (B2,), "sum", ref_per_token_logps)
            ref_chosen_logps, ref_rejected_logps = g.view(ref_logps, halves), g.view(ref_logps, halves)
    with g.scoped("loss"):
        loss, frame = sigmoid_loss(g, m, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
        held = metrics(g, m, outputs, completion_mask)
        held += reward_metrics(g, frame["chosen_logratios"], frame["rejected_logratios"], chosen_logps)
        del held, frame, outputs, ref_outputs, labels, per_token_logps, ref_per_token_logps, logps  # the frame's
        del ref_logps, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps  # locals, as it returns
        return pointwise(g, loss, "div", "div")  # training_step: loss / current_gradient_accumulation_steps


def sigmoid_loss(g: Graph, m: HFModel, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
                 ref_rejected_logps: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The log-ratios, reverse KL's scores, loss_type sigmoid's -logsigmoid(beta * delta_score) and `loss = 0.0;
    loss += per_sequence_loss.mean() * loss_weight`: the loss, and the locals _compute_loss keeps until it returns."""
    chosen_logratios = aten.sub(g, chosen_logps, ref_chosen_logps)
    rejected_logratios = aten.sub(g, rejected_logps, ref_rejected_logps)
    delta_score = aten.sub(g, chosen_logratios, rejected_logratios)
    scaled = aten.mul_scalar(g, delta_score)  # self.beta * delta_score
    per_sequence_loss = aten.neg(g, log_sigmoid(g, scaled, m.cfg.watched))
    del scaled
    mean = mean_all(g, per_sequence_loss)
    weighted = aten.mul_scalar(g, mean)  # * loss_weight
    del mean
    loss = aten.add_scalar(g, weighted)  # 0.0 + it
    del weighted
    return loss, dict(chosen_logratios=chosen_logratios, rejected_logratios=rejected_logratios,
                      delta_score=delta_score, per_sequence_loss=per_sequence_loss)  # fmt: skip


def model_call(g: Graph, m: HFModel, idx: Tensor, labels: Tensor, causal_lm: Callable) -> FusedOutput:
    """model(**model_kwargs, labels=labels, fused_lm_head=True): through accelerate's autocast where the recipe has
    it (its fp32 conversion finds no 16-bit output: the fused head's are fp32 and bool)."""
    if m.autocast is None:
        return causal_lm(g, m, idx, labels, None)[0]
    with m.autocast.region(g):
        return causal_lm(g, m, idx, labels, None)[0]


def reference_model(g: Graph, cfg, arch: str, family, autocast) -> HFModel | None:
    """DPOTrainer's ref_model where the policy is not PEFT's and the reference is not precomputed: a second copy of
    the model (create_model_from_path with dtype=model.dtype: every weight in the policy's dtype), its own rotary
    buffers, loaded after the policy. Its weights still require grad (nothing turns it off; no_grad keeps them out of
    autograd), so under autocast its forward caches a 16-bit copy of each fp32 weight it casts until the forward
    returns (aten/src/ATen/autocast_mode.cpp cached_cast: a leaf that requires grad), as the policy's does;
    Accelerator.prepare_model(evaluation_mode=True) wraps its forward in the same autocast. add_fused_lm_head(
    ref_model) with its default outputs, log_probs alone; no activation checkpointing. None otherwise."""
    from .family import HFModel

    if not second_model(cfg.stack):  # GRPOTrainer's at beta > 0 is made the same way (and only held in a step)
        return None
    dtype = next(lora.dtype_of(name, cfg) for name, _ in family.params(cfg.shape))  # model.dtype: the first's
    params = {name: g.param(shape, dtype, name) for name, shape in family.params(cfg.shape)}  # requires_grad True
    rope = [g.empty(b[1], dtype if b[2:] == ("weights",) else "fp32", "buffer " + b[0], kind="buffer")
            for b in family.buffers(cfg.shape)]  # fmt: skip
    ref_cfg = replace(cfg, tricks=replace(cfg.tricks, recompute="none"), stack=replace(cfg.stack, finetune=FULL))
    return HFModel(ref_cfg, arch, params, rope, [], autocast, outputs=("log_probs",))


def reference_call(g: Graph, m: HFModel, idx: Tensor, labels: Tensor | None, causal_lm: Callable,
                   call: Callable | None = None) -> FusedOutput | Tensor:  # fmt: skip
    """The reference forward, under torch.no_grad() and disable_gradient_checkpointing: DPOTrainer's ref_model
    (reference_model), or under PEFT the policy with its adapters disabled (each LoRA layer runs its base layer
    alone), through the same fused LM head (model_call), or before 1.15 to its logits (call: memcalc.exact.hf.
    dpo_logits.model_logits)."""
    ref = m.reference or replace(m, p={k: v for k, v in m.p.items() if ".lora_" not in k},
                                 cfg=replace(m.cfg, tricks=replace(m.cfg.tricks, recompute="none")))  # fmt: skip
    outer, g.grad_enabled = g.grad_enabled, False
    mem = g.mem  # its blocks peak apart from the policy's: their own segments (memcalc.exact.growth grows both)
    policy = mem.segment_peaks, mem.blocks_seen
    mem.segment_peaks = {"start": (mem.live_bytes, f"{mem.phase}: (the reference's start)")}
    mem.blocks_seen, mem.segment = [], "before"
    try:
        return model_call(g, ref, idx, labels, causal_lm) if call is None else call(g, ref, idx, causal_lm)
    finally:
        g.grad_enabled = outer
        mem.segments["reference"] = (dict(mem.segment_peaks), list(mem.blocks_seen))
        (mem.segment_peaks, mem.blocks_seen), mem.segment = policy, "after"


def log_sigmoid(g: Graph, x: Tensor, watched: bool) -> Tensor:
    """F.logsigmoid (log_sigmoid_forward: output and buffer; LogSigmoidBackward0 saves self and the buffer). The
    buffer is empty on CUDA (aten/src/ATen/native/cuda/Activation.cpp), x-sized on CPU and meta (watched)."""
    shape = x.shape
    buffer = made(g, shape if watched else (0,), "log_sigmoid_forward", x)

    def rule(gs):
        return [made(g, shape, "log_sigmoid_backward", gs[0], dtype=gs[0].dtype)]

    node = g.begin("log_sigmoid_forward", [x], rule, [(x, "self"), (buffer, "buffer")])
    out = made(g, shape, "log_sigmoid_forward", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def metrics(g: Graph, m: HFModel, outputs: FusedOutput, completion_mask: Tensor) -> list[Tensor]:
    """_compute_loss's logged metrics from the fused head's outputs, in its order (the rewards follow:
    reward_metrics); what stays bound in its frame until it returns is returned."""
    B2, T = completion_mask.shape
    rows, half_rows = (B2, T - 1), (B2 // 2, T - 1)
    shift_mask = g.view(completion_mask, rows)  # completion_mask[..., 1:]
    weighted = made(g, rows, "mul", outputs.entropy, shift_mask)  # per_token_entropy * mask
    entropy_sum = made(g, (), "sum", weighted)
    del weighted
    total_tokens = made(g, (), "sum", shift_mask, dtype="int64")
    entropy_sum = made(g, (), "sum", entropy_sum)  # gather_for_metrics(...).sum()
    total_tokens = made(g, (), "sum", total_tokens, dtype="int64")
    item_of(made(g, (), "gt", total_tokens, dtype="bool"))  # if total_tokens > 0
    item_of(made(g, (), "div", entropy_sum, total_tokens))
    ones = made(g, (B2, T), "ones", dtype="int64")  # inputs["attention_mask"], made where read (verify/trl_dpo.py)
    counted = made(g, (), "sum", ones, dtype="int64")
    del ones
    item_of(made(g, (), "sum", counted, dtype="int64"))
    del counted
    chosen_mask = g.view(completion_mask, half_rows)
    totals = []
    for _half in ("chosen", "rejected"):  # each half's mean logits at its completion tokens, and their count
        logits = g.view(outputs.mean_logits, half_rows)
        picked = index_rows(g, logits, made(g, half_rows, "_to_copy", chosen_mask, dtype="bool"), m.cfg.watched)
        totals.append(made(g, (), "sum", picked))
        del picked
        totals.append(made(g, (), "sum", chosen_mask, dtype="int64"))
    for i, total in enumerate(totals):  # gather_for_metrics(total).sum().item(), rebound to the float
        item_of(made(g, (), "sum", total, dtype=total.dtype))
        totals[i] = None
        del total
    chosen_is_top1 = g.view(outputs.is_top1, half_rows)
    as_bool = made(g, half_rows, "_to_copy", chosen_mask, dtype="bool")
    correct_predictions = made(g, half_rows, "bitwise_and", chosen_is_top1, as_bool, dtype="bool")
    del as_bool
    total_tokens = made(g, (), "sum", chosen_mask, dtype="int64")
    correct_tokens = made(g, (), "sum", correct_predictions, dtype="int64")
    total_sum = made(g, (), "sum", total_tokens, dtype="int64")
    item_of(made(g, (), "gt", total_sum, dtype="bool"))
    correct_sum = made(g, (), "sum", correct_tokens, dtype="int64")
    item_of(made(g, (), "div", correct_sum, total_sum))
    del correct_sum
    return [entropy_sum, total_tokens, correct_predictions, correct_tokens, total_sum]


def reward_metrics(g: Graph, chosen_logratios: Tensor, rejected_logratios: Tensor, chosen_logps: Tensor) -> list:
    """The rewards, their accuracy and margins, the log-probs' means (each gathered, .mean().item()'d); what stays
    bound in _compute_loss's frame is returned."""
    halves = chosen_logratios.shape
    chosen_rewards = made(g, halves, "mul", chosen_logratios)  # self.beta * chosen_logratios.detach()
    rejected_rewards = made(g, halves, "mul", rejected_logratios)
    item_of(made(g, (), "mean", chosen_rewards))
    item_of(made(g, (), "mean", rejected_rewards))
    above = made(g, halves, "gt", chosen_rewards, rejected_rewards, dtype="bool")
    reward_accuracies = made(g, halves, "_to_copy", above)  # .float()
    del above
    item_of(made(g, (), "mean", reward_accuracies))
    margins = made(g, halves, "sub", chosen_rewards, rejected_rewards)
    item_of(made(g, (), "mean", margins))
    item_of(made(g, (), "mean", chosen_logps))  # logps/chosen
    item_of(made(g, (), "mean", chosen_logps))  # logps/rejected (its size)
    return [chosen_rewards, rejected_rewards, reward_accuracies, margins]


def mean_all(g: Graph, x: Tensor) -> Tensor:
    """x.mean() (MeanBackward0): saves x's sizes; backward: grad.expand(x) / numel, an x-sized div."""
    shape = x.shape

    def rule(gs):
        return [made(g, shape, "div", gs[0], dtype=gs[0].dtype)]

    node = g.begin("mean", [x], rule)
    out = made(g, (), "mean", x, dtype=x.dtype)
    g.end(node, [out])
    return out


def item_of(t: Tensor) -> None:
    """x.item(): a Python number; the 0-d tensor goes with the statement."""
    del t
