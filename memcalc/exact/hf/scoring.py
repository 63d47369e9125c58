"""The scoring passes GRPOTrainer and RLOOTrainer run between generating and training, op by op in bytes on
memcalc.exact.sim.graph: _generate_and_score_completions (trl/trainer/grpo_trainer.py, rloo_trainer.py, the trl
1.16.0 wheel; verify/trl_scoring.py runs them).

After generating, the trainer pads the batch into tensors (the prompts' and the completions' ids and masks, int64,
and with vLLM its sampling log-probs, fp32; GRPO's token count), concatenates them (the ids and the attention mask,
(rows, T) int64), and under torch.no_grad() with gradient checkpointing off (disable_gradient_checkpointing) scores
them with _get_per_token_logps_and_entropies: the model over chunks of per_device_train_batch_size rows through its
fused LM head, each chunk's log-probs kept (a view of its (B, T - 1) output) until they are concatenated. The passes:
  old        the policy's log-probs: RLOO always; GRPO where vLLM generated (importance sampling, on by default)
             or generation and optimizer steps are misaligned (not modelled: steps_per_generation is the accumulation)
  reference  the reference's, where beta is not 0: a second model (a full fine-tune), or the policy with its adapters
             disabled (PEFT)
A pass's loop keeps the last chunk's outputs and labels until the next chunk's replace them. The phase's peak is the
larger pass's, the earlier pass's log-probs held. Every chunk runs the same ops on the same sizes, so the first two,
the last whole one and the last are replayed and the log-probs of those between made (every_chunk replays them
all).
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.records import record

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import LiveBytes, Tensor
from .dpo import model_call
from .family import HFModel
from .fused_head import sliced
from .grpo import completion_labels, prompt_masked


@record(frozen=True)
class Scoring:
    """The scoring passes over one GPU's generation batch (bytes above the model's state; integers)."""

    rows: int  # the generation batch on this GPU
    chunk: int  # per_device_train_batch_size: the rows one forward scores
    passes: tuple[str, ...]  # "old", "reference", in the order they run
    peak_bytes: int  # the batch's tensors, the log-probs kept and one chunk's forward at the peak


def passes(cfg: StepConfig) -> tuple[str, ...]:
    """Which passes the trainer runs (none: GRPO with its own generate and beta 0)."""
    online, rl = cfg.stack.online, cfg.stack.rl
    old = ("old",) if rl == "rloo" or online.vllm else ()
    return old + (("reference",) if online.beta else ())


def scoring(cfg: StepConfig, rows: int) -> Scoring | None:
    """The passes' peak for the job (cfg: the training step's, micro_batch the chunk), None where there are none.
    Where the layers are alike (memcalc.exact.hf.generate.alike) each keeps the same bytes until the forward returns
    (under autocast, its fp32 weights' 16-bit copies; else nothing), so the peak is affine in the depth: replayed at
    two depths and carried to the model's (tests/test_scoring.py holds it to the full-depth replay)."""
    from .generate import alike

    L = cfg.shape.n_layers
    if not alike(cfg) or L <= 3:
        return replay(cfg, rows)[0]
    two, three = (replay(replace(cfg, shape=replace(cfg.shape, n_layers=n)), rows)[0] for n in (2, 3))
    if two is None:
        return None
    return replace(two, peak_bytes=two.peak_bytes + (L - 2) * (three.peak_bytes - two.peak_bytes))


def replay(cfg: StepConfig, rows: int, every_chunk: bool = False,
           timeline: bool = False) -> tuple[Scoring | None, LiveBytes | None]:  # fmt: skip
    """scoring's replay at the depth cfg gives, and its LiveBytes (every allocation and free under timeline)."""
    from .model import build, causal_lm

    kinds = passes(cfg)
    if not kinds:
        return None, None
    B, T, C = cfg.micro_batch, cfg.seq_len, cfg.stack.online.completion_len
    g = Graph(LiveBytes(timeline=[] if timeline else None))
    m = build(g, replace(cfg, tricks=replace(cfg.tricks, recompute="none"), grad_accum=1))
    base = g.mem.live_bytes
    g.grad_enabled = False  # torch.no_grad()
    held, ids, mask = batch(g, m, rows, T, C)
    g.mem.reset_peak()
    for kind in kinds:
        model = m if kind == "old" else reference(m)
        logps = score(g, model, ids, mask, rows, B, C, causal_lm, every_chunk)
        held += [logps] + (after_old(g, m, logps, held) if kind == "old" else [])
        del logps
    return Scoring(rows, B, kinds, g.mem.peak_bytes - base), g.mem


def batch(g: Graph, m: HFModel, rows: int, T: int, C: int) -> tuple[list[Tensor], Tensor, Tensor]:
    """The padded batch on the device: prompt ids and mask (rows, P), completion ids and mask (rows, C), int64; with
    GRPO's vLLM its sampling log-probs (rows, C) fp32; GRPO's num_items_in_batch (gather(loss_mask.sum()).sum():
    an int64 0-d); then the concatenated ids and attention mask (rows, T)."""
    P = T - C
    held = [made(g, (rows, P), "pad", dtype="int64"), made(g, (rows, P), "pad", dtype="int64"),
            made(g, (rows, C), "pad", dtype="int64"), made(g, (rows, C), "pad", dtype="int64")]  # fmt: skip
    if m.cfg.stack.rl == "grpo":
        if m.cfg.stack.online.vllm:
            held.append(made(g, (rows, C), "pad"))
        counted = made(g, (), "sum", held[3], dtype="int64")
        held.append(made(g, (), "sum", counted, dtype="int64"))
        del counted
    ids = made(g, (rows, T), "cat", dtype="int64")
    mask = made(g, (rows, T), "cat", dtype="int64")
    return held, ids, mask


def reference(m: HFModel) -> HFModel:
    """The reference model: the second copy a full fine-tune holds (memcalc.exact.hf.dpo reference_model), or the
    policy with its adapters disabled (use_adapter(model, None): each LoRA layer runs its base layer alone)."""
    return m.reference or replace(m, p={k: v for k, v in m.p.items() if ".lora_" not in k})


def score(g: Graph, m: HFModel, ids: Tensor, mask: Tensor, rows: int, B: int, C: int, causal_lm,
          every_chunk: bool) -> Tensor:  # fmt: skip
    """_get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=B): per chunk the labels
    (memcalc.exact.hf.grpo.completion_labels, prompt_masked), the model through its fused
    head under the recipe's autocast, its log-probs' last C columns kept (a view); the last chunk's outputs and
    labels live until the next chunk's replace them; then the kept columns concatenated (rows, C)."""
    T = ids.shape[1]
    chunks = [min(B, rows - start) for start in range(0, rows, B)]
    whole = len(chunks) - 1 if chunks[-1] == B else len(chunks) - 2  # the last whole chunk: a shorter last one
    kept, outputs, labels = [], None, None  # may peak lower than it
    for k, n in enumerate(chunks):
        if not every_chunk and 2 <= k < len(chunks) - 1 and k != whole:  # as the one before: its log-probs left
            kept.append(sliced(g, made(g, (n, T - 1), "masked_scatter"), (n, C)))
            continue
        chunk_ids, chunk_mask = g.view(ids, (n, T)), g.view(mask, (n, T))  # input_ids[start:end], its mask
        with g.scoped("scoring"):
            labels = completion_labels(g, chunk_ids, chunk_mask)  # the last chunk's freed as it is rebound
            prompt_masked(g, m)
        result = model_call(g, m, chunk_ids, labels, causal_lm)
        outputs = result
        del result
        kept.append(sliced(g, outputs.log_probs, (n, C)))  # outputs.log_probs[:, -logits_to_keep:]
    with g.scoped("scoring"):
        logps = aten.cat(g, kept, 0)
    del kept, outputs, labels
    return logps


def after_old(g: Graph, m: HFModel, old: Tensor, held: list[Tensor]) -> list[Tensor]:
    """What follows the policy's pass and lives through the reference's: RLOO's old_logps = (old *
    completion_mask).sum(1) (rows,) fp32; GRPO's importance-sampling ratio under vLLM (sequence_mask): the difference
    to the sampling log-probs times the mask, nan_to_num'd (rows, C), its row sums (rows, 1), their exp masked where
    outside the clip (the bool mask and the ratio kept)."""
    rows, C = old.shape
    if m.cfg.stack.rl == "rloo":
        product = made(g, (rows, C), "mul", old)
        return [made(g, (rows,), "sum", product)]
    if not m.cfg.stack.online.vllm:
        return []
    diff = made(g, (rows, C), "sub", old)
    product = made(g, (rows, C), "mul", diff)
    del diff
    per_token = made(g, (rows, C), "nan_to_num", product)
    del product
    per_sequence = made(g, (rows, 1), "sum", per_token)
    ratio = made(g, (rows, 1), "exp", per_sequence)
    below, above = made(g, (rows, 1), "lt", ratio, dtype="bool"), made(g, (rows, 1), "gt", ratio, dtype="bool")
    invalid = made(g, (rows, 1), "bitwise_or", below, above, dtype="bool")
    del below, above
    masked = made(g, (rows, 1), "masked_fill", ratio, invalid)
    del ratio
    return [per_token, per_sequence, invalid, masked]
