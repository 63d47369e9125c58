"""One block's kernels, traced once: what the roofline times, and the FLOPs a step really executes.

Every block of the stack runs the same kernels, so one block is traced (memcalc.exact.replay.meta.trace) and
the rest is multiplication (tests/test_roofline.py checks it against full-depth traces). With ckpt:N the
blocks are of two kinds: one group of N is traced, its first block (plain) weighted by the blocks not
checkpointed and its last (checkpointed) by those that are (block_weight;
tests/test_checkpoint_policies.py checks it against full-depth traces). A model with dense and MoE blocks
has a kind of each: a dense block then a MoE one is traced, or a group of N of each (traced_blocks;
tests/test_moe_verify.py). The FLOPs the
kernels execute, as torch.utils.flop_counter.FlopCounterMode counts them, are memcalc's one definition
of hardware FLOPs: HFU everywhere, the --mfu time model, the toolbox's cost of checkpointing, `memcalc mfu`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache

from memcalc.errors import InputError
from memcalc.model.finetune import FULL, Finetune
from memcalc.model.flops import StepFlops, model_per_token, textbook_step_flops
from memcalc.model.moe_mla import is_moe_layer, moe_layer_count
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, STACKS, Stack
from memcalc.model.tricks import Tricks

from .base.cache import remembered
from .base.config import StepConfig, not_replayed, shape_not_replayed
from .base.kernel import STEP_PHASES, Kernel

TRACES: dict[tuple, tuple[Kernel, ...]] = {}  # (one-layer shape, seq, micro-batch, tricks) -> kernels
MAX_TRACES = 512


@lru_cache(maxsize=1024)
def traced_blocks(shape: ModelShape, tricks: Tricks = Tricks(),
                  finetune: Finetune = FULL) -> tuple[ModelShape, dict[int, int]]:  # fmt: skip
    """The shape whose step is traced, and how many of the model's blocks each traced block stands for: those
    of its kind (every block of a kind runs the same kernels; routing and RoPE tables are made outside the
    blocks). A kind is a block's MLP, dense or MoE, and with ckpt:N whether it is checkpointed: one block
    is traced when all are alike, a group of N with ckpt:N (its first plain, its last checkpointed), a
    dense block then a MoE one (N of each with ckpt:N) when the model has both."""
    n = tricks.ckpt_every if tricks.mixed else 1
    moe, L = moe_layer_count(shape), shape.n_layers
    if finetune.lead_blocks:  # one block of each fine-tuning kind: frozen, the first trained, the rest
        traced = replace(shape, n_layers=len(set(finetune_kind(finetune, i) for i in range(L))))
        count = Counter(finetune_kind(finetune, i) for i in range(L))
        return traced, {t: count[kind] for kind, t in fine_representatives(finetune, traced.n_layers).items()}
    if not shape.n_experts:
        traced = replace(shape, n_layers=n)
    else:  # the pattern made plain: dense blocks first, then MoE ones
        dense = 0 if moe == L else n if moe else max(n, shape.first_dense_layers)
        traced = replace(shape, n_layers=2 * n if 0 < moe < L else n, first_dense_layers=dense, moe_every=1,
                         moe_offset=0, dense_layers=())  # fmt: skip
    count = Counter(block_kind(shape, tricks, i) for i in range(L))
    return traced, {t: count[kind] for kind, t in representatives(traced, tricks).items()}


def block_kind(shape: ModelShape, tricks: Tricks, i: int) -> tuple[bool, bool]:
    """Block i's kind: whether its MLP is a mixture of experts, whether it runs under checkpoint."""
    return is_moe_layer(shape, i), tricks.checkpointed(i)


def finetune_kind(finetune: Finetune, i: int) -> str:
    """Block i's kind under fine-tuning: frozen, the first trained one whose input needs no gradient (its ops
    save and compute less: memcalc.model.finetune.Finetune.lead_blocks), or plain."""
    if i < finetune.frozen_blocks:
        return "frozen"
    return "first" if i < finetune.lead_blocks else "plain"


def traced_finetune(finetune: Finetune) -> Finetune:
    """The fine-tuning of the traced blocks: one frozen block stands for all of them."""
    return replace(finetune, frozen_blocks=min(finetune.frozen_blocks, 1))


def fine_representatives(finetune: Finetune, traced_layers: int) -> dict[str, int]:
    """The traced block of each fine-tuning kind."""
    first: dict[str, int] = {}
    for t in range(traced_layers):
        first.setdefault(finetune_kind(traced_finetune(finetune), t), t)
    return first


def representatives(traced: ModelShape, tricks: Tricks) -> dict[tuple[bool, bool], int]:
    """The first traced block of each kind."""
    first: dict[tuple[bool, bool], int] = {}
    for t in range(traced.n_layers):
        first.setdefault(block_kind(traced, tricks, t), t)
    return first


