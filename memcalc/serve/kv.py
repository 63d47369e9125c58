"""The KV cache: bytes per token per layer, and the tokens each layer keeps of a request.

Per token and layer (one GPU's share):

  attention  2 x kv_heads x head_dim x bytes: a key and a value per KV head (GQA: n_kv_heads, fewer than
             the query heads). Under tensor parallel each GPU keeps max(1, n_kv_heads // tp) heads: vLLM
             replicates a KV head where tp exceeds them (vllm/config/model.py@18ec6629253632af0a384f2ffbb8c6b28af322e7
             ModelConfig.get_num_kv_heads); vllm/v1/kv_cache_interface.py@001cabc1be16a59a70d720ed61a13b678c060a18
             FullAttentionSpec.real_page_size_bytes: block x heads x (head_size + head_size_v) x dtype.
  latent     (kv_lora_rank + qk_rope_head_dim) x bytes, one "head" on every GPU: MLA caches the compressed
             latent and the shared rotary key, not the per-head keys and values. vLLM: get_head_size returns
             kv_lora_rank + qk_rope_head_dim and get_num_kv_heads 1 under use_mla (model.py, as above),
             MLAAttentionSpec.real_page_size_bytes: block x 1 x head_size x dtype. Transformers 5.24 the same:
             modeling_deepseek_v3.py DeepseekV3Attention.forward hands cache.update the normed kv latent
             [b, 1, s, kv_lora_rank] as keys and the rotated k_rot [b, 1, s, qk_rope_head_dim] as values, and
             decompresses them (expand_kv) after the cache.

Tokens a layer keeps of a request of context c:

  full attention          c
  sliding window W        Transformers' DynamicSlidingWindowLayer keeps the last W - 1 (cache_utils.py
                          update: keys[:, :, -sliding_window + 1:]), its StaticSlidingWindowLayer
                          allocates min(max_cache_len, W); vLLM's paged cache reserves min(W - 1 +
                          max_num_batched_tokens, c) tokens and one more block (SlidingWindowSpec.
                          max_memory_usage_bytes: a chunked prefill's tokens and a window that starts
                          inside a block)
"""

from __future__ import annotations

import math

from memcalc.model.shape import ModelShape
from memcalc.records import record

from .job import ServeJob


@record(frozen=True)
class KVLayer:
    """One kind of layer's KV cache on one GPU: its window (0: none), bytes per token, and how many."""

    window: int
    bytes_per_token: int
    count: int

    def kept(self, context: int) -> int:
        """Tokens Transformers' DynamicCache keeps of a request of `context` tokens."""
        return min(context, self.window - 1) if self.window else context

    def paged_blocks(self, context: int, block: int, batched: int) -> int:
        """Blocks vLLM reserves per layer for one request of `context` tokens (kv_cache_interface.py
        FullAttentionSpec / SlidingWindowSpec.max_memory_usage_bytes)."""
        if not self.window:
            return math.ceil(context / block)
        return math.ceil(min(self.window - 1 + batched, context) / block) + 1


def token_bytes(shape: ModelShape, tp: int, element: int) -> int:
    """One token's keys and values in one layer on one GPU (see the module's table)."""
    if shape.is_mla:
        return (shape.kv_lora_rank + shape.qk_rope_head_dim) * element
    heads = max(1, shape.n_kv_heads // tp)
    return heads * (shape.head_dim + shape.v_dim) * element


def kv_layers(job: ServeJob, layers: range) -> tuple[KVLayer, ...]:
    """These layers' caches on one GPU, grouped by window in the order the first of each comes (as vLLM
    groups the layers' specs: a dict in layer order)."""
    shape = job.model.shape
    per_token = token_bytes(shape, job.tp, job.kv_bytes)
    windows = [shape.window_at(i) for i in layers]
    return tuple(KVLayer(w, per_token, windows.count(w)) for w in dict.fromkeys(windows))


@record(frozen=True)
class KVCache:
    """One GPU's KV cache for the job: per token (all its layers) and per request at the context."""

    layers: tuple[KVLayer, ...]
    context: int
    element_bytes: int  # one cached number: 2 (bf16, fp16) or 1 (fp8)

    @property
    def bytes_per_token(self) -> int:
        """A token's keys and values in every layer on this GPU (a layer with a window counted too)."""
        return sum(k.bytes_per_token * k.count for k in self.layers)

    @property
    def request_bytes(self) -> int:
        """What Transformers' DynamicCache holds for one request of `context` tokens: each layer's kept
        tokens (a sliding layer's last window - 1)."""
        return sum(k.bytes_per_token * k.count * k.kept(self.context) for k in self.layers)
