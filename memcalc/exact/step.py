"""Exact activation memory and FLOPs: what PyTorch really allocates for memcalc's models.

The textbook (memcalc.memory.activations, Korthikanti et al. 2022) counts a GPT-3 layer's tensors by hand:
16-bit everywhere, 1-byte masks, MHA, a 4h GELU MLP. A Llama/Qwen layer (GQA, SwiGLU, RMSNorm in
fp32, RoPE, no dropout) saves different tensors, and a training step holds more than saved tensors:
logits and their fp32 copy, backward's gradients, the optimizer's temporaries.

memcalc.exact runs verify/'s model and training step in bytes (memcalc.exact.mirror on memcalc.exact.sim): every
aten op's outputs, the tensors its autograd node saves, and what its backward allocates, under
autograd's own lifetimes. On the meta device it equals the measurement to the byte (tests/). What
it leaves out is what only a CUDA run has: the caching allocator's 512-byte rounding and reserved
pool, cuBLAS workspaces, kernels' private buffers (flash-attention's backward accumulators), and
the CUDA context. Those belong to the CUDA comparison (verify --device cuda).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, replace

from memcalc.model.flops import model_flops
from memcalc.model.shape import MAX_BATCH, MAX_SEQ, ModelShape, check_positions, check_size, n_params
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.model.tricks import Tricks
from memcalc.terms import Term

from .config import Config
from .mirror import Phases, simulate
from .recipes import SIMULATED
from .sim import ITEMSIZE

SIM = "memcalc.exact.sim: verify/'s step replayed in bytes"


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
        return Sym(int(self) * int(other), f"{self.name}·{_name(other)}")

    def __rmul__(self, other):
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
           stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> Config:  # fmt: skip
    """The simulated step, its sizes carrying their symbols."""
    named = replace(shape, hidden=Sym(shape.hidden, "h"), n_heads=Sym(shape.n_heads, "a"),
                    n_kv_heads=Sym(shape.n_kv_heads, "k"), head_dim=Sym(shape.head_dim, "d"),
                    ffn=Sym(shape.ffn, "f"), vocab=Sym(shape.vocab, "v"))  # fmt: skip
    return Config(named, Sym(seq_len, "s"), Sym(micro_batch, "b"), tricks.precision, tricks.flash, tricks.recompute,
                  grad_accum, optimizer, stack.model, stack.recipe, stack.impl)  # fmt: skip


@dataclass(frozen=True)
class ExactActivations:
    """Bytes saved for backward, op by op; drop-in beside memcalc.memory.activations.Activations."""

    tricks: Tricks
    n_layers: int
    terms: tuple[Term, ...]  # saved per layer, one term per (part, op, tensor)
    outside: tuple[Term, ...]  # saved once: embeddings, RoPE tables, final norm, logits, loss
    rebuilt_bytes: int  # what one recomputed region brings back during backward (0 without recompute)

    @property
    def per_layer_bytes(self) -> int:
        return sum(t.value for t in self.terms)

    @property
    def outside_bytes(self) -> int:
        return sum(t.value for t in self.outside)

    @property
    def total_bytes(self) -> int:
        return self.per_layer_bytes * self.n_layers + self.outside_bytes

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
        form = formula(ts[0].shape, ITEMSIZE[dtype], len(ts))
        numel = 1
        for d in ts[0].shape:
            numel *= int(d)
        if numel * ITEMSIZE[dtype] != nbytes:  # a view of a larger storage: no tidy formula
            form = str(nbytes * len(ts))
        source = "torch.utils.checkpoint keeps its input" if op == "checkpoint" else f"aten.{op} saves {what}"
        out.append(Term(f"{scope}: {op} saves {what} ({dtype})", nbytes * len(ts), form, source))
    return tuple(out)


def split_layers(saved, n_layers: int) -> tuple[list, list]:
    """One layer's saved tensors (the second layer's: the first also saves what all layers share,
    like the RoPE tables) and those saved once outside the layers."""
    if n_layers == 1:
        raise ValueError("split_layers needs two layers")
    layer = [t for t in saved if t.layer == 1]
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
    names = {"linear": "layer matmuls", "logits": "lm head matmul", "attention": "attention matmuls"}
    return tuple(Term(f"{phase}: {names[kind]}", n, "", "FlopCounterMode's count, replayed by " + SIM)
                 for (phase, kind), n in sorted(flops.items()))  # fmt: skip


@functools.lru_cache(maxsize=64)
def exact_step(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
               stack: Stack = DEFAULT_STACK, optimizer: str = "adamw") -> ExactStep:  # fmt: skip
    """Simulate verify's step on one GPU: the model as the stack builds it, trained as it trains it."""
    check_size("seq", seq_len, limit=MAX_SEQ)
    check_size("micro-batch", micro_batch, limit=MAX_BATCH)
    check_size("grad-accum", grad_accum, limit=MAX_BATCH)
    check_positions(shape, seq_len)
    stack, note = replayed_stack(stack, tricks)
    phases, g, _ = simulate(config(shape, seq_len, micro_batch, tricks, grad_accum, stack, optimizer))
    saved = g.saved_terms
    if shape.n_layers == 1:  # split at two layers; the totals come from the real depth
        _, g2, _ = simulate(config(replace(shape, n_layers=2), seq_len, micro_batch, tricks, 1, stack, optimizer))
        layer, outside = split_layers(g2.saved_terms, 2)
    else:
        layer, outside = split_layers(saved, shape.n_layers)
    acts = ExactActivations(tricks, shape.n_layers, to_terms(layer), to_terms(outside), g.rebuilt_bytes)
    tokens = seq_len * micro_batch
    counted = sum(g.flops.values())
    attention = sum(n for (_, kind), n in g.flops.items() if kind == "attention")
    model, model_causal = model_flops(shape, seq_len, tokens)
    flops = ExactFlops(tokens, flop_terms(g.flops), counted, counted - attention // 2, model, model_causal)
    return ExactStep(tricks, seq_len, micro_batch, grad_accum, n_params(shape), acts, phases, flops, note)


def replayed_stack(stack: Stack, tricks: Tricks) -> tuple[Stack, str]:
    """The stack as simulated, and what the step assumes. An optimizer implementation the simulator
    does not replay yet runs as the reference per-tensor AdamW, and the note says so."""
    autocast = stack.recipe == "autocast" and tricks.precision != "fp32"
    if autocast:
        scaler = ", GradScaler" if tricks.precision == "fp16" else ""
        note = (f"torch.autocast over fp32 weights (CUDA's lists; weight casts cached through forward){scaler}; "
                "AdamW per tensor on the fp32 weights")  # fmt: skip
    else:
        note = "AdamW (fp32 m, v) on one GPU, grads converted per tensor"
    if stack.impl not in SIMULATED["impl"]:
        note += f" (the reference step: torch.optim's {stack.impl} is not replayed yet)"
        stack = replace(stack, impl="reference")
    return stack, note + ("; measured on CPU at reduced size" if autocast else "; measured on meta") + \
        ": equal to the byte"


def exact_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks) -> ExactActivations:
    """What one trick set saves for backward, per layer and outside the layers, op by op."""
    return exact_step(shape, seq_len, micro_batch, tricks).activations


def exact_for(model, setup, tricks: Tricks) -> ExactStep:
    """exact_step for a memcalc Model and an estimate Setup (anything with seq_len, micro_batch and
    grad_accum; memcalc.memory.estimate is not imported, so that it may import this module). The shape is
    simulated as built: its own parameter count, not a --params override."""
    return exact_step(model.shape, setup.seq_len, setup.micro_batch, tricks, setup.grad_accum, setup.stack,
                      setup.optimizer)  # fmt: skip