def kernels_of(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, stack: Stack = DEFAULT_STACK,
               optimizer: str = "adamw") -> tuple[Kernel, ...]:  # fmt: skip
    """One step's kernels with the model cut to one block (layer 0), or to the blocks traced_blocks keeps
    (with ckpt:N a group of N, layers 0 and N − 1 kept; a dense block and a MoE block); the rest are outside
    the blocks. A step without
    recompute is taken from the same step with recompute when one was traced: it runs exactly those
    kernels less the recompute ones, in the same order (tests/test_roofline.py). The stack's own step
    (its model, autocast's casts, its optimizer's kernels) where the exact model replays it
    (traced_stack), else the reference stack's."""
    one = traced_blocks(shape, tricks, stack.finetune)[0]
    key = (one, seq_len, micro_batch, tricks) + traced_stack(stack, optimizer, tricks, shape)
    if key not in TRACES:
        if len(TRACES) >= MAX_TRACES:
            TRACES.clear()
        TRACES[key] = without_recompute(key) or traced(*key)
    return TRACES[key]


def traced_stack(stack: Stack, optimizer: str, tricks: Tricks, shape: ModelShape) -> tuple:
    """What a trace key adds for a stack: nothing for the reference stack's AdamW (its traces and their
    cache keys as they always were); (its code, optimizer) for a stack the exact model replays, the code a
    Stack of what decides the step (model, recipe, impl, cache, the traced blocks' fine-tuning, TRL's
    release and --rl; not its name or engine); nothing, so the reference stack's step, for one it does not
    (memcalc.exact.base.config)."""
    if (stack.model, stack.recipe, stack.impl, optimizer) == (DEFAULT_STACK.model, DEFAULT_STACK.recipe,
                                                              DEFAULT_STACK.impl, "adamw"):  # fmt: skip
        return ()
    if not_replayed(stack.model, stack.recipe, stack.impl, optimizer, tricks.precision):
        return ()
    reason = shape_not_replayed(shape, stack.model, stack.recipe, stack.impl)
    if reason and tricks.flash and tricks.precision == "fp32":  # no other stack runs SDPA at fp32
        raise InputError(f"fp32,flash (Transformers' sdpa at fp32) is replayed where the hf stack builds the model: "
                         f"{reason}; use fp32 (eager attention) or bf16,flash")  # fmt: skip
    if reason:
        return ()
    code = replace(DEFAULT_STACK, model=stack.model, recipe=stack.recipe, impl=stack.impl, use_cache=stack.use_cache,
                   finetune=traced_finetune(stack.finetune), trl=stack.trl, rl=stack.rl,
                   precompute_ref=stack.precompute_ref,
                   online=stack.online and stack.online.step_key(), ppo=stack.ppo)  # fmt: skip
    return code, optimizer


def block_weight(k: Kernel, n_layers: int, tricks: Tricks, shape: ModelShape | None = None,
                 finetune: Finetune = FULL) -> int:  # fmt: skip
    """How many of the step's n_layers blocks run a traced kernel like k: 1 outside the blocks; every
    block; or with ckpt:N, the traced group's last block's for the n_layers // N checkpointed blocks and
    its first block's for the others (with fewer than N blocks, none is checkpointed); with dense and MoE
    blocks (a shape given), those of its block's kind (traced_blocks)."""
    if k.layer is None:
        return 1
    if finetune.lead_blocks:  # frozen blocks, the first trained, the rest: each kind's count (traced_blocks)
        return traced_blocks(replace(shape, n_layers=n_layers), tricks, finetune)[1].get(k.layer, 0)
    if shape is not None and shape.n_experts:
        full = shape if shape.n_layers == n_layers else replace(shape, n_layers=n_layers)
        return traced_blocks(full, tricks)[1].get(k.layer, 0)
    if not tricks.mixed:
        return n_layers
    checkpointed = tricks.n_checkpointed(n_layers)
    return checkpointed if k.layer == tricks.ckpt_every - 1 else n_layers - checkpointed


def traced(one: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, *stack) -> tuple[Kernel, ...]:
    """memcalc.exact.replay.meta.trace of the one-block step, kept on disk between runs (memcalc.exact.base.cache);
    stack: traced_stack's (code, optimizer), or none for the reference stack's."""

    def trace_fields() -> list:
        from .replay.meta import trace  # here, not at import: a cached trace never simulates

        code, optimizer = stack or (DEFAULT_STACK, "adamw")
        cfg = StepConfig(one, seq_len, micro_batch, tricks, code, optimizer)
        trains_all = code.finetune.trains_all
        kept = (None, *representatives(one, tricks).values()) if trains_all else (None, *range(one.n_layers))
        return merged(k for k in trace(cfg) if k.layer in kept)

    key = (one, seq_len, micro_batch, tricks, *stack)
    return tuple(Kernel(*fields) for fields in remembered("kernels", key, trace_fields))


