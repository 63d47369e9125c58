"""Exact activation memory and FLOPs: what PyTorch really allocates for memcalc's models.

The textbook (memcalc.memory.activations, Korthikanti et al. 2022) counts a GPT-3 layer's tensors by hand:
16-bit everywhere, 1-byte masks, MHA, a 4h GELU MLP. A Llama/Qwen layer (GQA, SwiGLU, RMSNorm in
fp32, RoPE, no dropout) saves different tensors, and a training step holds more than saved tensors:
logits and their fp32 copy, backward's gradients, the optimizer's temporaries.

memcalc.exact runs verify/'s model and training step in bytes (memcalc.exact.replay.meta on
memcalc.exact.sim.graph): every aten op's outputs, the tensors its autograd node saves, and what its backward allocates, under
autograd's own lifetimes. On the meta device it equals the measurement to the byte (tests/). What
it leaves out is what only a CUDA run has: the caching allocator's 512-byte rounding and reserved
pool, cuBLAS workspaces, kernels' private buffers (flash-attention's backward accumulators), and
the CUDA context. Those belong to the CUDA comparison (verify --device cuda).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import asdict, dataclass, replace

from memcalc.model.flops import model_flops
from memcalc.model.params import n_params
from memcalc.model.shape import ModelShape, check_positions
from memcalc.model.sizes import MAX_BATCH, MAX_SEQ, check_size
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks
from memcalc.terms import Term

from .base.cache import remembered
from .base.config import ITEMSIZE, Phases, StepConfig
from .growth import Growth, as_run, grow, grown_phases, growth, layer_blocks
from .replay.zero import Sharding

SIM = "memcalc.exact.sim.graph: verify/'s step replayed in bytes"


class Sym(int):
    """An int that remembers which size it is, so a saved tensor's shape prints as a formula."""

    name: str

    def __new__(cls, value: int, name: str) -> Sym:
        obj = super().__new__(cls, value)
        obj.name = name
        return obj

    def __reduce__(self):
        return (Sym, (int(self), self.name))

    def __mul__(self, other):
        if not isinstance(other, int):  # a fraction (rotary_fraction): a plain product, no symbol
            return int(self) * other
        return Sym(int(self) * int(other), f"{self.name}·{_name(other)}")

    def __rmul__(self, other):
        if not isinstance(other, int):
            return other * int(self)
        return self if int(other) == 1 else Sym(int(other) * int(self), f"{_name(other)}·{self.name}")

    def __floordiv__(self, other):
        return Sym(int(self) // int(other), f"{self.name}/{_name(other)}")

    def __add__(self, other):
        return Sym(int(self) + int(other), f"({self.name}+{_name(other)})")

    __radd__ = __add__


def _name(x) -> str:
    return x.name if isinstance(x, Sym) else str(int(x))


def formula(shape: tuple, itemsize: int, times: int = 1) -> str:
    """'2·{b}·{s}·{h}' from a shape of Syms: sizes of 1 dropped, repeats as powers."""
    factors: list[str] = []
    coeff = itemsize * times
    for dim in shape:
        for part in _name(dim).split("·"):
            if part.isdigit():
                coeff *= int(part)
            else:
                factors.append(part)
    counts = Counter(factors)
    seen = list(dict.fromkeys(factors))
    parts = [f"{{{f}}}" + ("²" if counts[f] == 2 else f"^{counts[f]}" if counts[f] > 2 else "") for f in seen]
    return "·".join([str(coeff)] + parts) if parts else str(coeff)


def symbols(shape: ModelShape, seq_len: int, micro_batch: int) -> dict[str, int]:
    """The values behind the symbols of exact terms' formulas."""
    return {"b": micro_batch, "s": seq_len, "h": shape.hidden, "a": shape.n_heads, "k": shape.n_kv_heads,
            "d": shape.head_dim, "f": shape.ffn, "v": shape.vocab, "L": shape.n_layers}  # fmt: skip


def config(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
           stack: Stack = DEFAULT_STACK, optimizer: str = "adamw", device: str = "cuda",
           watched: bool = False) -> StepConfig:  # fmt: skip
    """The simulated step, its sizes carrying their symbols (device: cuda, or cpu for CPU tensors' kernels; watched:
    as verify's dispatch mode measures it, StepConfig.watched)."""
    named = replace(shape, hidden=Sym(shape.hidden, "h"), n_heads=Sym(shape.n_heads, "a"),
                    n_kv_heads=Sym(shape.n_kv_heads, "k"), head_dim=Sym(shape.head_dim, "d"),
                    ffn=Sym(shape.ffn, "f"), vocab=Sym(shape.vocab, "v"))  # fmt: skip
    return StepConfig(named, Sym(seq_len, "s"), Sym(micro_batch, "b"), tricks, stack, optimizer, grad_accum, device,
                      watched)  # fmt: skip


@dataclass(frozen=True)
class ExactActivations:
    """Bytes saved for backward, op by op; drop-in beside memcalc.memory.activations.Activations."""

    tricks: Tricks
    n_layers: int
    terms: tuple[Term, ...]  # saved per layer, one term per (part, op, tensor); with ckpt:N per plain layer
    outside: tuple[Term, ...]  # saved once: embeddings, RoPE tables, final norm, logits, loss
    rebuilt_bytes: int  # what one recomputed region brings back during backward (0 without recompute)
    checkpointed: tuple[Term, ...] = ()  # ckpt:N: what each checkpointed layer saves (its input)
    n_checkpointed: int = 0  # ckpt:N: how many layers past first_blocks save `checkpointed` instead of `terms`
    first_blocks: int = 0  # blocks whose saved bytes are in outside: dense blocks before MoE ones (see Growth)

    @property
    def per_layer_bytes(self) -> int:
        """Saved by one layer; with ckpt:N by one layer that is not checkpointed."""
        return sum(t.value for t in self.terms)

    @property
    def checkpointed_bytes(self) -> int:
        """ckpt:N: saved by one checkpointed layer."""
        return sum(t.value for t in self.checkpointed)

    @property
    def outside_bytes(self) -> int:
        return sum(t.value for t in self.outside)

    @property
    def total_bytes(self) -> int:
        plain = self.n_layers - self.first_blocks - self.n_checkpointed
        return self.per_layer_bytes * plain + self.checkpointed_bytes * self.n_checkpointed + self.outside_bytes

    @property
    def peak_bytes(self) -> int:
        """All saved bytes plus one region rebuilt (the textbook's peak, counted exactly)."""
        return self.total_bytes + self.rebuilt_bytes


@dataclass(frozen=True)
class ExactFlops:
    """FLOPs of one micro-batch's forward and backward.

    counted        what torch.utils.flop_counter.FlopCounterMode counts: matmuls only (2·m·k·n), the
                   attention non-causal, recompute included, flash backward as five matmuls
    counted_causal the same with every attention matmul halved: what a causal kernel executes
    model          6·(matmul weights)·tokens + 12·L·a·d·s·tokens: no recompute, non-causal (PaLM App. B)
    model_causal   the same, attention halved (Megatron's convention)
    """

    tokens: int
    terms: tuple[Term, ...]  # counted, by phase and kind
    counted: int
    counted_causal: int
    model: int
    model_causal: int


@dataclass(frozen=True)
class ExactStep:
    """Activations, the whole training step's memory, and FLOPs, for one model, setup and trick set."""

    tricks: Tricks
    seq_len: int
    micro_batch: int
    grad_accum: int
    n_params: int  # of the shape as built (the step's model state is charged for these)
    activations: ExactActivations
    phases: Phases  # weights, state, retained, and the forward, backward and optimizer peaks
    flops: ExactFlops
    note: str  # what the step assumes

    @property
    def peak_bytes(self) -> int:
        """The whole step's peak: model state, activations, backward and optimizer transients."""
        return self.phases.step_peak_bytes


def term_key(t) -> tuple:
    return (t.scope, t.op, t.what, t.dtype, t.nbytes, formula(t.shape, ITEMSIZE[t.dtype]))


def to_terms(saved) -> tuple[Term, ...]:
    """SavedTerms grouped by (part, op, tensor, size), summed; each term names the op that saves it."""
    groups: dict[tuple, list] = {}
    for t in saved:
        groups.setdefault(term_key(t), []).append(t)
    out = []
    for (scope, op, what, dtype, nbytes, _), ts in groups.items():
        n = sum(t.copies for t in ts)  # a saved tensor of equal experts stands for each (SavedTerm.copies)
        form = formula(ts[0].shape, ITEMSIZE[dtype], n)
        numel = 1
        for d in ts[0].shape:
            numel *= int(d)
        if numel * ITEMSIZE[dtype] != nbytes:  # a view of a larger storage: no tidy formula
            form = str(nbytes * n)
        source = "torch.utils.checkpoint keeps its input" if op == "checkpoint" else f"aten.{op} saves {what}"
        name = f"{scope}: {op} saves {what} ({dtype})"
        if what.endswith("kept by selective checkpointing"):  # memcalc.exact.sim.checkpoint.Checkpointing.outputs
            source = f"torch.utils.checkpoint's selective cache keeps aten.{op}'s outputs (torchtitan's policy)"
            name = f"{scope}: {op} {what} ({dtype})"
        out.append(Term(name, nbytes * n, form, source))
    return tuple(out)


def split_layers(saved, like_first: int = 1) -> tuple[list, list]:
    """One layer's saved tensors (layer like_first's, a later layer like the first: the first also saves
    what all layers share, like the RoPE tables) and those saved once outside the layers."""
    if like_first < 1:
        raise ValueError("split_layers needs a later layer like the first")
    layer = [t for t in saved if t.layer == like_first]
    first = Counter(term_key(t) for t in saved if t.layer == 0)
    first.subtract(Counter(term_key(t) for t in layer))
    extra, outside = [], [t for t in saved if t.layer is None]
    for t in saved:
        if t.layer == 0 and first[term_key(t)] > 0:
            first[term_key(t)] -= 1
            extra.append(t)
    return layer, extra + outside


def flop_terms(flops: dict) -> tuple[Term, ...]:
    """FlopCounterMode's count by phase (forward, backward, recompute) and kind of matmul."""
    names = {"linear": "layer matmuls", "logits": "lm head matmul", "attention": "attention matmuls",
             "score": "value head matmul"}  # score: PPO's value model (memcalc.exact.hf.ppo)
    return tuple(Term(f"{phase}: {names[kind]}", n, "", "FlopCounterMode's count, replayed by " + SIM)
                 for (phase, kind), n in sorted(flops.items()))  # fmt: skip


@functools.lru_cache(maxsize=256)
def exact_step(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
               stack: Stack = DEFAULT_STACK, optimizer: str = "adamw", device: str = "cuda",
               watched: bool = False) -> ExactStep:  # fmt: skip
    """Simulate verify's step on one GPU: the model as the stack builds it, trained as it trains it (device
    cpu: as CPU tensors run it, for verify's CPU stand-in; watched: as verify's dispatch mode sees it on meta or
    CPU tensors, StepConfig.watched).

    Two short steps are simulated and grown to the depth (Growth, grown_phases): a unit is one block,
    or with ckpt:N a group of N (N − 1 plain and one checkpointed), plus the blocks left over (L mod N,
    plain) in both; the lead units, which may differ from the rest (the first: Transformers builds its
    masks there; or as many as hold the dense blocks before MoE ones), are in both, one unit more
    after them in the shorter, two in the longer. Every unit after the lead runs the same ops, so the
    saved tensors per layer are those of such a block, and counts are affine in the units. Equal to the
    full-depth replay, and to the meta measurement, byte for byte (tests/test_exact_depth.py,
    tests/test_verify_meta.py, tests/test_checkpoint_policies.py, tests/test_moe_verify.py); its cost does
    not grow with the depth."""
    check_size("seq", seq_len, limit=MAX_SEQ)
    check_size("micro-batch", micro_batch, limit=MAX_BATCH)
    check_size("grad-accum", grad_accum, limit=MAX_BATCH)
    check_positions(shape, seq_len)

    from .replay.meta import simulate  # here, not at import: a cached verdict never simulates (base.cache)
    from .train.recipes import recipe_note

    L, run = shape.n_layers, as_run(tricks, shape.n_layers)
    grown = growth(tricks, shape, first=stack.finetune.lead_blocks)

    def at(layers: int):
        cfg = config(replace(shape, n_layers=layers), seq_len, micro_batch, run, grad_accum, stack, optimizer, device,
                     watched)  # fmt: skip
        return simulate(cfg, warm_up=False)

    if grown is None:  # dense and MoE blocks in another pattern: replayed whole, nothing per layer
        phases, g, _ = at(L)
        acts = ExactActivations(tricks, L, (), to_terms(g.saved_terms), g.rebuilt_bytes, first_blocks=L)
        counts = dict(g.flops)
    else:
        phases, acts, counts = grown_step(at, grown, tricks, run)
    tokens = seq_len * micro_batch
    counted = sum(counts.values())
    attention = sum(n for (_, kind), n in counts.items() if kind == "attention")
    model, model_causal = model_flops(shape, seq_len, tokens)
    flops = ExactFlops(tokens, flop_terms(counts), counted, counted - attention // 2, model, model_causal)
    note = recipe_note(config(shape, seq_len, micro_batch, tricks, grad_accum, stack, optimizer)) + "; measured on meta: equal to the byte"
    return ExactStep(tricks, seq_len, micro_batch, grad_accum, n_params(shape), acts, phases, flops, note)


def grown_step(at, grown: Growth, tricks: Tricks, run: Tricks) -> tuple[Phases, ExactActivations, dict]:
    """exact_step's phases, activations and FLOP counts from the short steps (at(depth): simulate's
    phases, graph and memory) grown to the depth, or from the full depth replayed where it is no deeper
    than the shorter step."""
    L, unit = grown.n_layers, grown.unit
    if grown.whole:  # short enough to replay whole (the shorter step's block `unit` still gives one layer)
        phases, g3, _ = at(L)
        g2 = g3 if grown.short == L or grown.dense else at(grown.short)[1]
        counts = dict(g3.flops)
    else:
        (short, g2, m2), (long, g3, m3) = at(grown.short), at(grown.long)
        phases = grown_phases(short, long, m2, m3, grown)
        counts = {key: grow(g2.flops.get(key, 0), g3.flops.get(key, 0), grown) for key in g3.flops}
    if not grown.dense:  # every block alike past the first
        layer, outside = split_layers(g2.saved_terms, unit)  # block `unit`: plain, like the first
        acts = ExactActivations(tricks, L, to_terms(layer), to_terms(outside), g2.rebuilt_bytes)
        if run.mixed:  # ckpt:N: block 2N − 1 is checkpointed
            ckpt = [t for t in g2.saved_terms if t.layer == 2 * unit - 1]
            acts = replace(acts, checkpointed=to_terms(ckpt), n_checkpointed=run.n_checkpointed(L))
        return phases, acts, counts
    # dense blocks before MoE ones: the step of first_blocks blocks is outside; per layer, a MoE block past it
    first = g3 if grown.whole else g2
    plain, ckpt = layer_blocks(grown, run)  # in g3: the longer step, or the whole depth
    layer = [t for t in g3.saved_terms if plain is not None and t.layer == plain]
    kept = [t for t in g3.saved_terms if ckpt is not None and t.layer == ckpt]
    n_ckpt = run.n_checkpointed(L) - run.n_checkpointed(grown.first_blocks) if run.mixed else 0
    acts = ExactActivations(tricks, L, to_terms(layer), to_terms(first.saved_terms), g3.rebuilt_bytes,
                            to_terms(kept), n_ckpt, grown.first_blocks)  # fmt: skip
    return phases, acts, counts


def exact_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks) -> ExactActivations:
    """What one trick set saves for backward, per layer and outside the layers, op by op."""
    return exact_step(shape, seq_len, micro_batch, tricks).activations


def exact_for(model, setup, tricks: Tricks) -> ExactStep:
    """exact_step for a memcalc Model and an estimate Setup (anything with seq_len, micro_batch and
    grad_accum; memcalc.memory.estimate is not imported, so that it may import this module). The shape is
    simulated as built: its own parameter count, not a --params override."""
    return exact_step(model.shape, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack,
                      setup.optimizer)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def step_phases(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                stack: Stack = DEFAULT_STACK, optimizer: str = "adamw", sharding: Sharding | None = None) -> Phases:  # fmt: skip
    """exact_step's phases alone, for the verdict: its sizes plain ints (no formulas), no terms; kept on
    disk between runs (memcalc.exact.base.cache). sharding: one data-parallel rank's step under ZeRO
    (memcalc.exact.replay.zero), grown from short steps as one GPU's is; None for one GPU's."""
    check_size("seq", seq_len, limit=MAX_SEQ)
    check_size("micro-batch", micro_batch, limit=MAX_BATCH)
    check_size("grad-accum", grad_accum, limit=MAX_BATCH)
    check_positions(shape, seq_len)

    if sharding is not None and sharding.trivial:
        sharding = None  # a rank that holds what one GPU holds: one GPU's step, and its cache entry
    tail = 1 if sharding is not None and sharding.zero == 3 else 0  # the last block prefetches the head
    run, grown = as_run(tricks, shape.n_layers), growth(tricks, shape, tail, stack.finetune.lead_blocks)

    def at(layers: int):
        from .replay.meta import simulate  # here, not at import: a cached verdict never simulates

        cfg = StepConfig(replace(shape, n_layers=layers), seq_len, micro_batch, run, stack, optimizer, grad_accum)
        phases, _, mem = simulate(cfg, warm_up=False, sharding=sharding)
        return phases, mem

    def replay() -> dict:
        if grown is None or grown.whole:  # another pattern of blocks, or short enough: the whole depth
            return asdict(at(shape.n_layers)[0])
        (short, m2), (long, m3) = at(grown.short), at(grown.long)
        return asdict(grown_phases(short, long, m2, m3, grown))

    key = (shape, seq_len, micro_batch, tricks, grad_accum, stack, optimizer) + ((sharding,) if sharding else ())
    return Phases(**remembered("phases", key, replay))
