"""How many parameters a shape has, by place (ParamCounts): its norms, attention (latent attention's
projections under MLA), dense MLPs, routed and shared experts, blocks and multi-token prediction modules,
counted tensor by tensor as verify/builder.py builds them; and the parameters one token goes through.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from memcalc.records import record

from .moe_mla import is_moe_layer, moe_layer_count

if TYPE_CHECKING:
    from .shape import ModelShape


@record(frozen=True, slots=True)
class ParamCounts:
    """Parameters by place in the model; the total is their sum."""

    embedding: int  # token table (+ learned position table)
    per_layer: int  # a layer with the dense MLP
    n_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the token table
    per_moe_layer: int = 0  # a layer whose MLP is the mixture: router, every expert, shared experts
    moe_layers: int = 0  # how many of the n_layers are MoE layers
    idle_per_moe_layer: int = 0  # the routed experts one token does not go to: (E - k) experts
    mtp: int = 0  # multi-token prediction modules (embedding and output head shared with the model)

    @property
    def layers(self) -> int:
        return self.per_layer * (self.n_layers - self.moe_layers) + self.per_moe_layer * self.moe_layers

    @property
    def main(self) -> int:
        """The model without its multi-token prediction modules (DeepSeek-V3's 671B)."""
        return self.embedding + self.layers + self.final_norm + self.lm_head

    @property
    def total(self) -> int:
        return self.main + self.mtp

    @property
    def active(self) -> int:
        """The main model's parameters one token goes through: all but the routed experts it is not sent
        to (the embedding counted whole, as Mixtral's 12.9B and Qwen3's 22B active count it)."""
        return self.main - self.idle_per_moe_layer * self.moe_layers


def norm_params(shape: ModelShape) -> int:
    """One norm over hidden: weight, plus a bias for LayerNorm."""
    return 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden


def block_norm_params(shape: ModelShape) -> int:
    """A block's norms over hidden (two; four in Gemma 2/3's sandwich) and its q/k norms (per head: head_dim
    each, Qwen3; over the projections: q_dim and kv_dim, OLMo 2): what TP replicates."""
    return shape.norms_per_layer * norm_params(shape) + sum(shape.qk_norm_widths)


def attention_params(shape: ModelShape) -> int:
    """W_q, W_k, W_v, W_o (+ biases, + q/k norm weights); latent attention's projections under MLA."""
    if shape.is_mla:
        return latent_attention_params(shape)
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    weights = h * q + 2 * h * kv + q * h
    biases = 0
    if shape.linear_bias:
        biases = q + 2 * kv + h
    elif shape.qkv_bias:
        biases = q + 2 * kv
    return weights + biases + sum(shape.qk_norm_widths)


def linear_weights(shape: ModelShape) -> int:
    """The weights of a dense block's linears (W_q, W_k, W_v, W_o and the MLP's), no biases: what fp8:te keeps
    an fp8 transpose of for backward, one byte each (memcalc.exact.aten.te)."""
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    return h * q + 2 * h * kv + q * h + (3 if shape.gated_mlp else 2) * h * f


def latent_attention_params(shape: ModelShape) -> int:
    """Multi-head latent attention (modeling_deepseek_v3.py DeepseekV3Attention; Megatron-LM
    theoretical_memory_usage.py self_attn_term): q_a (h x r_q), its norm, q_b (r_q x H·d_qk), or one W_q
    without q_lora_rank; kv_a_proj_with_mqa (h x (r_kv + d_rope)), its norm over r_kv, kv_b (r_kv x
    H·(d_nope + d_v)); o_proj (H·d_v x h)."""
    h, H, rq, rkv = shape.hidden, shape.n_heads, shape.q_lora_rank, shape.kv_lora_rank
    norm = 2 if shape.norm == "layernorm" else 1  # weight (+ bias) per element of the latent
    q = rq * (h + norm + H * shape.head_dim) if rq else h * H * shape.head_dim
    kv = h * (rkv + shape.qk_rope_head_dim) + norm * rkv + rkv * H * (shape.qk_nope_head_dim + shape.v_head_dim)
    return q + kv + H * shape.v_head_dim * h


def mlp_params_of(shape: ModelShape, width: int) -> int:
    """Plain: W_in (h x f), W_out (f x h). Gated: W_gate, W_up (h x f), W_down (f x h)."""
    n_in = 2 if shape.gated_mlp else 1
    weights = (n_in + 1) * shape.hidden * width
    biases = (n_in * width + shape.hidden) if shape.linear_bias else 0
    return weights + biases


def mlp_params(shape: ModelShape) -> int:
    """The dense MLP, ffn wide."""
    return mlp_params_of(shape, shape.ffn)


def expert_params(shape: ModelShape) -> int:
    """One routed expert: an MLP of expert_ffn (Mixtral's experts are SwiGLUs of its ffn)."""
    return mlp_params_of(shape, shape.routed_ffn)


def moe_mlp_params(shape: ModelShape) -> int:
    """A MoE layer's MLP: the router (h x E, no bias), every routed expert, the shared experts (one MLP of
    n_shared x their width, as DeepSeek-V3 builds them). Megatron-LM theoretical_memory_usage.py:
    routed_expert_params + shared_expert_params + router_params."""
    shared = mlp_params_of(shape, shape.shared_ffn) if shape.n_shared_experts else 0
    return shape.hidden * shape.n_experts + shape.n_experts * expert_params(shape) + shared


def layer_params(shape: ModelShape) -> int:
    """One block with the dense MLP: attention + MLP + its norms (two; four in the sandwich)."""
    return attention_params(shape) + mlp_params(shape) + shape.norms_per_layer * norm_params(shape)


def moe_layer_params(shape: ModelShape) -> int:
    """One block whose MLP is the mixture: attention + router + experts + shared experts + its norms."""
    return attention_params(shape) + moe_mlp_params(shape) + shape.norms_per_layer * norm_params(shape)


def largest_layer_params(shape: ModelShape) -> int:
    """The most parameters one block has (what ZeRO-3 gathers at once): a MoE block where there is one."""
    return moe_layer_params(shape) if moe_layer_count(shape) else layer_params(shape)


def mtp_params(shape: ModelShape) -> int:
    """One multi-token prediction module (DeepSeek-V3 report sec. 2.2): RMSNorms of the hidden state and of
    the next token's embedding, their projection M (2h -> h), one block (MoE when the last block is, as
    Megatron-LM counts mtp_num_moe_layers) and its final norm; embedding and output head shared."""
    last_is_moe = shape.n_layers > 0 and is_moe_layer(shape, shape.n_layers - 1)
    block = moe_layer_params(shape) if last_is_moe else layer_params(shape)
    return 3 * norm_params(shape) + 2 * shape.hidden * shape.hidden + block


@lru_cache(maxsize=1024)  # the estimate, the toolbox and the planner ask for the same shape many times
def param_counts(shape: ModelShape) -> ParamCounts:
    """Count every parameter tensor of the stack, as the PyTorch model in verify/ builds it."""
    positions = shape.max_positions * shape.hidden if shape.positions == "learned" else 0
    moe = moe_layer_count(shape)
    return ParamCounts(
        embedding=shape.vocab * shape.hidden + positions,
        per_layer=layer_params(shape),
        n_layers=shape.n_layers,
        final_norm=norm_params(shape),
        lm_head=0 if shape.tied_embeddings else shape.vocab * shape.hidden,
        per_moe_layer=moe_layer_params(shape) if moe else 0,
        moe_layers=moe,
        idle_per_moe_layer=(shape.n_experts - shape.experts_per_token) * expert_params(shape) if moe else 0,
        mtp=shape.mtp_layers * mtp_params(shape),
    )


def n_params(shape: ModelShape) -> int:
    return param_counts(shape).total


def idle_params(shape: ModelShape) -> int:
    """The routed experts one token does not go to, in every MoE block (MTP modules' too): what training
    FLOPs leave out of 6N."""
    if not shape.n_experts:  # a dense model: every parameter is active
        return 0
    counts = param_counts(shape)
    mtp_moe = shape.mtp_layers if shape.n_layers and is_moe_layer(shape, shape.n_layers - 1) else 0
    return counts.idle_per_moe_layer and (shape.n_experts - shape.experts_per_token) * expert_params(shape) * (
        counts.moe_layers + mtp_moe)


def active_params(shape: ModelShape) -> int:
    """Parameters one token goes through in the main model (see ParamCounts.active): the total of a dense model."""
    return param_counts(shape).active
