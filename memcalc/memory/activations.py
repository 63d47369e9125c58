"""Textbook activation memory: Korthikanti et al. 2022 (arXiv 2205.05198), sec. 4.1.

Per layer, with 16-bit activations and 1-byte dropout masks, bytes saved for backward:
  attention  11·s·b·h + 5·a·s²·b   (QKV input 2sbh, Q and K 4sbh, softmax output 2as²b,
                                    its dropout mask as²b, dropout output 2as²b, V 2sbh,
                                    output-projection input 2sbh, output dropout mask sbh)
  MLP        19·s·b·h              (input 2sbh, GeLU input 8sbh, GeLU output 8sbh, mask sbh)
  LayerNorms  4·s·b·h              (the input of each of the two, 2sbh each)
  total s·b·h·(34 + 5·a·s/h)       (eq. 1)
This is the GPT-3 layer (MHA, 4h MLP, dropout). The exact, architecture-aware count for GQA and
SwiGLU models lives in memcalc.exact; these numbers stay the textbook's. Mixture-of-experts layers and
latent attention replace the MLP and the attention's linear part by the terms of memcalc.memory.moe.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.model.moe import BALANCED, Routing
from memcalc.model.moe_mla import is_moe_layer
from memcalc.model.params import linear_weights
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.records import record
from memcalc.terms import Term

from .moe import latent_attention_term, moe_terms, mtp_terms

KORTHIKANTI = "Korthikanti et al. 2022, sec. 4.1"


@record(slots=True)
class LayerGroup:
    """Layers that keep the same tensors: a model's dense layers, its MoE layers, its MTP modules."""

    name: str
    count: int
    terms: tuple[Term, ...]  # kept per layer until backward
    rebuilt: tuple[Term, ...]  # what one of them rebuilds during backward

    @property
    def kept_bytes(self) -> int:  # sum of a list, not of a generator: faster for a few terms, every estimate
        return sum([t.value for t in self.terms])

    @property
    def rebuilt_bytes(self) -> int:
        return sum([t.value for t in self.rebuilt])


@record(slots=True)
class Activations:
    """Activation memory of one trick set: per-layer terms, all layers, and the backward peak."""

    tricks: Tricks
    n_layers: int
    terms: tuple[Term, ...]  # bytes kept per layer until backward (ckpt:N: per layer not checkpointed; with
    # groups: the heaviest kind of layer's)
    rebuilt: tuple[Term, ...]  # bytes one layer rebuilds during backward (recompute)
    checkpointed: tuple[Term, ...] = ()  # ckpt:N: what each checkpointed layer keeps (its input)
    n_checkpointed: int = 0  # ckpt:N: how many layers keep `checkpointed` instead of `terms`
    formula: bool = True  # False: the textbook has no formula for this trick set (sac); no bytes here
    groups: tuple[LayerGroup, ...] = ()  # layers of different kinds (MoE models); empty: n_layers alike

    @property
    def per_layer_bytes(self) -> int:
        return sum([t.value for t in self.terms])

    @property
    def checkpointed_bytes(self) -> int:
        return sum([t.value for t in self.checkpointed])

    @property
    def total_bytes(self) -> int:
        if self.groups:
            return sum(g.count * g.kept_bytes for g in self.groups)
        plain = self.n_layers - self.n_checkpointed
        return self.per_layer_bytes * plain + self.checkpointed_bytes * self.n_checkpointed

    @property
    def rebuilt_bytes(self) -> int:
        if self.groups:  # one layer is rebuilt at a time: the largest
            return max(g.rebuilt_bytes for g in self.groups)
        return sum([t.value for t in self.rebuilt])

    @property
    def peak_bytes(self) -> int:
        """All layers' kept bytes plus one layer rebuilt while its backward runs."""
        return self.total_bytes + self.rebuilt_bytes


def layer_terms(shape: ModelShape, seq_len: int, micro_batch: int, factor: int) -> dict[str, Term]:
    """Korthikanti's per-layer terms; factor 2 doubles every byte for fp32 activations."""
    s, b, h, a = seq_len, micro_batch, shape.hidden, shape.n_heads
    sbh = s * b * h
    x = "2·" if factor == 2 else ""
    return {
        "attention": Term("attention (linear part)", factor * 11 * sbh, x + "11·{s}·{b}·{h}", KORTHIKANTI),
        "scores": Term("attention s×s (softmax, mask, dropout)", factor * 5 * a * s * s * b,
                       x + "5·{a}·{s}²·{b}", KORTHIKANTI),  # fmt: skip
        "mlp": Term("MLP", factor * 19 * sbh, x + "19·{s}·{b}·{h}", KORTHIKANTI),
        "norms": Term("LayerNorms", factor * 4 * sbh, x + "4·{s}·{b}·{h}", KORTHIKANTI),
        "input": Term("layer input (checkpoint)", factor * 2 * sbh, x + "2·{s}·{b}·{h}",
                      "Korthikanti et al. 2022, sec. 5 (full recompute keeps 2sbh)"),  # fmt: skip
    }


