"""Textbook activation memory of mixture-of-experts layers and multi-head latent attention.

Korthikanti et al. 2022 (sec. 4.1) count, per layer, every tensor a backward needs, at 2 bytes an element
(1 for a dropout mask). Megatron-LM's megatron/training/theoretical_memory_usage.py (commit d98e8a6)
counts MoE and MLA weights (routed and shared experts, the router, MLA's projections, MTP layers) but
keeps the dense activation formula, sbh·(18 + 4·ffn/h), for every layer. Here the same counting rule is
applied to the tensors a MoE layer and latent attention keep (per micro-batch of s·b tokens; fp32 where
the model computes in fp32, 8 bytes per int64 index):

  router          its input 2sbh (shared with the shared experts); the fp32 scores 4·s·b·E that the
                  softmax (Mixtral, Qwen3-MoE: F.softmax(dtype=float)) or sigmoid (DeepSeek-V3) keeps; with
                  DeepSeek-V3's fp32 gate, the fp32 copy of its input 4sbh (modeling_deepseek_v3.py)
  top-k           the chosen experts' indices 8·s·b·k, and their fp32 weights 4·s·b·k
  dispatch        each token copied once per expert it goes to (the permute): 2·R·h, and its index 8·s·b·k
  experts         each expert's MLP on the R tokens routed here: gated (SwiGLU) 8·f_e per token (gate and
                  up outputs, the activation's output, their product), plain 4·f_e
  combine         the expert outputs the routing weights multiply, 2·R·h, the weights 2·R, the index of the
                  scatter-add back to the tokens 8·s·b·k
  shared experts  a gated MLP of f_s on every token: 8·s·b·f_s
  MLA             (DeepSeek-V2, Liu et al. 2024, sec. 2.1) in place of Korthikanti's 11sbh: the input 2sbh,
                  the query latent before and after its norm 4·s·b·r_q, the key-value latent likewise
                  4·s·b·r_kv, the decompressed Q and K 2·2·s·b·a·d_qk, V 2·s·b·a·d_v, the output projection's
                  input 2·s·b·a·d_v, and the dropout mask sbh; the s×s part, 5as²b, as for any attention

R is the routed tokens of memcalc.model.moe.routed_tokens: s·b·k when balanced.
"""

from __future__ import annotations

from memcalc.model.moe import BALANCED, Routing, routed_tokens
from memcalc.model.shape import ModelShape
from memcalc.terms import Term

MEGATRON = "Korthikanti's rule on a MoE layer (docs/moe.md)"
DEEPSEEK_V2 = "Korthikanti's rule on MLA (Liu et al. 2024, DeepSeek-V2 sec. 2.1)"


def latent_attention_term(shape: ModelShape, seq_len: int, micro_batch: int, factor: int) -> Term:
    """MLA's linear part, in place of Korthikanti's 11·s·b·h (factor 2: fp32, every byte doubled as there)."""
    sb, qk, v = seq_len * micro_batch, shape.n_heads * shape.head_dim, shape.n_heads * shape.v_dim
    per_token = 2 * shape.hidden + 4 * shape.q_lora_rank + 4 * shape.kv_lora_rank + 4 * qk + 4 * v + shape.hidden
    q = "4·{s}·{b}·{r_q} + " if shape.q_lora_rank else ""
    formula = ("2·(" if factor == 2 else "(") + "2·{s}·{b}·{h} + " + q + \
        "4·{s}·{b}·{r_kv} + 4·{s}·{b}·{a}·{d_qk} + 4·{s}·{b}·{a}·{d_v} + {s}·{b}·{h})"
    return Term("latent attention (linear part)", factor * sb * per_token, formula, DEEPSEEK_V2)


def moe_terms(shape: ModelShape, seq_len: int, micro_batch: int, factor: int,
              routing: Routing = BALANCED) -> tuple[Term, ...]:  # fmt: skip
    """A MoE layer's MLP part, per layer: router, top-k, dispatch, experts, combine, shared experts."""
    s, b, h, E, k = seq_len, micro_batch, shape.hidden, shape.n_experts, shape.experts_per_token
    sb = s * b
    R = routed_tokens(shape, sb, routing)
    w = 2 * factor  # bytes of one 16-bit (or, under fp32, 32-bit) activation element
    x = "2·" if factor == 2 else ""
    per_token = 8 if shape.gated_mlp else 4
    r = "{R}" if R != sb * k else "{s}·{b}·{k}"
    fp32_input = 4 * sb * h if shape.router_fp32 and factor == 1 else 0  # under fp32 the input is fp32 already
    terms = [
        Term("router: input, fp32 scores" + (", fp32 input copy" if fp32_input else ""),
             w * sb * h + 4 * sb * E + fp32_input,
             x + "2·{s}·{b}·{h} + 4·{s}·{b}·{E}" + (" + 4·{s}·{b}·{h}" if fp32_input else ""), MEGATRON),
        Term("top-k: expert indices (int64), weights (fp32)", 8 * sb * k + 4 * sb * k, "8·{s}·{b}·{k} + 4·{s}·{b}·{k}",
             MEGATRON),
        Term("dispatch: tokens copied to their experts, index", w * R * h + 8 * sb * k,
             x + f"2·{r}·{{h}} + 8·{{s}}·{{b}}·{{k}}", MEGATRON),
        Term("experts: each expert's MLP on its tokens", factor * per_token * R * shape.routed_ffn,
             x + f"{per_token}·{r}·{{f_e}}", MEGATRON),
        Term("combine: expert outputs, weights, index", w * R * h + w * R + 8 * sb * k,
             x + f"2·{r}·{{h}} + " + x + f"2·{r} + 8·{{s}}·{{b}}·{{k}}", MEGATRON),
    ]  # fmt: skip
    if shape.n_shared_experts:
        terms.append(Term("shared experts", factor * 8 * sb * shape.shared_ffn, x + "8·{s}·{b}·{f_s}", MEGATRON))
    return tuple(terms)


def mtp_terms(shape: ModelShape, seq_len: int, micro_batch: int, factor: int) -> tuple[Term, ...]:
    """What a multi-token prediction module keeps besides its block: the norms of the hidden state and of
    the next tokens' embeddings (2sbh each) and the projection's 2h-wide input (4sbh)."""
    sb = seq_len * micro_batch
    x = "2·" if factor == 2 else ""
    return (Term("MTP: two norms' inputs, the projection's input", factor * 8 * sb * shape.hidden,
                 x + "8·{s}·{b}·{h}", "DeepSeek-V3 report sec. 2.2, Korthikanti's rule"),)  # fmt: skip


def moe_symbols(shape: ModelShape, seq_len: int, micro_batch: int, routing: Routing = BALANCED) -> dict[str, int]:
    """The symbols of these terms' formulas."""
    out = {}
    if shape.is_moe:
        out |= {"E": shape.n_experts, "k": shape.experts_per_token, "f_e": shape.routed_ffn,
                "R": routed_tokens(shape, seq_len * micro_batch, routing)}  # fmt: skip
        if shape.n_shared_experts:
            out["f_s"] = shape.shared_ffn
    if shape.is_mla:
        out |= {"r_kv": shape.kv_lora_rank, "d_qk": shape.head_dim, "d_v": shape.v_dim}
        if shape.q_lora_rank:
            out["r_q"] = shape.q_lora_rank
    return out
