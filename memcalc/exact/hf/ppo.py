"""TRL 1.3-1.12's PPOTrainer training step (--rl ppo, --stack trl:1.5 to trl:1.12), op by op in bytes:
trl/experimental/ppo/ppo_trainer.py PPOTrainer.train's PPO epochs as the trl 1.3.0 to 1.12.0 wheels ship them (the
same loop in each; verify/trl_ppo.py runs it), over Transformers' Llama decoder. No autocast (the trainer builds its
Accelerator without mixed_precision), no gradient clipping, no gradient checkpointing (nothing enables it). Each
micro-batch:
  batch      six rows picked from the rollout's tensors by a numpy index (a new tensor each: advantages, responses,
             query_responses, logprobs, returns, values), as its loop's locals rebind them
  forward    forward(model, ...): the mask (!= pad), position_ids (cumsum - long), the ids (masked_fill); then
             PolicyAndValueWrapper: the value model's backbone with output_hidden_states (each layer's input held
             until the wrapper returns) and its score head, then the policy with output_hidden_states: its logits,
             every position's (B, T, V), its DynamicCache and its hidden states held by `output` until the next
             micro-batch's forward returns
  loss       logits[:, P - 1:-1] /= temperature (in place on a view: CopySlices), selective_log_softmax, the value
             loss (clamped to the old values, squared, max, masked mean) and the clipped policy loss; Accelerate's
             backward divides by the accumulation steps
  metrics    after backward (and after the optimizer step on the accumulation's last micro-batch), under no_grad:
             the clip fraction, softmax(logits) over the response (B, C, V), its entropy, the approx KL
  carry      the loop's locals live until the next micro-batch rebinds them; at the mini-batch's end `del` drops
             them all but vf_loss_max, which the next mini-batch's first rebinds
The rollout's tensors (rollout_batch) are made before the first micro-batch and held by train() through the update
(memcalc.exact.hf.ppo_rollout replays the rollout that makes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .. import aten
from ..aten.arithmetic import pointwise
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .dpo_logits import logsumexp, selective_log_softmax
from .grpo import clamp, extremum
from .grpo_logits import tempered
from .ppo_models import Critic, Output, model_inputs, models_for, run_backbone, run_causal_lm, score_head

if TYPE_CHECKING:
    from .family import HFModel

ROWS = ("mb_advantage", "advantages"), ("mb_responses", "responses"), ("mb_query_responses", "query_responses"), \
    ("mb_logprobs", "logprobs"), ("mb_return", "returns"), ("mb_values", "values")  # the loop's picks, in order
DROPPED = ("output", "vpred_temp", "logits", "new_logprobs", "vpred", "vpredclipped", "vf_losses1", "vf_losses2",
           "vf_loss", "vf_clipfrac", "logprobs_diff", "ratio", "pg_losses", "pg_losses2", "pg_loss_max", "pg_loss",
           "loss", "pg_clipfrac", "prob_dist", "entropy", "approxkl", "mb_return", "mb_advantage", "mb_values",
           "mb_responses", "mb_query_responses", "mb_logprobs")  # the mini-batch's `del`, in its order
STATS = 7  # approxkl, pg_clipfrac, pg_loss, vf_loss, vf_clipfrac, entropy, ratio: (epochs, mini-batches, accumulation)


def loop_for(g: Graph, cfg, family, arch: str, critic: Critic) -> PpoLoop:
    """PPOTrainer's loop around the policy: its models (memcalc.exact.hf.ppo_models.models_for), the critic's
    decoder."""
    return PpoLoop(*models_for(g, cfg, family, arch, critic), critic.family.decoder)


class PpoLoop:
    """PPOTrainer.train's loop around the step: the value model beside the policy (its backbone run by the critic's
    decoder), the reward model and the reference (None under PEFT) only held in the step, and the loop's locals
    (frame), which outlive each micro-batch."""

    def __init__(self, critic: HFModel, reward: HFModel, reference: HFModel | None, decoder: Callable):
        self.critic, self.reward, self.reference, self.decoder = critic, reward, reference, decoder
        self.frame: dict[str, object] = {}

    def backward_done(self, g: Graph, m: HFModel) -> None:
        """optimizer.step() and zero_grad() do nothing before the accumulation's last micro-batch: the metrics."""
        metrics(g, m)

    def stepped(self, g: Graph, m: HFModel) -> None:
        """After the optimizer's step: the last micro-batch's metrics, then the mini-batch's `del`."""
        metrics(g, m)
        for name in DROPPED:
            self.frame.pop(name, None)