def merged(kernels) -> list[list]:
    """Each distinct kernel of a block (or outside the blocks) once, in the order first launched, with how
    many times the step launches it: a trace as Kernel's fields, compact on disk and quick to load."""
    rows: dict[tuple, list] = {}
    for k in kernels:
        row = rows.get((k.key(), k.layer))
        if row is None:
            rows[(k.key(), k.layer)] = [*k.key(), k.layer, k.count]
        else:
            row[-1] += k.count
    return list(rows.values())


def recompute_first(trick_sets) -> list:
    """The order to trace trick sets in: those with recompute first, so that the plain ones reuse their
    traces (without_recompute)."""
    return sorted(trick_sets, key=lambda t: t.recompute == "none")


def whole_blocks_keep_the_forward(tricks: Tricks, stack_key: tuple) -> bool:
    """Whether checkpointing whole blocks (full, op) leaves the forward's kernels as they are. Not under
    torch.compile, whose fused kernels then write only a block's output (min-cut partitioning: a checkpointed
    block keeps nothing inside), nor for a model that drops its cache when checkpointed (Transformers'
    use_cache, memcalc.exact.hf.dynamic_cache; the code in a trace key's stack part: traced_stack)."""
    return not tricks.compile and not (stack_key and stack_key[0].use_cache)


def full_twin(shape: ModelShape, tricks: Tricks, stack: Stack = DEFAULT_STACK,
              optimizer: str = "adamw") -> Tricks | None:  # fmt: skip
    """The trick set with full recompute whose trace, traced first, gives the plain step too (without_recompute);
    None where it would not."""
    if tricks.recompute != "none":
        return None
    keeps = whole_blocks_keep_the_forward(tricks, traced_stack(stack, optimizer, tricks, shape))
    return replace(tricks, recompute="full") if keeps else None


def without_recompute(key: tuple) -> tuple[Kernel, ...] | None:
    """A traced step with recompute, its recompute kernels left out; None if none was traced (selective
    recompute's always serves; whole blocks' where they keep the forward's kernels)."""
    one, seq_len, micro_batch, tricks, *stack = key
    if tricks.recompute != "none":
        return None
    whole = ("full",) + (() if tricks.fp8 == "te" else ("op",))  # fp8:te has no sac
    for recompute in ("selective",) + (whole if whole_blocks_keep_the_forward(tricks, tuple(stack)) else ()):
        traced = TRACES.get((one, seq_len, micro_batch, replace(tricks, recompute=recompute), *stack))
        if traced is not None:
            return tuple(k for k in traced if k.phase != "recompute")
    return None


def flops_stack(tricks: Tricks) -> Stack:
    """The stack whose trace counts a trick set's FLOPs: the reference's, but for SDPA at fp32 (fp32,flash),
    which is Transformers' alone (memcalc.model.stacks.check_tricks)."""
    return STACKS["hf"] if tricks.flash and tricks.precision == "fp32" else DEFAULT_STACK


def counted_flops(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks) -> tuple[int, int]:
    """FLOPs of one micro-batch's forward, backward and recompute as FlopCounterMode counts them (matmuls
    only, attention non-causal, flash's backward as five matmuls), and the same with every attention
    matmul halved: what a causal kernel executes."""
    counted = attention = 0
    for k in kernels_of(shape, seq_len, micro_batch, tricks, flops_stack(tricks)):
        if k.phase in STEP_PHASES:
            n = block_weight(k, shape.n_layers, tricks, shape) * k.count
            counted += n * k.counted
            attention += n * k.counted if k.count_kind == "attention" else 0
    return counted, counted - attention // 2


@lru_cache(maxsize=4096)  # the estimate, the toolbox and the planner ask for the same few many times
def step_flops(shape: ModelShape, seq_len: int, tricks: Tricks) -> StepFlops:
    """Model FLOPs per token (memcalc.model.flops: what MFU divides by) and hardware FLOPs per token
    (what the kernels execute, counted). Recompute adds what torch.utils.checkpoint reruns: the block's
    forward up to the last tensor its backward needs (non-reentrant checkpointing stops early there, so
    a Llama block's down projection is not rerun), not Korthikanti's whole extra forward (8N).
    A shape the simulator cannot build yet gets the textbook's count (memcalc.model.flops)."""
    stack = flops_stack(tricks)
    if shape_not_replayed(shape, stack.model, stack.recipe, stack.impl):
        return textbook_step_flops(shape, seq_len, tricks)
    counted, _ = counted_flops(shape, seq_len, 1, tricks)
    return StepFlops(tricks, model_per_token(shape, seq_len), counted // seq_len)  # b·s tokens: exact division
