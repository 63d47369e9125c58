"""One layer's activations on one GPU of a layout, for one micro-batch: a dense layer's by Korthikanti et al.
2022, Table 2, split over tp, sp and cp (layer_activations; Megatron-LM's formula for the megatron engine), a
MoE layer's (moe_layer_activations), and the first stage's activations outside the layers under Megatron-LM
(megatron_inputs). Those kept for backward and those rebuilt in it (LayerActivations)."""

from __future__ import annotations

from functools import lru_cache

from memcalc.model.moe import routed_tokens
from memcalc.model.params import linear_weights
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks, check_layer_uniform
from memcalc.records import record
from memcalc.terms import Term

from .engines import MEGATRON, MEGATRON_MEMORY

KORTHIKANTI_T2 = "Korthikanti et al. 2022, Table 2"


@record(slots=True)
class LayerActivations:
    """One layer, one micro-batch, one GPU: the bytes kept for backward and those rebuilt in it."""

    tricks: Tricks
    tp: int
    sp: bool
    cp: int
    terms: tuple[Term, ...]
    rebuilt: tuple[Term, ...]

    @property
    def per_layer_bytes(self) -> int:
        return sum(t.value for t in self.terms)

    @property
    def rebuilt_bytes(self) -> int:
        return sum(t.value for t in self.rebuilt)


def kept_and_rebuilt(tricks: Tricks, tp: int, sp: bool, cp: int, whole: tuple[Term, ...], scores: Term,
                     layer_input: Term) -> LayerActivations:  # fmt: skip
    """One layer's terms (whole, the attention scores among them) kept for backward or rebuilt in it, by the
    recompute mode: full recompute keeps the layer input and rebuilds the layer, selective rebuilds the
    scores, and FlashAttention never holds the scores."""
    linear = tuple(term for term in whole if term is not scores)
    full_layer = linear if tricks.flash else whole
    if tricks.recompute == "full":
        return LayerActivations(tricks, tp, sp, cp, (layer_input,), full_layer)
    if tricks.recompute == "selective" and not tricks.flash:
        return LayerActivations(tricks, tp, sp, cp, linear, (scores,))
    return LayerActivations(tricks, tp, sp, cp, full_layer, ())


