"""A shape's optional mixture-of-experts and latent-attention (MLA) fields: the rules they keep among
themselves (check_experts, check_latent: ModelShape runs them), and which layers' MLPs are mixtures
(is_moe_layer, moe_layer_count), as each modeling_*.py's decoder layer decides it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from memcalc.errors import InputError, subject

from .sizes import check_size

if TYPE_CHECKING:
    from .shape import ModelShape

ROUTERS = ("softmax", "sigmoid")  # softmax over the experts (Mixtral, Qwen3-MoE); sigmoid scores (DeepSeek-V3)


def check_experts(shape: ModelShape) -> None:
    """The mixture-of-experts fields agree with each other (one InputError line if not)."""
    for field in ("n_experts", "experts_per_token", "n_shared_experts", "first_dense_layers", "moe_offset",
                  "mtp_layers"):  # fmt: skip
        check_size(field, getattr(shape, field), allow_zero=True)
    check_size("moe_every", shape.moe_every)
    for field in ("expert_ffn", "shared_expert_ffn"):
        if getattr(shape, field) is not None:
            check_size(field, getattr(shape, field))
    if not isinstance(shape.dense_layers, tuple):
        raise InputError(f"dense_layers must be a tuple of layer indices, got {shape.dense_layers!r}")
    for i in shape.dense_layers:
        check_size("a dense layer index", i, allow_zero=True)
    if shape.router not in ROUTERS:
        raise InputError(f"unknown router {shape.router!r}; known: {', '.join(ROUTERS)}")
    if not shape.n_experts:
        if shape.experts_per_token or shape.n_shared_experts:
            raise InputError("experts per token and shared experts need routed experts: n_experts is 0")
        return
    if not 1 <= shape.experts_per_token <= shape.n_experts:
        raise InputError(f"experts per token ({shape.experts_per_token}) must be between 1 and the "
                         f"{shape.n_experts} routed experts")  # fmt: skip
    if shape.moe_offset >= shape.moe_every:
        raise InputError(f"moe_offset ({shape.moe_offset}) must be below moe_every ({shape.moe_every})")


def check_latent(shape: ModelShape) -> None:
    """Multi-head latent attention's fields agree with each other (one InputError line if not)."""
    fields = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    for field in fields:
        check_size(field, getattr(shape, field), allow_zero=True)
    if not shape.kv_lora_rank:
        given = [f for f in fields if getattr(shape, f)]
        if given:
            raise InputError(f"{subject(given, 'describes', 'describe')} latent attention (MLA), which needs "
                             "kv_lora_rank > 0")  # fmt: skip
        return
    if not shape.qk_rope_head_dim or shape.qk_rope_head_dim % 2:
        raise InputError(f"latent attention needs an even qk_rope_head_dim (RoPE rotates pairs), got "
                         f"{shape.qk_rope_head_dim}")  # fmt: skip
    if not shape.v_head_dim:
        raise InputError("latent attention needs v_head_dim > 0")
    if shape.head_dim != shape.qk_nope_head_dim + shape.qk_rope_head_dim:
        raise InputError(f"under latent attention head_dim is qk_nope_head_dim + qk_rope_head_dim = "
                         f"{shape.qk_nope_head_dim + shape.qk_rope_head_dim}, got {shape.head_dim}")  # fmt: skip
    if shape.n_kv_heads != shape.n_heads:
        raise InputError(f"latent attention decompresses K and V for every head: kv heads ({shape.n_kv_heads}) "
                         f"must equal heads ({shape.n_heads})")  # fmt: skip
    if shape.linear_bias or shape.qkv_bias or shape.qk_norm:
        raise InputError("latent attention with biases or q/k norms is not modelled")
    if shape.positions != "rope":
        raise InputError("latent attention carries its positions in the rotary part: positions must be rope")


def is_moe_layer(shape: ModelShape, i: int) -> bool:
    """Whether layer i's MLP is a mixture of experts (modeling_deepseek_v3.py: layer_idx >= first_k_dense_replace;
    modeling_qwen3_moe.py: (layer_idx + 1) % decoder_sparse_step == 0 and not in mlp_only_layers)."""
    return (shape.n_experts > 0 and i >= shape.first_dense_layers and i % shape.moe_every == shape.moe_offset
            and i not in shape.dense_layers)  # fmt: skip


@lru_cache(maxsize=1024)
def moe_layer_count(shape: ModelShape) -> int:
    if not shape.n_experts:  # a dense model: asked for by every layout the planner builds
        return 0
    return sum(is_moe_layer(shape, i) for i in range(shape.n_layers))