def rollout_batch(g: Graph, m: HFModel, B: int, T: int) -> dict:
    """What train() holds through the update from its rollout, made once, by the names of its locals and in the
    order it makes them (memcalc.exact.hf.ppo_rollout replays the rollout that makes them): the seven stats tensors,
    the loader's batch and the one it prefetched (on the GPU: DataLoaderShard moves both), the generation's ids and
    its scores (torch.stack of output_scores: fp32 logits of every response position, padded over the
    local_rollout_forward_batch_size chunks: kept whole while its view is the loop's), the last chunk's locals (views
    of the ids keep them), the concatenated responses, log-probs, values and scores, the masks, the KL and rewards,
    each GAE step's advantage (the reversed list outlives the stack; nextvalues, a view, keeps the values), returns
    and whitened advantages."""
    if m.batch:
        return m.batch
    ppo, shape = m.cfg.stack.ppo, m.cfg.shape
    C, A, dtype = ppo.completion_len, m.cfg.grad_accum, m.cfg.weights_dtype
    rows = B * A
    chunk = min(ppo.rollout_batch, rows)
    chunks = -(-rows // chunk)
    last = rows - (chunks - 1) * chunk
    b = m.batch
    b["stats"] = [made(g, (ppo.epochs, 1, A), "zeros") for _ in range(STATS)]
    loaded = "lift_fresh" if m.cfg.device == "cpu" else "_to_copy"
    b["data"] = [made(g, (rows, T - C), loaded, dtype="int64") for _ in range(2)]
    b["queries"] = b["query"] = g.view(b["data"][0], (last, T - C))
    b["query_responses"] = g.view(made(g, (chunks, chunk, T), "full", dtype="int64"), (rows, T))
    b["logitss"] = made(g, (chunks, chunk, C, shape.vocab), "full")
    b["query_response"] = g.view(b["query_responses"], (last, T))
    b["response"] = b["postprocessed_response"] = g.view(b["query_responses"], (last, C))
    b["postprocessed_query_response"] = made(g, (last, T), "cat", dtype="int64")
    b["sequence_length"] = made(g, (last,), "sub", dtype="int64")
    b["_"] = made(g, (last,), "add", dtype="int64")  # get_reward's sequence_lengths, the last `_` bound
    for name, size, op, kind in (("responses", C, "cat", "int64"), ("postprocessed_responses", C, "cat", "int64"),
                                 ("sequence_lengths", 0, "cat", "int64"), ("scores", 0, "cat", dtype),
                                 ("contain_eos_token", 0, "any", "bool"), ("response_idxs", C, "repeat", "int64"),
                                 ("padding_mask", C, "gt", "bool"), ("logprobs", C, "masked_fill", "fp32"),
                                 ("ref_logprobs", C, "masked_fill", dtype), ("sequence_lengths_p1", 0, "add", "int64"),
                                 ("padding_mask_p1", C, "gt", "bool"), ("values", C, "masked_fill", dtype),
                                 ("logr", C, "sub", "fp32"), ("kl", C, "neg", "fp32"),
                                 ("non_score_reward", C, "mul", "fp32"), ("rewards", C, "clone", "fp32"),
                                 ("actual_start", 0, "arange", "int64"), ("actual_end", 0, "where", "int64")):
        b[name] = made(g, (rows, size) if size else (rows,), op, dtype=kind)  # fmt: skip
    b["advantages_reversed"] = [made(g, (rows,), "add") for _ in range(C)]  # lastgaelam at each step
    b["lastgaelam"], b["delta"] = b["advantages_reversed"][-1], made(g, (rows,), "sub")
    b["nextvalues"] = g.view(b["values"], (rows,))  # values[:, 1], bound at the last step
    b["returns"] = made(g, (rows, C), "add")
    b["advantages"] = made(g, (rows, C), "masked_fill")
    return b


def picked(g: Graph, m: HFModel, source: Tensor, B: int) -> Tensor:
    """source[micro_batch_inds]: numpy's index made a tensor (on the CPU by lift_fresh; for a GPU tensor copied to it),
    then aten.index: a new (B, ...) tensor."""
    index = made(g, (B,), "lift_fresh" if m.cfg.device == "cpu" else "_to_copy", dtype="int64")
    out = made(g, (B,) + tuple(source.shape[1:]), "index", source, index, dtype=source.dtype)
    del index
    return out


def compute_loss(g: Graph, m: HFModel, idx: Tensor, labels: Tensor, causal_lm: Callable) -> Tensor:
    """One micro-batch of the PPO epoch's loop, to accelerator.backward's loss / gradient_accumulation_steps; the
    loop's locals in m.own_loop.frame, rebound in its order."""
    B, T = idx.shape
    C = m.cfg.stack.ppo.completion_len
    batch = rollout_batch(g, m, B, T)
    f = m.own_loop.frame
    for local, source in ROWS:
        f[local] = picked(g, m, batch[source], B)
    output, logits, vpred_temp = forward(g, m, f["mb_query_responses"], causal_lm)
    f["output"], f["vpred_temp"] = output, vpred_temp
    del output
    with g.scoped("loss"):
        f["logits"] = tempered(g, logits, C)  # logits[:, context_length - 1:-1], then /= temperature + 1e-7
        del logits
        f["new_logprobs"] = selective_log_softmax(g, f["logits"], f["mb_responses"], m.cfg.watched)
        f["new_logprobs"] = aten.masked_fill(g, f["new_logprobs"], picked(g, m, batch["padding_mask"], B))
        f["vpred"] = value_slice(g, vpred_temp, C)
        del vpred_temp
        f["vpred"] = aten.masked_fill(g, f["vpred"], picked(g, m, batch["padding_mask_p1"], B))
        f["vpredclipped"] = clipped_values(g, f["vpred"], f["mb_values"])
        for name, x in (("vf_losses1", f["vpred"]), ("vf_losses2", f["vpredclipped"])):
            f[name] = aten.pow2(g, aten.sub(g, x, f["mb_return"]))  # torch.square(x - mb_return)
        f["vf_loss_max"] = extremum(g, f["vf_losses1"], f["vf_losses2"], "maximum")
        f["vf_loss"] = aten.mul_scalar(g, masked_mean(g, f["vf_loss_max"], inverted(g, m, batch["padding_mask_p1"], B)))
        f["vf_clipfrac"] = fraction(g, m, batch["padding_mask_p1"], B)
        f["logprobs_diff"] = aten.sub(g, f["new_logprobs"], f["mb_logprobs"])
        f["ratio"] = aten.exp(g, f["logprobs_diff"])
        f["pg_losses"] = aten.mul(g, made(g, (B, C), "neg", f["mb_advantage"]), f["ratio"])  # -mb_advantage * ratio
        f["pg_losses2"] = aten.mul(g, made(g, (B, C), "neg", f["mb_advantage"]), clamp(g, f["ratio"]))
        f["pg_loss_max"] = extremum(g, f["pg_losses"], f["pg_losses2"], "maximum")
        f["pg_loss"] = masked_mean(g, f["pg_loss_max"], inverted(g, m, batch["padding_mask"], B))
        f["loss"] = aten.add(g, f["pg_loss"], aten.mul_scalar(g, f["vf_loss"]))  # pg_loss + vf_coef * vf_loss
        return pointwise(g, f["loss"], "div", "div")  # accelerator.backward: loss / gradient_accumulation_steps


def forward(g: Graph, m: HFModel, query_responses: Tensor, causal_lm: Callable) -> tuple[Output, Tensor, Tensor]:
    """ppo_trainer.forward: the mask, position_ids and ids, then PolicyAndValueWrapper.forward: the value model's
    backbone (critic_backbone) and score head, then the policy; the backbone's output goes as the wrapper returns,
    the mask and position_ids as forward() does (the ids stay: both embeddings save them)."""
    attention_mask, position_ids, input_ids = model_inputs(g, query_responses)
    critic = m.own_loop.critic
    backbone = run_backbone(g, critic, m.own_loop.decoder, input_ids, attention_mask, position_ids)
    vpred_temp = score_head(g, critic, backbone.hidden[-1])
    output, logits = run_causal_lm(g, m, input_ids, attention_mask, position_ids, causal_lm)
    del backbone, attention_mask, position_ids, input_ids
    return output, logits, vpred_temp


def value_slice(g: Graph, vpred_temp: Tensor, C: int) -> Tensor:
    """vpred_temp[:, P - 1:-1].squeeze(-1): SliceBackward0 (backward: slice_backward, a zero (B, T, 1) with the
    gradient copied in), the squeeze a view."""
    B, T, _ = full = vpred_temp.shape
    node = g.begin("slice", [vpred_temp], lambda gs: [made(g, full, "slice_backward", gs[0], dtype=gs[0].dtype)])
    out = g.view(vpred_temp, (B, C))
    g.end(node, [out])
    return out


def clipped_values(g: Graph, vpred: Tensor, mb_values: Tensor) -> Tensor:
    """torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value) (ClampBackward0: saves self and
    both bounds; backward: where((self >= min).logical_and(self <= max), grad, 0))."""
    shape = vpred.shape
    low = made(g, shape, "sub", mb_values, dtype=mb_values.dtype)
    high = made(g, shape, "add", mb_values, dtype=mb_values.dtype)

    def rule(gs):
        zero = made(g, (), "scalar_tensor", dtype=gs[0].dtype)
        above = made(g, shape, "ge", dtype="bool")
        below = made(g, shape, "le", dtype="bool")
        inside = made(g, shape, "logical_and", above, below, dtype="bool")
        out = made(g, shape, "where", inside, gs[0], zero, dtype=gs[0].dtype)
        del inside, below, above, zero
        return [out]

    node = g.begin("clamp", [vpred], rule, [(vpred, "self"), (low, "min"), (high, "max")])
    out = made(g, shape, "clamp", vpred, low, high, dtype=vpred.dtype)
    g.end(node, [out])
    return out


def inverted(g: Graph, m: HFModel, mask: Tensor, B: int) -> Tensor:
    """~padding_mask[micro_batch_inds]: the picked rows, their negation (the pick goes)."""
    rows = picked(g, m, mask, B)
    return made(g, rows.shape, "bitwise_not", rows, dtype="bool")


def masked_mean(g: Graph, values: Tensor, mask: Tensor) -> Tensor:
    """ppo_trainer.masked_mean: (values * mask).sum() / mask.sum(); the product saves the mask, the division the
    count."""
    summed = aten.sum_all(g, aten.mul(g, values, mask))
    return aten.div_tensor(g, summed, made(g, (), "sum", mask, dtype="int64"))


def fraction(g: Graph, m: HFModel, mask: Tensor, B: int, compared: tuple[str, str] = ("vf_losses2", "vf_losses1"),
             ) -> Tensor:  # fmt: skip
    """masked_mean((a > b).float(), ~mask[inds]) of tensors no gradient flows to: its temporaries go as it returns."""
    f = m.own_loop.frame
    greater = made(g, f[compared[0]].shape, "gt", f[compared[0]], f[compared[1]], dtype="bool")
    values = made(g, greater.shape, "_to_copy", greater)
    del greater
    mask = inverted(g, m, mask, B)
    out = masked_mean_no_grad(g, values, mask)
    del values, mask
    return out


def masked_mean_no_grad(g: Graph, values: Tensor, mask: Tensor) -> Tensor:
    """ppo_trainer.masked_mean where no gradient flows: the product, its sum, the count, their quotient; the
    temporaries go as it returns."""
    product = made(g, values.shape, "mul", values, mask)
    summed = made(g, (), "sum", product)
    del product
    count = made(g, (), "sum", mask, dtype="int64")
    out = made(g, (), "div", summed, count)
    del summed, count
    return out


def metrics(g: Graph, m: HFModel) -> None:
    """The micro-batch's statistics under no_grad, each rebinding the loop's local: the policy's clip fraction,
    prob_dist = softmax(logits) over the response, entropy = logsumexp(logits) - sum(prob_dist * logits), approxkl =
    0.5 * mean(logprobs_diff ** 2), the means of the entropy and the ratio (stored into the stats tensors in place)."""
    f, B = m.own_loop.frame, m.cfg.micro_batch
    outer, g.grad_enabled = g.grad_enabled, False
    try:
        with g.scoped("metrics"):
            f["pg_clipfrac"] = fraction(g, m, m.batch["padding_mask"], B, ("pg_losses2", "pg_losses"))
            logits = f["logits"]
            B, C, V = logits.shape
            f["prob_dist"] = made(g, logits.shape, "_softmax", logits, dtype=logits.dtype)
            total = logsumexp(g, g.view(logits, (B * C, V)), m.cfg.watched)
            product = made(g, logits.shape, "mul", f["prob_dist"], logits, dtype=logits.dtype)
            expected = made(g, (B, C), "sum", product, dtype=logits.dtype)
            del product
            f["entropy"] = made(g, (B, C), "sub", total, expected, dtype=logits.dtype)
            del total, expected
            squared = made(g, (B, C), "pow", f["logprobs_diff"])
            mean = made(g, (), "mean", squared)
            del squared
            f["approxkl"] = made(g, (), "mul", mean)
            del mean
            for name in ("entropy", "ratio"):  # entropy.mean(), ratio.mean() copied into their stats
                made(g, (), "mean", f[name], dtype=f[name].dtype)
    finally:
        g.grad_enabled = outer
