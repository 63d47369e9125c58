"""Transformers' generate as TRL 1.16's GRPOTrainer and RLOOTrainer call it without vLLM, op by op in bytes on
memcalc.exact.sim.graph: generation/utils.py GenerationMixin.generate and _sample (transformers 5.25), the Llama
family's decoder (memcalc.exact.hf.llama) on a DynamicCache (verify/trl_generate.py runs it).

GRPOTrainer._generate_single_turn with use_vllm False: the prompts padded on the left (one length here: no padding),
then unwrap_model_for_generation (gradient checkpointing off while it runs), torch.no_grad() and model.generate(
input_ids, attention_mask, generation_config): max_new_tokens = max_completion_length, do_sample, GRPOConfig's
temperature 1.0, top_p 1.0, top_k 0 and repetition_penalty 1.0 (no logits processor runs), the model in training mode
(LoRA's dropout on) and in its own dtype (training_step's autocast comes after). One GPU's generation batch
(per_device_train_batch_size x steps_per_generation rows) generates at once, every row to max_new_tokens (none
stopped early: the most it holds). Above the model's state it holds:
  setup    the prompts' ids and mask (B, P) int64, the special tokens, the position ids (B, P) and
           unfinished_sequences (B,), int64
  prefill  the prompts' forward: each layer's keys and values copied into the cache (B x P tokens), one layer's
           temporaries over B x P tokens at a time, the head on the last position only (logits_to_keep 1)
  decode   C - 1 steps of one token: each layer's keys and values concatenated with the new ones (a tensor one
           token longer, then the old one freed), the logits' fp32 copy and its softmax (B, V), the ids and the mask
           one column longer; the last step holds the most (a cache of P + C - 1 tokens)
The phase's peak is the prefill's or the last decode step's; the steps between are replayed by growing the tensors
the loop carries to the last step's lengths (every_step replays them all: tests/test_generate.py holds the two
equal).
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.records import record

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import LiveBytes, Tensor
from .family import HFModel
from .llama import decoder_layer, decoder_layers, rms_norm, rotary_embedding
from .lora import lora_linear


@record(frozen=True)
class Generation:
    """model.generate over one GPU's generation batch (bytes above the model's state; integers)."""

    rows: int  # the generation batch on this GPU
    prompt_len: int
    completion_len: int  # max_new_tokens
    prefill_bytes: int  # the prompts, the cache and the loop's tensors at the prefill's peak
    decode_bytes: int  # ... at the last decode step's (0: one new token, no decode step)
    cache_bytes: int  # the DynamicCache's keys and values after the last token

    @property
    def peak_bytes(self) -> int:
        return max(self.prefill_bytes, self.decode_bytes)

    @property
    def peak_at(self) -> str:
        """"prefill" or "decode": where the peak is."""
        return "decode" if self.decode_bytes > self.prefill_bytes else "prefill"


def not_replayed(cfg: StepConfig) -> str | None:
    """Why generate is not replayed for this job ("" where it is): the Llama family's decoder (Llama, Qwen2, Qwen3,
    Mistral) with SDPA's kernels, no sliding window, no Liger (its patched modules run in generate too)."""
    from .model import arch_for

    if not alike(cfg):
        if cfg.shape.sliding_window:
            return "the policy's own generate with a sliding window (DynamicSlidingWindowLayer) is not replayed"
        return f"the policy's own generate is replayed on the Llama family's decoder, not {arch_for(cfg.shape)}'s"
    if not cfg.flash:
        return "the policy's own generate is replayed with SDPA's kernels (flash in --tricks), not eager attention"
    if cfg.stack.savers.liger is not None:
        return "the policy's own generate under Liger's patched modules is not replayed"
    return None


def alike(cfg: StepConfig) -> bool:
    """Whether every layer runs the same ops on the same sizes: the Llama family's decoder (Llama, Qwen2, Qwen3,
    Mistral), no sliding window."""
    from .llama import llama_model
    from .model import FAMILIES, arch_for

    return FAMILIES[arch_for(cfg.shape)].decoder is llama_model and not cfg.shape.sliding_window


