"""Training FLOPs per token, and what recompute adds.

Conventions (all per token, one forward + backward):
  6N            Kaplan et al. 2020, sec. 2.1: 2N forward + 4N backward.
  attention     12·L·H·Q·s for the QKᵀ and attention-over-V matmuls (PaLM, Chowdhery et al. 2022,
                App. B; non-causal: every query against every key). Causal kernels skip half: 6·L·H·Q·s.
  Korthikanti   model FLOPs 72·B·L·s·h²·(1 + s/6h + v/12hL) per iteration (sec. 6.3), with full
                recompute 96·B·L·s·h²·(1 + s/6h + v/16hL). Their 72·L·h² is 6 × a GPT layer's 12h²
                parameters; memcalc uses 6 × the shape's own layer parameters, so GQA and SwiGLU count right.
  MoE           a token goes through the router (h·E), its k routed experts and the shared ones: 6N with
                N the active parameters (Megatron-LM megatron/training/training.py num_floating_point_operations,
                moe_layer_flops); latent attention's QKᵀ runs over d_qk = d_nope + d_rope, its PV over d_v:
                6·L·H·(d_qk + d_v)·s (Megatron's MLA core term, non-causal); each MTP module adds a block,
                its 2h -> h projection and the output head again.
"""

from __future__ import annotations

from memcalc.records import record
from memcalc.terms import Term

from .moe_mla import is_moe_layer, moe_layer_count
from .params import idle_params, latent_attention_params
from .shape import ModelShape
from .tricks import Tricks


@record(slots=True)
class Flops:
    """FLOPs per token of one training step under each named convention."""

    n_params: int
    per_token: int  # 6N
    per_token_full_recompute: int  # 8N: one more forward pass
    attention_per_token: int  # 12·L·H·Q·s, non-causal
    attention_per_token_causal: int  # half of it

    @property
    def recompute_overhead(self) -> float:
        return self.per_token_full_recompute / self.per_token - 1


def attention_flops(shape: ModelShape, seq_len: int) -> int:
    """QKᵀ and attention over V, forward + backward, per token, every query against every key:
    12·L·H·Q·T (PaLM, Chowdhery et al. 2022, App. B), 6·L·H·(d_qk + d_v)·T where the two head dims differ
    (latent attention; MTP modules' blocks counted as layers)."""
    layers = shape.n_layers + shape.mtp_layers
    if shape.is_mla:
        return 6 * layers * shape.n_heads * (shape.head_dim + shape.v_dim) * seq_len
    return 12 * layers * shape.q_dim * seq_len


def attention_weights(shape: ModelShape) -> int:
    """One block's attention matmul weights: W_q, W_k, W_v, W_o, or latent attention's projections."""
    if shape.is_mla:  # its two latent norms do no matmul
        norms = (2 if shape.norm == "layernorm" else 1) * (shape.q_lora_rank + shape.kv_lora_rank)
        return latent_attention_params(shape) - norms
    return 2 * shape.hidden * shape.q_dim + 2 * shape.hidden * shape.kv_dim


def layer_weights(shape: ModelShape) -> int:
    """The matmul weights of one block: W_q, W_k, W_v, W_o and the MLP (norms and biases do no matmul)."""
    mlp = (3 if shape.gated_mlp else 2) * shape.hidden * shape.ffn
    return attention_weights(shape) + mlp


def moe_layer_weights(shape: ModelShape) -> int:
    """The matmul weights one token meets in a MoE block: attention, the router (h·E), its k routed experts
    and the shared ones (Megatron-LM training.py moe_layer_flops)."""
    n = 3 if shape.gated_mlp else 2
    experts = shape.experts_per_token * shape.routed_ffn + shape.shared_ffn
    return attention_weights(shape) + shape.hidden * shape.n_experts + n * shape.hidden * experts


