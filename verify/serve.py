"""Transformers' KV caches measured on the meta device: what memcalc.serve.kv holds them to.

A Transformers model is built on meta at full width (AutoModelForCausalLM.from_config, nothing
allocated), a few layers deep, and run as generate runs it: one forward of the prompt with a cache
(DynamicCache, or StaticCache of max_cache_len), then decode steps of one token. Every cache layer's
keys and values are then counted: their bytes as tensors (numel x itemsize: what the cache holds of the
request) and their storages' (what the allocator keeps: a DynamicSlidingWindowLayer's keys are a view of
the last concatenation, window tokens after a decode step, the whole prompt after the prefill).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from memcalc.model.shape import ModelShape

from .hf import NORM_EPS, hf_config, transformers

CACHES = ("dynamic", "static")


def deepseek_v3_config(shape: ModelShape, seq_len: int, experts: int):
    """DeepSeek-V3's attention at its own width (configuration_deepseek_v3.py DeepseekV3Config), every
    layer dense but the last, and `experts` routed experts (the cache sees attention only)."""
    tf = transformers()
    return tf.DeepseekV3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        moe_intermediate_size=shape.routed_ffn, num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads, n_shared_experts=1,
        n_routed_experts=experts, num_experts_per_tok=min(experts, shape.experts_per_token), n_group=1, topk_group=1,
        kv_lora_rank=shape.kv_lora_rank, q_lora_rank=shape.q_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim, qk_nope_head_dim=shape.qk_nope_head_dim,
        first_k_dense_replace=shape.n_layers - 1, max_position_embeddings=max(seq_len, 4096), rms_norm_eps=NORM_EPS,
        use_cache=True, num_mtp_layers=0,
    )  # fmt: skip


def build(shape: ModelShape, seq_len: int, experts: int = 8):
    """The model on meta in bf16, and its config."""
    tf = transformers()
    if shape.is_mla:
        config = deepseek_v3_config(shape, seq_len, experts)
    else:
        config = hf_config(shape, seq_len, use_cache=True)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    return model, config


def layer_bytes(layer) -> tuple[int, int]:
    """(the keys' and values' bytes as tensors, their storages' bytes) of one cache layer."""
    tensors = [layer.keys, layer.values]
    logical = sum(t.numel() * t.element_size() for t in tensors)
    storages = sum(t.untyped_storage().nbytes() for t in tensors)
    return logical, storages


@torch.no_grad()
def measure(shape: ModelShape, prompt: int, decode_steps: int = 1, cache: str = "dynamic",
            max_cache_len: int | None = None) -> list[tuple[int, int]]:  # fmt: skip
    """Each layer's (tensor bytes, storage bytes) after a prefill of `prompt` tokens and decode_steps
    one-token steps, batch 1, on meta."""
    tf = transformers()
    model, config = build(shape, prompt + decode_steps)
    if cache == "static":
        past = tf.StaticCache(config=config, max_cache_len=max_cache_len or prompt + decode_steps)
    else:
        past = tf.DynamicCache(config=config)
    ids = torch.zeros((1, prompt), dtype=torch.long, device="meta")
    model(input_ids=ids, cache=past, use_cache=True)
    for _ in range(decode_steps):
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device="meta"), cache=past, use_cache=True)
    return [layer_bytes(layer) for layer in past.layers]


def shallow(shape: ModelShape, layers: int) -> ModelShape:
    """The shape `layers` deep, its global layers (under a window) those that remain."""
    return replace(shape, n_layers=layers, global_layers=tuple(i for i in shape.global_layers if i < layers),
                   first_dense_layers=min(shape.first_dense_layers, layers - 1))  # fmt: skip