def generation(cfg: StepConfig, rows: int) -> Generation:
    """generate's peaks for the job's model (cfg: the training step's; its online settings give the completion)
    over `rows` prompts of seq_len - completion_len tokens. Every layer runs the same ops and adds its own keys and
    values to the cache, so each peak is affine in the depth (the last layer's temporaries, or the head's, over every
    layer's cache): replayed at two depths and carried to the model's (tests/test_generate.py holds it to the
    full-depth replay)."""
    L = cfg.shape.n_layers
    if L <= 3:
        return replay(cfg, rows)[0]
    two, three = (replay(replace(cfg, shape=replace(cfg.shape, n_layers=n)), rows)[0] for n in (2, 3))
    out = [a + (L - 2) * (b - a) for a, b in ((two.prefill_bytes, three.prefill_bytes),
                                              (two.decode_bytes, three.decode_bytes),
                                              (two.cache_bytes, three.cache_bytes))]  # fmt: skip
    return Generation(rows, two.prompt_len, two.completion_len, *out)


def replay(cfg: StepConfig, rows: int, every_step: bool = False,
           timeline: bool = False) -> tuple[Generation, LiveBytes]:  # fmt: skip
    """generation's replay, and its LiveBytes (with every allocation and free under timeline)."""
    from .model import build

    why = not_replayed(cfg)
    if why:
        raise InputError(why)
    C = cfg.stack.online.completion_len
    P = cfg.seq_len - C
    tricks = replace(cfg.tricks, recompute="none")  # unwrap_model_for_generation: gradient_checkpointing_disable
    g = Graph(LiveBytes(timeline=[] if timeline else None))
    m = build(g, replace(cfg, tricks=tricks, micro_batch=rows, grad_accum=1))
    m.cache = []  # generate's DynamicCache (_prepare_cache_for_generation): filled by the prefill
    base = g.mem.live_bytes
    g.grad_enabled = False  # torch.no_grad()
    ids = g.empty((rows, P), "int64", "input", kind="input")  # TRL's padded prompts on the device
    mask = g.empty((rows, P), "int64", "input", kind="input")
    loop = setup(g, rows, P)
    g.mem.reset_peak()
    prefill(g, m, loop, ids, mask)  # the caller's ids and mask stay while it runs (TRL's generate_inputs)
    prefill_peak = g.mem.peak_bytes
    decode_peak = 0
    for k in range(1, C):  # the decode steps; all but the last stand for one another
        if not every_step and 1 < k < C - 1:
            continue
        if not every_step and k == C - 1 and C > 3:
            grown(g, m, loop, C - 2 - 1)  # steps 2 .. C - 2, each one token longer
        g.mem.reset_peak()
        decode(g, m, loop)
        decode_peak = max(decode_peak, g.mem.peak_bytes)
    cache = sum(t.storage.nbytes for entry in m.cache for t in entry)
    return Generation(rows, P, C, prefill_peak - base, decode_peak - base if C > 1 else 0, cache), g.mem


class Loop:
    """What _sample carries from step to step: its ids and attention mask (the caller's until the first step makes
    its own), the position ids and the special tokens, unfinished_sequences, the last step's model inputs, next-token
    logits, probabilities and tokens."""

    def __init__(self, special: list[Tensor], position_ids: Tensor, unfinished: Tensor, eos: bool = True,
                 scores: list[Tensor] | None = None):  # fmt: skip
        self.special, self.position_ids, self.unfinished = special, position_ids, unfinished
        self.ids = self.mask = self.inputs = self.logits = self.probs = self.tokens = None
        self.eos = eos  # an end token: EosTokenCriteria, and finished rows' tokens replaced by the pad
        self.scores = scores  # output_scores under a temperature warper (PPO's): each step's warped scores, kept