def stack_weights(shape: ModelShape) -> int:
    """Matmul weights one token meets in all blocks and MTP modules (L·W for a dense model)."""
    moe = moe_layer_count(shape)
    dense = layer_weights(shape) * (shape.n_layers - moe) + (moe_layer_weights(shape) * moe if moe else 0)
    if not shape.mtp_layers:
        return dense
    last_is_moe = is_moe_layer(shape, shape.n_layers - 1)
    block = moe_layer_weights(shape) if last_is_moe else layer_weights(shape)
    return dense + shape.mtp_layers * (2 * shape.hidden * shape.hidden + block)  # + each module's projection M


def logits_flops(shape: ModelShape) -> int:
    """The output projection, forward + backward, per token: 6·h·v (tied or not, it is a matmul), once more
    per MTP module."""
    return 6 * shape.hidden * shape.vocab * (1 + shape.mtp_layers)  # Korthikanti et al. 2022, sec. 6.3: v/12hL


def flops(shape: ModelShape, n_params: int, seq_len: int) -> Flops:
    """6N with N the parameters a token goes through: all of a dense model's, the active ones of a MoE."""
    attention = attention_flops(shape, seq_len)
    active = n_params - idle_params(shape)
    return Flops(
        n_params=active,
        per_token=6 * active,  # Kaplan et al. 2020: 2N forward + 4N backward
        per_token_full_recompute=8 * active,  # + 2N: the forward pass again
        attention_per_token=attention,
        attention_per_token_causal=attention // 2,
    )


@record(slots=True)
class StepFlops:
    """Model FLOPs (what the algorithm needs) and hardware FLOPs (what the GPU runs) per token."""

    tricks: Tricks
    model_per_token: int
    hardware_per_token: int

    @property
    def recompute_overhead(self) -> float:
        return self.hardware_per_token / self.model_per_token - 1


def model_per_token(shape: ModelShape, seq_len: int) -> int:
    """Model FLOPs per token, with the shape's own matmul weights W per layer, whatever the tricks:

    6·L·W + 12·L·H·Q·s + 6·h·v     (Korthikanti sec. 6.3: 72Lh²(1 + s/6h + v/12hL), W in place of 12h²)

    What the GPU executes on top (recompute, flash's backward QKᵀ) is counted from the kernels:
    memcalc.exact.kernels.step_flops.
    """
    return 6 * stack_weights(shape) + attention_flops(shape, seq_len) + logits_flops(shape)