@lru_cache(maxsize=4096)
def layer_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks,
                      tp: int = 1, sp: bool = False, cp: int = 1, engine: str = "none") -> LayerActivations:  # fmt: skip
    """Korthikanti et al. 2022, Table 2, per layer, with the sequence split over cp.

      TP          s·b·h·(10 + 24/t + 5·a·s/(h·t))
      TP+SP       (s·b·h/t)·(34 + 5·a·s/h)
      TP+selective   s·b·h·(10 + 24/t);   TP+SP+selective  34·s·b·h/t
      full recompute 2·s·b·h (the layer input; /t with SP, where the input is sequence-split)
    10·s·b·h are replicated on every TP rank without SP: both LayerNorm inputs (4), the QKV and MLP
    inputs (2 + 2), the two dropout masks (1 + 1). 24·s·b·h split with the heads: Q, K (4), V (2),
    the output-projection input (2), the GeLU input and output (8 + 8). FlashAttention drops the
    5·a·s²·b/t scores as selective recompute does. With t = cp = 1 these are activations.py's terms.

    Megatron-LM's own formula (theoretical_memory_usage.py compute_activation_memory) writes the MLP's
    16·s·b·h as 4·s·b·f, for any MLP width f: s·b·h·(18 + 4·f/h)/t with SP and selective recompute; the
    megatron engine charges that (equal to Table 2 at f = 4h).
    """
    if tricks.recompute == "op" and not tricks.mixed:
        return sac_layer_activations(shape, seq_len, micro_batch, tricks, tp, sp, cp)
    check_layer_uniform(tricks, "the parallel layouts")
    x = 2 if tricks.precision == "fp32" else 1  # fp32 activations double every byte
    s, b, h, a, t = seq_len // cp, micro_batch, shape.hidden, shape.n_heads, tp
    sbh = s * b * h
    rep = t if sp else 1
    sym = "{s}·{b}·{h}" if cp == 1 else "({s}/{c})·{b}·{h}"
    by_t, by_rep = ("/{t}" if t > 1 else ""), ("/{t}" if rep > 1 else "")
    k = "2·" if x == 2 else ""
    where = " (split by SP)" if sp else " (replicated on TP ranks)"
    replicated = Term("norm inputs, QKV and MLP inputs, dropout masks", x * 10 * sbh // rep,
                      f"{k}10·{sym}{by_rep}", KORTHIKANTI_T2 + where)  # fmt: skip
    split = Term("Q, K, V, projection input, GeLU in/out", x * 24 * sbh // t, f"{k}24·{sym}{by_t}", KORTHIKANTI_T2)
    if engine == "megatron":
        sbf = s * b * shape.ffn
        sym_f = "{s}·{b}·{f}" if cp == 1 else "({s}/{c})·{b}·{f}"
        split = Term("Q, K, V, projection input (8·s·b·h), MLP activation in/out (4·s·b·f)",
                     x * (8 * sbh + 4 * sbf) // t, f"{k}(8·{sym} + 4·{sym_f}){by_t}",
                     f"{MEGATRON} {MEGATRON_MEMORY} compute_activation_memory: 18 + 4·f/h")  # fmt: skip
    if tricks.fp8 == "te":
        replicated, split, weights = te_terms(shape, sbh, t, rep, sym, by_t, by_rep, where)
    s_sq = "{s}²" if cp == 1 else "({s}/{c})²"
    scores = Term("attention s×s (softmax, mask, dropout)", x * 5 * a * s * s * b // t,
                  f"{k}5·{{a}}·{s_sq}·{{b}}{by_t}", KORTHIKANTI_T2)  # fmt: skip
    layer_input = Term("layer input (checkpoint)", x * 2 * sbh // rep, f"{k}2·{sym}{by_rep}",
                       "Korthikanti et al. 2022, sec. 5 and Table 2")  # fmt: skip
    if tricks.fp8 == "te":  # the fp8 weight transposes are saved as the layer's forward runs, rebuilt with it
        return kept_and_rebuilt(tricks, tp, sp, cp, (replicated, split, weights, scores), scores, layer_input)
    return kept_and_rebuilt(tricks, tp, sp, cp, (replicated, split, scores), scores, layer_input)


TE_LINEAR = "transformer_engine/pytorch/module/linear.py @ v0.10 _Linear.forward: save_for_backward"


def te_terms(shape: ModelShape, sbh: int, t: int, rep: int, sym: str, by_t: str, by_rep: str,
             where: str) -> tuple[Term, Term, Term]:  # fmt: skip
    """Table 2's terms under fp8:te: each te.Linear saves its input as an e4m3 transpose, one byte an element
    (the QKV and MLP inputs 2 -> 1 of the 10, the projection input 2 -> 1 and the GeLU output, the second MLP
    linear's input, 8 -> 4 of the 24), and the e4m3 transpose of its weight, one byte a weight of the block's
    linears (on this TP rank: 1/t of them), for each micro-batch in flight."""
    h, q, kv, f, m = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn, 3 if shape.gated_mlp else 2
    replicated = Term("norm inputs, QKV and MLP inputs (fp8), dropout masks", 8 * sbh // rep, f"8·{sym}{by_rep}",
                      f"{KORTHIKANTI_T2}{where}; the linears' inputs in fp8: {TE_LINEAR}")  # fmt: skip
    split = Term("Q, K, V, projection input (fp8), GeLU in, GeLU out (fp8)", 19 * sbh // t, f"19·{sym}{by_t}",
                 f"{KORTHIKANTI_T2}; the linears' inputs in fp8: {TE_LINEAR}")  # fmt: skip
    weights = Term("the linears' fp8 weight transposes (weight_t_fp8)", linear_weights(shape) // t,
                   f"({h}·{q} + 2·{h}·{kv} + {q}·{h} + {m}·{h}·{f}) B" + by_t, TE_LINEAR)  # fmt: skip
    return replicated, split, weights


def sac_layer_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, tp: int, sp: bool,
                          cp: int) -> LayerActivations:  # fmt: skip
    """torchtitan's per-op selective AC on one GPU of a layout, which no textbook formula counts: what
    memcalc.exact saves per block on the TP rank's shard (tp_layer.block_terms: SP's norms and dropouts over
    s/t, the all-gathered inputs whole; the matmul and attention outputs SAC keeps), at the CP rank's s/c
    tokens, and what one block's recompute rebuilds during its backward (memcalc.exact's rebuilt bytes)."""
    from memcalc.exact.step import exact_activations  # loaded only when a layout asks for sac
    from memcalc.model.layout import Layout

    from .tp_layer import block_terms, tp_shape

    s = seq_len // cp
    kept = block_terms(shape, s, micro_batch, tricks, Layout(tp=tp, sp=sp))
    rebuilt = exact_activations(tp_shape(shape, tp), s, micro_batch, tricks).rebuilt_bytes
    return LayerActivations(tricks, tp, sp, cp, kept, (Term("one block rebuilt by its recompute (sac)", rebuilt, "",
                                                            "memcalc.exact, torch.utils.checkpoint"),))  # fmt: skip