def textbook_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks,
                         routing: Routing = BALANCED, layer: dict[str, Term] | None = None) -> Activations:  # fmt: skip
    """What one trick set keeps per layer, and what backward rebuilds (layer: layer_terms of this shape,
    seq_len, micro_batch and the trick set's activation width, where the caller has them already).

    flash: the s×s part is never stored (Dao et al. 2022), leaving 34·s·b·h.
    selective: the s×s part is recomputed in backward (Korthikanti sec. 5), also 34·s·b·h kept.
    ckpt: only each layer's input, 2·s·b·h; backward rebuilds one whole layer at a time.
    ckpt:N: L // N layers keep their input (ckpt), the others everything (none): the textbook has no
    row for it, but each kind of layer is one of its rows.
    sac (per-op selective checkpointing): no textbook formula; Korthikanti et al. have no row for it
    (what it keeps depends on which ops a policy names: memcalc.exact replays it).
    """
    if tricks.recompute == "op":
        return Activations(tricks, shape.n_layers, (), (), formula=False)
    t = layer or layer_terms(shape, seq_len, micro_batch, 2 if tricks.precision == "fp32" else 1)
    if shape.is_moe or shape.is_mla or shape.mtp_layers:
        return grouped_activations(shape, seq_len, micro_batch, tricks, routing, t)
    mlp = (t["mlp"],)
    if tricks.fp8 == "te":
        t, mlp = te_layer_terms(shape, seq_len * micro_batch * shape.hidden, t)
    if tricks.mixed:
        n = tricks.n_checkpointed(shape.n_layers)
        (kept, _), (ckpt, rebuilt) = kept_and_rebuilt(t, plain_layer(tricks), mlp), kept_and_rebuilt(
            t, every_layer(tricks), mlp)  # fmt: skip
        return Activations(tricks, shape.n_layers, kept, rebuilt if n else (), ckpt, n)
    kept, rebuilt = kept_and_rebuilt(t, tricks, mlp)
    return Activations(tricks, shape.n_layers, kept, rebuilt)


TE_SAVED = "transformer_engine/pytorch/module/linear.py @ v0.10 _Linear.forward: save_for_backward"


def te_layer_terms(shape: ModelShape, sbh: int, t: dict[str, Term]) -> tuple[dict[str, Term], tuple[Term, ...]]:
    """Korthikanti's terms under fp8:te: each te.Linear keeps its input as an fp8 transpose, one byte an element
    (attention 11 -> 9: the QKV and projection inputs; MLP 19 -> 14: its input and the GeLU output), and the fp8
    transpose of its weight, one byte a weight of the layer's linears (the MLP part carries both)."""
    attention = Term("attention (linear part; QKV, projection inputs in fp8)", 9 * sbh, "9·{s}·{b}·{h}",
                     f"{KORTHIKANTI}; {TE_SAVED}")  # fmt: skip
    mlp = Term("MLP (its input, GeLU output in fp8)", 14 * sbh, "14·{s}·{b}·{h}", f"{KORTHIKANTI}; {TE_SAVED}")
    weights = Term("the linears' fp8 weight transposes (weight_t_fp8)", linear_weights(shape), "", TE_SAVED)
    return {**t, "attention": attention, "mlp": mlp}, (mlp, weights)


def plain_layer(tricks: Tricks) -> Tricks:
    """ckpt:N's layers not checkpointed: they keep what a step without recompute keeps."""
    return replace(tricks, recompute="none", ckpt_every=1)


def every_layer(tricks: Tricks) -> Tricks:
    """ckpt:N's checkpointed layers: they keep what ckpt keeps."""
    return replace(tricks, ckpt_every=1)


def kept_and_rebuilt(t: dict[str, Term], tricks: Tricks, mlp: tuple[Term, ...]) -> tuple[tuple, tuple]:
    """A layer's kept and rebuilt terms under the trick set (ckpt, not ckpt:N), its MLP part given."""
    linear = (t["attention"], *mlp, t["norms"])
    full_layer = linear if tricks.flash else (t["attention"], t["scores"], *mlp, t["norms"])
    if tricks.recompute == "full":
        return (t["input"],), full_layer
    if tricks.recompute == "selective" and not tricks.flash:
        return linear, (t["scores"],)
    return full_layer, ()