def setup(g: Graph, B: int, P: int, eos: bool = True, scores: list[Tensor] | None = None) -> Loop:
    """generate before the prefill: _prepare_special_tokens' tensors (bos, eos, pad: (1,) int64 each) and their
    checks, the last column's for a batch of rows; the position ids from the attention mask (cumsum - 1, masked_fill
    where it is 0: (B, P) int64, kept in model_kwargs); the mask's checks (all ones, none negative);
    unfinished_sequences = torch.ones(B) int64. Without an end token (eos False: PPO's, a bool mask) one special
    token, no checks of them, and the mask's .long() copy for the cumsum."""
    special = [made(g, (1,), "lift_fresh", dtype="int64") for _ in range(3 if eos else 1)]
    last_column = ((B,),) if B > 1 else ()  # (ids[:, -1] == pad).any(): the padding side's check, for a batch
    for shape in ((1,), (1,)) + last_column if eos else ():  # isin(eos, pad).any(), (eos < 0).any()
        check = made(g, shape, "check", dtype="bool")
        made(g, (), "any", check, dtype="bool")
        del check
    longs = None if eos else made(g, (B, P), "_to_copy", dtype="int64")  # a bool mask's .long()
    total = made(g, (B, P), "cumsum", dtype="int64")
    del longs
    shifted = made(g, (B, P), "sub", total, dtype="int64")
    del total
    zero = made(g, (B, P), "eq", shifted, dtype="bool")
    position_ids = made(g, (B, P), "masked_fill", shifted, zero, dtype="int64")
    del zero, shifted
    for _ in range(2):  # (mask == 1).all(), (mask < 0).any()
        check = made(g, (B, P), "check", dtype="bool")
        made(g, (), "all", check, dtype="bool")
        del check
    return Loop(special, position_ids, made(g, (B,), "ones", dtype="int64"), eos, scores)


def prefill(g: Graph, m: HFModel, loop: Loop, ids: Tensor, mask: Tensor) -> None:
    """_sample's prefill: prepare_inputs_for_generation (the position ids cloned, dropped as _prefill returns), the
    forward over every prompt token, then the step's sampling and bookkeeping."""
    B, P = ids.shape
    with g.scoped("prefill"):
        positions = made(g, (B, P), "clone", loop.position_ids, dtype="int64")
        logits = forward(g, m, ids, positions)
        del positions
        loop.ids, loop.mask = ids, mask
        sample(g, m, loop, logits)


def decode(g: Graph, m: HFModel, loop: Loop) -> None:
    """One decode step: prepare_inputs_for_generation's clones of the last column of the ids and of the positions
    (the last step's dropped as they are rebound), the forward over one token per row, then sampling."""
    B = loop.ids.shape[0]
    with g.scoped("decode"):
        inputs = made(g, (B, 1), "clone", dtype="int64"), made(g, (B, 1), "clone", dtype="int64")
        loop.inputs = inputs
        del inputs
        m.decoding = True
        logits = forward(g, m, *loop.inputs)
        sample(g, m, loop, logits)