@lru_cache(maxsize=4096)
def moe_layer_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, tp: int, sp: bool,
                          cp: int, ep: int, etp: int, routing) -> LayerActivations:  # fmt: skip
    """A MoE layer on one GPU of the layout: attention and norms as Korthikanti's Table 2 (the MLP's parts left
    out, latent attention's per-head tensors split by tp), then the MoE block of memcalc.memory.moe on this
    GPU's T = (s/c)·b/t tokens (sequence parallel) and the R tokens its E/ep experts receive (routed_tokens
    over the ep group; etp times as many with expert TP, each expert's MLP 1/etp wide). Keyed by the layout's
    sizes it reads, not the layout: the planner's ZeRO and offload variants share one."""
    from memcalc.memory.moe import latent_attention_term

    x = 2 if tricks.precision == "fp32" else 1
    t, c, h, E, k = tp, cp, shape.hidden, shape.n_experts, shape.experts_per_token
    s, b = seq_len // c, micro_batch
    sbh, rep = s * b * h, t if sp else 1
    if shape.is_mla:  # input and latents replicated, the per-head Q, K, V and projection input split
        mla = latent_attention_term(shape, s, b, x).value
        heads = x * s * b * (4 * shape.n_heads * shape.head_dim + 4 * shape.n_heads * shape.v_dim)
        linear = (mla - heads) // rep + heads // t
    else:  # 11sbh: its input and dropout mask replicated (3), Q, K, V and the projection input split (8)
        linear = x * 3 * sbh // rep + x * 8 * sbh // t
    attention = Term("attention (linear part) and norms", linear + x * 4 * sbh // rep, "", KORTHIKANTI_T2)
    scores = Term("attention s×s (softmax, mask, dropout)", x * 5 * shape.n_heads * s * s * b // t, "", KORTHIKANTI_T2)
    T = s * b // rep  # tokens this GPU routes
    R = routed_tokens(shape, T, routing, ep) * etp  # tokens its experts compute
    w = 2 * x
    per_token = 8 if shape.gated_mlp else 4
    fp32 = 4 * T * h if shape.router_fp32 and x == 1 else 0
    moe = Term("MoE: router, top-k, tokens received, experts, combine, shared experts",
               w * T * h + 4 * T * E + fp32 + 12 * T * k + 8 * T * k + w * R * h + x * per_token * R * shape.routed_ffn
               // etp + w * T * k * h + w * T * k + 8 * T * k + x * 8 * T * shape.shared_ffn // t,
               "", "memcalc.memory.moe on this GPU's tokens (docs/moe.md)")  # fmt: skip
    layer_input = Term("layer input (checkpoint)", x * 2 * sbh // rep, "", "Korthikanti et al. 2022, sec. 5")
    return kept_and_rebuilt(tricks, t, sp, c, (attention, scores, moe), scores, layer_input)


@lru_cache(maxsize=1024)
def megatron_inputs(shape: ModelShape, seq_len: int, micro_batch: int, tp: int, sp: bool, cp: int, held: int,
                    layers: int) -> tuple[Term, ...]:  # fmt: skip
    """The first stage's activations outside the layers, for each micro-batch in flight (held / layers of
    them: p under 1F1B, p·(1 + (p − 1)/(p·v)) interleaved), as Megatron-LM's formula counts them
    (theoretical_memory_usage.py compute_activation_memory): the token ids, int64 (8·s·b; not split over
    TP), and the embedding dropout's mask (s·b·h bytes, split by SP; only with dropout)."""
    s, b = seq_len // cp, micro_batch
    sym = "{s}·{b}" if cp == 1 else "({s}/{c})·{b}"
    source = f"{MEGATRON} {MEGATRON_MEMORY} compute_activation_memory, first stage"
    flight = f"·{held // layers}" if held % layers == 0 else f"·{held}/{layers}"
    out = [Term("token ids (int64), each micro-batch in flight", 8 * s * b * held // layers, f"8·{sym}{flight}",
                source)]  # fmt: skip
    if shape.dropout > 0:
        rep = tp if sp else 1
        by = "/{t}" if rep > 1 else ""
        out.append(Term("embedding dropout mask, each micro-batch in flight", s * b * shape.hidden // rep * held // layers,
                        f"{sym}·{{h}}{by}{flight}", source))  # fmt: skip
    return tuple(out)