def grouped_activations(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, routing: Routing,
                        t: dict[str, Term]) -> Activations:  # fmt: skip
    """A model whose layers differ (dense and MoE MLPs, MTP modules) or whose attention is latent: one
    LayerGroup per kind of layer (with ckpt:N, its checkpointed layers a group apart); the heaviest
    layer's terms stand for "per layer"."""
    factor = 2 if tricks.precision == "fp32" else 1
    if shape.is_mla:
        t = {**t, "attention": latent_attention_term(shape, seq_len, micro_batch, factor)}
    moe = moe_terms(shape, seq_len, micro_batch, factor, routing) if shape.is_moe else ()
    L = shape.n_layers
    groups = []
    for name, mlp, members in (("dense", (t["mlp"],), [i for i in range(L) if not is_moe_layer(shape, i)]),
                               ("MoE", moe, [i for i in range(L) if is_moe_layer(shape, i)])):  # fmt: skip
        if not tricks.mixed:
            groups += [LayerGroup(name, len(members), *kept_and_rebuilt(t, tricks, mlp))] if members else []
            continue
        n = sum(tricks.checkpointed(i) for i in members)  # ckpt:N: every Nth block, counted over all of them
        if len(members) > n:
            groups.append(LayerGroup(name, len(members) - n, *kept_and_rebuilt(t, plain_layer(tricks), mlp)))
        if n:
            groups.append(LayerGroup(f"{name}, checkpointed", n, *kept_and_rebuilt(t, every_layer(tricks), mlp)))
    layers = list(groups)
    if shape.mtp_layers:  # a module's block is MoE when the last layer is (Megatron's mtp_num_moe_layers)
        last = moe if is_moe_layer(shape, L - 1) else (t["mlp"],)
        kept, rebuilt = kept_and_rebuilt(t, every_layer(tricks), last + mtp_terms(shape, seq_len, micro_batch, factor))
        groups.append(LayerGroup("MTP module", shape.mtp_layers, kept, rebuilt))
    heaviest = max((g for g in layers if "checkpointed" not in g.name), default=layers[0], key=lambda g: g.kept_bytes)
    n = tricks.n_checkpointed(L) if tricks.mixed else 0  # ckpt:N: each keeps its input, whatever its kind
    return Activations(tricks, L, heaviest.terms, heaviest.rebuilt, (t["input"],) if n else (), n,
                       groups=tuple(groups))  # fmt: skip


@record(slots=True)
class AttentionDetail:
    """The numbers a course shows about the s×s matrix."""

    score_one_head_bytes: int  # one head's s×s scores for the micro-batch, 16-bit
    scores_per_layer_bytes: int  # 5·a·s²·b
    attention_linear_bytes: int  # 11·s·b·h
    layer_bytes: int  # s·b·h·(34 + 5as/h)

    @property
    def scores_share(self) -> float:
        """Fraction of a layer's activations that is the s×s part."""
        return self.scores_per_layer_bytes / self.layer_bytes

    @property
    def attention_share(self) -> float:
        """Fraction of a layer's activations that the attention block keeps."""
        return (self.attention_linear_bytes + self.scores_per_layer_bytes) / self.layer_bytes


def attention_detail(shape: ModelShape, seq_len: int, micro_batch: int) -> AttentionDetail:
    s, b, h, a = seq_len, micro_batch, shape.hidden, shape.n_heads
    return AttentionDetail(
        score_one_head_bytes=2 * s * s * b,  # one (s, s) bf16 matrix per sequence
        scores_per_layer_bytes=5 * a * s * s * b,
        attention_linear_bytes=11 * s * b * h,
        layer_bytes=s * b * h * 34 + 5 * a * s * s * b,
    )


@record(slots=True)
class Logits:
    """The output layer's big tensors, kept out of the per-layer textbook numbers."""

    terms: tuple[Term, ...]

    @property
    def total_bytes(self) -> int:
        return sum([t.value for t in self.terms])


def logits_memory(shape: ModelShape, seq_len: int, micro_batch: int, precision: str) -> Logits:
    """Logits (b·s·v in the activation dtype) and, in mixed precision, their fp32 upcast for the loss; each
    multi-token prediction module makes its own (DeepSeek-V3 report sec. 2.2: the shared head again)."""
    tokens_vocab = seq_len * micro_batch * shape.vocab
    if precision == "fp32":
        terms = (Term("logits (fp32)", 4 * tokens_vocab, "4·{b}·{s}·{v}", "lm_head matmul output"),)
    else:
        terms = (
            Term("logits (16-bit)", 2 * tokens_vocab, "2·{b}·{s}·{v}", "lm_head matmul output"),
            Term("logits fp32 upcast for cross-entropy", 4 * tokens_vocab, "4·{b}·{s}·{v}",
                 "logits.float() before F.cross_entropy"),  # fmt: skip
        )
    if shape.mtp_layers:
        n = shape.mtp_layers
        terms += tuple(Term(f"{t.name}, {n} MTP module{'s' if n > 1 else ''}", n * t.value, f"{n}·{t.formula}",
                            "DeepSeek-V3 report sec. 2.2: each module's own prediction") for t in terms)  # fmt: skip
    return Logits(terms)