def sample(g: Graph, m: HFModel, loop: Loop, logits: Tensor) -> None:
    """After the forward: _update_model_kwargs_for_generation (the mask one column longer), next_token_logits =
    logits[:, -1, :].to(float32, copy=True), softmax, multinomial, the finished rows' tokens replaced by the pad
    (tokens * unfinished + pad * (1 - unfinished)), the ids one column longer, the stopping criteria
    (MaxLengthCriteria, EosTokenCriteria: (B,) bools) and unfinished_sequences & ~is_done; then `del outputs`."""
    B, T = loop.ids.shape
    V = logits.shape[-1]
    position = made(g, (1,), "arange", dtype="int64")
    first = made(g, (B,), "add", dtype="int64")
    del position
    second = made(g, (B,), "add", dtype="int64")
    del first
    loop.mask = made(g, (B, T + 1), "cat", loop.mask, dtype="int64")
    del second
    loop.logits = made(g, (B, V), "_to_copy", logits)
    scores = loop.logits
    if loop.scores is not None:  # TemperatureLogitsWarper: scores / temperature, kept by output_scores
        scores = made(g, (B, V), "div", loop.logits)
        loop.scores.append(scores)
    loop.probs = made(g, (B, V), "_softmax", scores)
    del scores
    drawn = made(g, (B,), "multinomial", loop.probs, dtype="int64")
    if loop.eos:  # finished rows' tokens replaced by the pad
        loop.tokens = None
        kept = made(g, (B,), "mul", drawn, dtype="int64")
        finished = made(g, (B,), "rsub", dtype="int64")
        padded = made(g, (B,), "mul", finished, dtype="int64")
        del finished
        loop.tokens = made(g, (B,), "add", kept, padded, dtype="int64")
        del kept, padded
    else:
        loop.tokens = drawn
    del drawn
    loop.ids = made(g, (B, T + 1), "cat", loop.ids, dtype="int64")
    longest, eos = made(g, (B,), "full", dtype="bool"), made(g, (B,), "full", dtype="bool")
    done = made(g, (B,), "bitwise_or", longest, eos, dtype="bool")
    del longest, eos
    if loop.eos:  # EosTokenCriteria
        found = made(g, (B,), "isin", dtype="bool")
        seen = made(g, (B,), "any", found, dtype="bool")
        del found
        done = made(g, (B,), "bitwise_or", done, seen, dtype="bool")
        del seen
    not_done = made(g, (B,), "bitwise_not", done, dtype="bool")
    del done
    unfinished = made(g, (B,), "bitwise_and", loop.unfinished, not_done, dtype="int64")
    del not_done
    loop.unfinished = unfinished
    del unfinished
    most = made(g, (), "max", loop.unfinished, dtype="int64")
    made(g, (), "eq", most, dtype="bool")
    del most


def forward(g: Graph, m: HFModel, ids: Tensor, positions: Tensor) -> Tensor:
    """LlamaForCausalLM.forward(input_ids, position_ids, past_key_values, use_cache, logits_to_keep=1): the
    embedding, the rotary tables over every row's positions (memcalc.exact.hf.llama.rotary_embedding), the layers
    (each updating the cache), the final norm, the head on the last position (a view of it: no copy; a tied head
    is the embedding table); the model's locals dropped as it returns."""
    B, T = ids.shape
    table = m.p["model.embed_tokens.weight"]
    with g.scoped("embedding"):
        inputs_embeds = aten.embedding(g, table, ids)
    with g.scoped("rope tables"):
        cos, sin = rotary_embedding(g, m, positions, T, inputs_embeds.dtype)
    hidden_states = decoder_layers(g, m, decoder_layer, inputs_embeds, None, cos, sin, ())
    hidden_states = rms_norm(g, hidden_states, m.p["model.norm.weight"], "final norm")
    del inputs_embeds, cos, sin
    last = g.view(hidden_states, (B, 1, hidden_states.shape[-1]))  # hidden_states[:, -1:, :]
    with g.scoped("logits"):
        if "lm_head.lora_A.weight" in m.p:  # LoRA on the head (target_modules lm_head)
            logits = lora_linear(g, m, "lm_head", last)
        else:
            logits = aten.linear(g, last, m.p.get("lm_head.weight") or table, None, "logits")
    del last, hidden_states
    return logits


def grown(g: Graph, m: HFModel, loop: Loop, tokens: int) -> None:
    """The decode steps between the first and the last, whose tensors the loop carries are the same but `tokens`
    shorter: each layer's keys and values, the ids and the mask, each freed and made `tokens` longer; the warped
    scores each of those steps keeps (output_scores)."""
    if loop.scores is not None:
        B, V = loop.scores[-1].shape
        loop.scores += [made(g, (B, V), "div") for _ in range(tokens)]
    for i, entry in enumerate(m.cache):
        shapes = [t.shape[:2] + (t.shape[2] + tokens,) + t.shape[3:] for t in entry]
        dtype, m.cache[i] = entry[0].dtype, None
        del entry
        m.cache[i] = tuple(g.empty(shape, dtype, "cat") for shape in shapes)
    B, T = loop.ids.shape
    loop.ids = loop.mask = None
    loop.ids = made(g, (B, T + tokens), "cat", dtype="int64")
    loop.mask = made(g, (B, T + tokens), "cat", dtype="int64")