def textbook_step_flops(shape: ModelShape, seq_len: int, tricks: Tricks) -> StepFlops | None:
    """The textbook's hardware FLOPs per token (verify's textbook column), beside model_per_token:

    full       + 2·L·W + 4·L·H·Q·s        (the layers' forward again: 96Lh²(1 + s/6h + v/16hL))
    ckpt:N     the same for the L // N layers checkpointed
    selective  + 4·L·H·Q·s                (the forward of QKᵀ and attention over V again)
    flash      + 2·L·H·Q·s                (its backward recomputes QKᵀ; Dao et al. 2022 sec. 3.1)
    sac        None: no textbook formula (what it reruns depends on the ops its policy keeps)

    What PyTorch executes is less with recompute (non-reentrant checkpointing stops early):
    memcalc.exact.kernels.step_flops counts it, and every HFU memcalc prints uses that count.
    """
    if tricks.recompute == "op":
        return None
    L = shape.n_layers
    layers, attention = 6 * stack_weights(shape), attention_flops(shape, seq_len)
    model = model_per_token(shape, seq_len)
    hardware = model
    if tricks.flash:
        hardware += attention // 6  # one of the forward's two s² matmuls, in flash's backward
    if tricks.recompute == "full" and tricks.mixed:  # the checkpointed layers' forward again (an average layer's)
        hardware += (layers // 3 + attention // 3) // L * tricks.n_checkpointed(L)
    elif tricks.recompute == "full":  # every layer's (and MTP module's) forward again
        hardware += layers // 3 + attention // 3
    elif tricks.recompute == "selective" and not tricks.flash:
        hardware += attention // 3  # the attention core's forward again; with flash nothing is left to recompute
    return StepFlops(tricks, model, hardware)


def model_flops(shape: ModelShape, seq_len: int, tokens: int) -> tuple[int, int]:
    """Model FLOPs for `tokens` tokens, non-causal and causal (Megatron halves the attention): what
    memcalc.exact, verify and the roofline hold MFU against."""
    model = tokens * model_per_token(shape, seq_len)
    return model, model - tokens * attention_flops(shape, seq_len) // 2


def korthikanti_selective_overhead(shape: ModelShape, seq_len: int) -> float:
    """Selective recompute's cost as Korthikanti et al. 2022 publish it (sec. 6.3, +2.7% for GPT-3).

    Their hardware FLOPs 72BLsh²(1 + s/3h + v/12hL) charge the recomputed attention core at its
    forward + backward cost, 12·L·H·Q·s per token; what the recompute executes is less: QKᵀ again,
    2·L·H·Q·s (memcalc.exact.kernels.step_flops counts it).
    """
    model = model_per_token(shape, seq_len)
    return attention_flops(shape, seq_len) / model


def flop_terms(shape: ModelShape, n_params: int, seq_len: int) -> tuple[Term, ...]:
    """The per-token formulas behind Flops and StepFlops, for --explain."""
    f = flops(shape, n_params, seq_len)
    model = model_per_token(shape, seq_len)
    kaplan, palm, korth = "Kaplan et al. 2020, sec. 2.1", "Chowdhery et al. 2022, App. B", "Korthikanti et al. 2022, sec. 6.3"
    if shape.is_moe or shape.is_mla or shape.mtp_layers:
        return moe_flop_terms(shape, f, model, (kaplan, palm, korth))
    return (
        Term("training FLOPs per token (6N)", f.per_token, "6·{N}", kaplan),
        Term("with full recompute (8N)", f.per_token_full_recompute, "8·{N}", kaplan + " + one more forward"),
        Term("attention matmuls per token, non-causal", f.attention_per_token, "12·{L}·{a}·{d}·{s}", palm),
        Term("attention matmuls per token, causal", f.attention_per_token_causal, "6·{L}·{a}·{d}·{s}", palm + ", halved"),
        Term("model FLOPs per token", model, "6·{L}·{W} + 12·{L}·{a}·{d}·{s} + 6·{h}·{v}", korth),
    )


def moe_flop_terms(shape: ModelShape, f: Flops, model: int, sources: tuple[str, str, str]) -> tuple[Term, ...]:
    """flop_terms for a mixture of experts, latent attention or MTP modules: N the active parameters (those
    of the k routed experts a token goes to, not all E), W_all the matmul weights one token meets."""
    kaplan, palm, korth = sources
    megatron = "Megatron-LM training.py num_floating_point_operations"
    attention = "6·{L_a}·{a}·({d_qk} + {d_v})·{s}" if shape.is_mla else "12·{L_a}·{a}·{d}·{s}"
    head = "6·{h}·{v}·(1 + {mtp})" if shape.mtp_layers else "6·{h}·{v}"
    return (
        Term("training FLOPs per token (6N, N active)", f.per_token, "6·{N_act}", kaplan + "; " + megatron),
        Term("with full recompute (8N)", f.per_token_full_recompute, "8·{N_act}", kaplan + " + one more forward"),
        Term("attention matmuls per token, non-causal", f.attention_per_token, attention, palm + "; " + megatron),
        Term("attention matmuls per token, causal", f.attention_per_token_causal, attention.replace("6·", "3·", 1)
             if shape.is_mla else "6·{L_a}·{a}·{d}·{s}", palm + ", halved"),
        Term("model FLOPs per token", model, "6·{W_all} + " + attention + " + " + head, korth + "; " + megatron),
    )  # fmt: skip
