"""TRL 1.3-1.12's PPOTrainer rollout (--rl ppo), op by op in bytes: the start of each update in trl/experimental/ppo/
ppo_trainer.py PPOTrainer.train, under torch.no_grad (verify/trl_ppo.py runs it; memcalc.exact.hf.ppo replays the PPO
epochs after it; memcalc.exact.replay.ppo runs generate_all, score_all and process in turn). Every prompt position
real and every response response_length long (no stop token: the most it holds). In train()'s order:
  generate  batch_generation: for each local_rollout_forward_batch_size chunk of the local batch, ppo_trainer.generate
            (the mask != pad, the ids masked) and the policy's model.generate with return_dict_in_generate and
            output_scores (memcalc.exact.hf.generate's loop: no end token, so no pad bookkeeping; the temperature's
            warped fp32 scores (rows, V) kept every step); torch.stack of the scores and the prompt and response
            concatenated; then both padded over the chunks (torch.full); the previous update's scores go only as
            train() rebinds logitss
  score     for each chunk: selective_log_softmax of the scores, the reference's forward to its logits (a copy of the
            policy, or under PEFT the policy with its adapters disabled), its log-probs, then the value and reward
            models' backbones and score heads (get_reward); the chunk's locals rebound
  process   the chunks concatenated, the masks, the KL and the rewards, each GAE step's advantage, returns, the
            advantages whitened
What survives from the previous update (its scores, the last chunk's locals, the GAE list, the last micro-batch's
vf_loss_max) is made by replaying that update's PPO epoch first and its closing `del`s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .dpo_logits import selective_log_softmax
from .generate import Loop, decode, grown, prefill, setup
from .ppo import masked_mean_no_grad
from .ppo_models import model_inputs, run_backbone, run_causal_lm, score_head

if TYPE_CHECKING:
    from .family import HFModel

UPDATE_END = ("kl", "scores", "non_score_reward", "query_responses", "responses", "postprocessed_responses",
              "logprobs", "ref_logprobs", "values", "sequence_lengths", "contain_eos_token", "sequence_lengths_p1",
              "response_idxs", "padding_mask", "padding_mask_p1", "rewards", "actual_start", "actual_end",
              "advantages", "returns")  # the update's two closing `del`s, in order (the metrics' 0-d tensors aside)


def update_end(g: Graph, m: HFModel) -> None:
    """The update's metrics (of their 0-d tensors rlhf_reward outlives it) and its closing `del`s: what survives
    them is what the next rollout starts beside."""
    m.batch["rlhf_reward"] = made(g, (), "add")
    for name in UPDATE_END:
        m.batch.pop(name, None)


def next_batch(g: Graph, m: HFModel) -> None:
    """data = next(iter_dataloader): the loader's prefetched batch becomes the current one and it fetches the next
    (the old batch stays while the last chunk's `query` views it); queries = data["input_ids"] (on the device)."""
    b = m.batch
    old, prefetched = b["data"]
    loaded = "lift_fresh" if m.cfg.device == "cpu" else "_to_copy"
    b["data"] = [prefetched, made(g, old.shape, loaded, dtype="int64")]
    del old
    b["queries"] = b["data"][0]


def generate_all(g: Graph, m: HFModel, every_step: bool = True) -> None:
    """batch_generation over the chunks, then train()'s query_responses, logitss = ... (the old scores go).
    every_step False: the decode steps between the second and the last are grown, not replayed (the last holds the
    most: memcalc.exact.hf.generate)."""
    b, ppo = m.batch, m.cfg.stack.ppo
    rows, P = b["queries"].shape
    C, chunk = ppo.completion_len, min(ppo.rollout_batch, rows)
    made_ids, made_scores = [], []
    for start in range(0, rows, chunk):
        R = min(chunk, rows - start)
        ids, scores = generate(g, m, R, P, C, every_step)
        made_ids.append(ids)
        made_scores.append(scores)
        del ids, scores
    n = len(made_ids)
    padded_ids = made(g, (n, chunk, P + C), "full", dtype="int64")  # pad(query_responses, ...)
    padded_scores = made(g, (n, chunk, C, m.cfg.shape.vocab), "full")
    del made_ids, made_scores  # batch_generation returns
    b["query_responses"] = g.view(padded_ids, (rows, P + C))
    b["logitss"] = padded_scores


def generate(g: Graph, m: HFModel, R: int, P: int, C: int, every_step: bool = True) -> tuple[Tensor, Tensor]:
    """ppo_trainer.generate over one chunk: the mask and the masked ids, model.generate (its loop as memcalc.exact.hf.
    generate replays it: no end token, the warped scores kept), torch.stack(output.scores, 1) and the prompt with
    the generated tokens; then its locals and the output (ids, scores, cache) go."""
    attention_mask = made(g, (R, P), "ne", dtype="bool")
    padding = made(g, (R, P), "bitwise_not", attention_mask, dtype="bool")
    input_ids = made(g, (R, P), "masked_fill", padding, dtype="int64")
    del padding
    m.cache = []  # generate's DynamicCache
    outer, g.grad_enabled = g.grad_enabled, False
    loop = setup(g, R, P, eos=False, scores=[])
    prefill(g, m, loop, input_ids, attention_mask)
    for k in range(1, C):
        if not every_step and 1 < k < C - 1:
            continue
        if not every_step and k == C - 1 and C > 3:
            grown(g, m, loop, C - 3)  # steps 2 .. C - 2
        decode(g, m, loop)
    m.decoding = False
    sequences, scores, cache = finished(loop), loop.scores, m.cache
    m.cache = None
    stacked = made(g, (R, C, m.cfg.shape.vocab), "stack", *scores)
    ids = made(g, (R, P + C), "cat", sequences, dtype="int64")
    g.grad_enabled = outer
    del attention_mask, input_ids, sequences, scores, cache
    return ids, stacked


def finished(loop: Loop) -> Tensor:
    """_sample and generate return: their locals go (the mask, unfinished_sequences, the model inputs, the last
    logits, probabilities and tokens, the special tokens, the position ids); the ids stay as output.sequences."""
    ids = loop.ids
    for name in ("mask", "unfinished", "inputs", "logits", "probs", "tokens", "special", "position_ids", "ids"):
        setattr(loop, name, None)
    return ids


def score_all(g: Graph, m: HFModel, causal_lm) -> None:
    """The scoring loop over the chunks, each rebinding its locals; the lists its chunks are appended to."""
    b, ppo = m.batch, m.cfg.stack.ppo
    rows, T = b["query_responses"].shape
    C, chunk = ppo.completion_len, min(ppo.rollout_batch, rows)
    lists = {name: [] for name in ("responses", "postprocessed_responses", "logprobs", "ref_logprobs",
                                   "sequence_lengths", "scores", "values")}  # fmt: skip
    outer, g.grad_enabled = g.grad_enabled, False
    for start in range(0, rows, chunk):
        R = min(chunk, rows - start)
        score_chunk(g, m, R, T, C, causal_lm, lists)
    for name in list(lists):  # x = torch.cat(x, 0) of each list: the list goes, with the earlier chunks' tensors
        parts = lists.pop(name)
        b[name] = made(g, (rows,) + tuple(parts[0].shape[1:]), "cat", *parts, dtype=parts[0].dtype)
        del parts
    for name in ("logprob", "ref_logprob", "full_value", "value", "score"):  # del (logprob, ..., unwrapped_model)
        b.pop(name, None)
    g.grad_enabled = outer


def score_chunk(g: Graph, m: HFModel, R: int, T: int, C: int, causal_lm, lists: dict) -> None:
    """One chunk: its views, the policy's log-probs from the scores, the reference's from its logits, the value and
    the reward (get_reward), appended to the lists."""
    b, loop = m.batch, m.own_loop
    P = T - C
    b["query"] = g.view(b["queries"], (R, P))
    b["query_response"] = g.view(b["query_responses"], (R, T))
    b["response"] = g.view(b["query_responses"], (R, C))
    logits = g.view(b["logitss"], (R, C, m.cfg.shape.vocab))
    b["logprob"] = selective_log_softmax(g, logits, b["response"], m.cfg.watched)
    del logits
    ref = loop.reference or replace(m, p={k: v for k, v in m.p.items() if ".lora_" not in k})  # adapters disabled
    attention_mask, position_ids, input_ids = model_inputs(g, b["query_response"])
    output, full = run_causal_lm(g, ref, input_ids, attention_mask, position_ids, causal_lm)
    del attention_mask, position_ids, input_ids  # forward() returns
    ref_logits = g.view(full, (R, C, m.cfg.shape.vocab))  # [:, P - 1:-1], /= temperature in place
    del full
    b["ref_logprob"] = selective_log_softmax(g, ref_logits, b["response"], m.cfg.watched)
    del output, ref_logits
    b["postprocessed_response"] = b["response"]
    b["postprocessed_query_response"] = made(g, (R, T), "cat", b["query"], b["response"], dtype="int64")
    b["sequence_length"] = aten.sub_scalar(g, first_true_indices(g, R, C))
    out = get_reward(g, m, loop.critic, b["query_response"], P)  # full_value, _, _ = ...
    b["full_value"], b["_"], b["_"] = out
    del out
    b["value"] = g.view(b["full_value"], (R, C))
    out = get_reward(g, m, loop.reward, b["postprocessed_query_response"], P)  # _, score, _ = ...
    b["_"], b["score"], b["_"] = out
    del out
    for name, x in (("responses", b["response"]), ("postprocessed_responses", b["postprocessed_response"]),
                    ("logprobs", b["logprob"]), ("ref_logprobs", b["ref_logprob"]),
                    ("sequence_lengths", b["sequence_length"]), ("scores", b["score"]), ("values", b["value"])):
        lists[name].append(x)  # fmt: skip


def first_true_indices(g: Graph, R: int, C: int) -> Tensor:
    """first_true_indices(x == pad_token_id): the test, row_len * (~bools).type(long) + arange(row_len), its
    torch.min over the row (values and indices); the values."""
    bools = made(g, (R, C), "eq", dtype="bool")
    inverted = made(g, (R, C), "bitwise_not", bools, dtype="bool")
    longs = made(g, (R, C), "_to_copy", inverted, dtype="int64")
    del inverted
    scaled = made(g, (R, C), "mul", longs, dtype="int64")
    del longs
    columns = made(g, (C,), "arange", dtype="int64")
    zero_or_index = made(g, (R, C), "add", scaled, columns, dtype="int64")
    del scaled, columns
    values, indices = made(g, (R,), "min", zero_or_index, dtype="int64"), made(g, (R,), "min", dtype="int64")
    del indices, bools, zero_or_index
    return values


def get_reward(g: Graph, m: HFModel, model: HFModel, query_responses: Tensor, P: int) -> tuple[Tensor, ...]:
    """trl/experimental/utils.py get_reward: the backbone (no cache) with output_hidden_states, the score head,
    sequence_lengths = first_true_indices(query_responses[:, P:] == pad) - 1 + P, and the score at each row's last
    position (an arange and an index): (reward_logits, the scores, sequence_lengths)."""
    R, T = query_responses.shape
    attention_mask, position_ids, input_ids = model_inputs(g, query_responses)
    output = run_backbone(g, model, m.own_loop.decoder, input_ids, attention_mask, position_ids, use_cache=False)
    reward_logits = score_head(g, model, output.hidden[-1])
    found = first_true_indices(g, R, T - P)
    less = aten.sub_scalar(g, found)
    del found
    sequence_lengths = aten.add_scalar(g, less)
    del less
    rows = made(g, (R,), "arange", dtype="int64")
    picked = made(g, (R, 1), "index", reward_logits, rows, sequence_lengths, dtype=reward_logits.dtype)
    del rows, attention_mask, position_ids, input_ids, output
    return reward_logits, picked, sequence_lengths


def process(g: Graph, m: HFModel) -> None:
    """After the scoring loop: the end-token test, the response positions and masks, the log-probs masked, the KL
    (k1) and rewards, the score added at each row's end, GAE backwards over the response, returns, whitening."""
    b = m.batch
    rows, C = b["responses"].shape
    eos = made(g, (rows, C), "eq", b["postprocessed_responses"], dtype="bool")
    b["contain_eos_token"] = made(g, (rows,), "any", eos, dtype="bool")
    del eos
    columns = made(g, (C,), "arange", dtype="int64")
    b["response_idxs"] = made(g, (rows, C), "repeat", columns, dtype="int64")
    del columns
    b["padding_mask"] = made(g, (rows, C), "gt", b["response_idxs"], dtype="bool")
    for name in ("logprobs", "ref_logprobs"):
        b[name] = made(g, (rows, C), "masked_fill", b[name], b["padding_mask"], dtype=b[name].dtype)
    b["sequence_lengths_p1"] = made(g, (rows,), "add", b["sequence_lengths"], dtype="int64")
    b["padding_mask_p1"] = made(g, (rows, C), "gt", b["response_idxs"], dtype="bool")
    b["values"] = made(g, (rows, C), "masked_fill", b["values"], b["padding_mask_p1"], dtype=b["values"].dtype)
    b["logr"] = made(g, (rows, C), "sub", b["ref_logprobs"], b["logprobs"])
    b["kl"] = made(g, (rows, C), "neg", b["logr"])
    b["non_score_reward"] = made(g, (rows, C), "mul", b["kl"])
    b["rewards"] = made(g, (rows, C), "clone", b["non_score_reward"])
    b["actual_start"] = made(g, (rows,), "arange", dtype="int64")
    inside = made(g, (rows,), "lt", b["sequence_lengths_p1"], dtype="bool")
    b["actual_end"] = made(g, (rows,), "where", inside, dtype="int64")
    del inside
    at_end = made(g, (rows,), "index", b["rewards"])  # rewards[actual_start, actual_end] += scores
    del at_end
    advantages(g, b, rows, C)


def advantages(g: Graph, b: dict, rows: int, C: int) -> None:
    """lastgaelam = 0, advantages_reversed = [] (the old list goes), each step backwards: nextvalues, delta =
    rewards[:, t] + gamma * nextvalues - values[:, t], lastgaelam = delta + gamma * lam * lastgaelam; the stack,
    returns, masked_whiten, the padding masked."""
    b["lastgaelam"] = None
    b["advantages_reversed"] = []
    for t in reversed(range(C)):
        b["nextvalues"] = None if t == C - 1 else g.view(b["values"], (rows,))
        scaled = None if t == C - 1 else made(g, (rows,), "mul", b["nextvalues"], dtype=b["values"].dtype)
        summed = made(g, (rows,), "add", b["rewards"])
        del scaled
        b["delta"] = made(g, (rows,), "sub", summed, b["values"])
        del summed
        decayed = None if t == C - 1 else made(g, (rows,), "mul", b["lastgaelam"])
        b["lastgaelam"] = made(g, (rows,), "add", b["delta"])
        del decayed
        b["advantages_reversed"].append(b["lastgaelam"])
    stacked = made(g, (rows, C), "stack", *b["advantages_reversed"])
    b["returns"] = made(g, (rows, C), "add", stacked, b["values"])
    mask = made(g, (rows, C), "bitwise_not", b["padding_mask"], dtype="bool")
    whitened = masked_whiten(g, stacked, mask)
    del stacked, mask
    b["advantages"] = made(g, (rows, C), "masked_fill", whitened, b["padding_mask"])
    del whitened


def masked_whiten(g: Graph, values: Tensor, mask: Tensor) -> Tensor:
    """masked_whiten(values, mask) with shift_mean: the mean, the unbiased masked variance (mask.sum() checked
    against 0, Bessel's correction), (values - mean) * rsqrt(var + 1e-8)."""
    mean = masked_mean_no_grad(g, values, mask)
    inner = masked_mean_no_grad(g, values, mask)  # masked_var's own mean
    centered = made(g, values.shape, "sub", values, inner)
    squared = made(g, values.shape, "pow", centered)
    variance = masked_mean_no_grad(g, squared, mask)
    del squared
    mask_sum = made(g, (), "sum", mask, dtype="int64")
    made(g, (), "eq", mask_sum, dtype="bool")  # if mask_sum == 0
    less = made(g, (), "sub", mask_sum, dtype="int64")
    bessel = made(g, (), "div", mask_sum, less)
    del less
    variance = made(g, (), "mul", variance, bessel)
    del inner, centered, mask_sum, bessel
    shifted = made(g, values.shape, "sub", values, mean)
    eps = made(g, (), "add", variance)
    root = made(g, (), "rsqrt", eps)
    del eps
    out = made(g, values.shape, "mul", shifted, root)
    del shifted, root, mean, variance
    return out
