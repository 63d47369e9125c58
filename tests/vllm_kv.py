"""vLLM's KV-cache arithmetic transcribed from its source, to hold memcalc.serve against (not memcalc).

Transcribed, function by function and with vLLM's names, from vllm-project/vllm
  vllm/v1/kv_cache_interface.py @ 001cabc1be16a59a70d720ed61a13b678c060a18: AttentionSpec.page_size_bytes,
      FullAttentionSpec / MLAAttentionSpec.real_page_size_bytes, FullAttentionSpec and SlidingWindowSpec
      .max_memory_usage_bytes, KVCacheSpec.merge, UniformTypeKVCacheSpecs.is_uniform_type
  vllm/v1/core/kv_cache_utils.py @ 001cabc1be16a59a70d720ed61a13b678c060a18: get_kv_cache_groups,
      is_kv_cache_spec_uniform, _get_kv_cache_groups_uniform_page_size, get_kv_cache_config_from_groups,
      get_num_blocks, get_max_concurrency_for_kv_cache_config, _max_memory_usage_bytes_from_groups,
      _estimate_max_model_len_from_groups, _report_kv_cache_config's token count
      and get_kv_cache_configs' projection onto each pipeline stage (_project_kv_cache_groups_to_worker)
      and its minimum over the stages
  vllm/config/model.py @ 18ec6629253632af0a384f2ffbb8c6b28af322e7: get_head_size, get_num_kv_heads
  vllm/distributed/utils.py @ 5a6541db9bfa77756459722f69e8c89a0b47a14d: get_pp_indices
A torch dtype is its size in bytes here; decode context parallel is 1; num_gpu_blocks_override unset;
the hybrid allocator on (the default), per-token-head quantization and padding off.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class Config:
    """The few fields of VllmConfig the arithmetic reads."""

    max_model_len: int
    max_num_batched_tokens: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: int  # get_dtype_size(dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    @property
    def real_page_size_bytes(self) -> int:
        head_size_v = self.head_size  # __post_init__: head_size_v defaults to head_size
        return self.block_size * self.num_kv_heads * (self.head_size + head_size_v) * self.dtype

    def max_memory_usage_bytes(self, config: Config) -> int:
        return cdiv(config.max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int

    @property
    def real_page_size_bytes(self) -> int:  # AttentionSpec.real_page_size_bytes
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype

    def max_memory_usage_bytes(self, config: Config) -> int:
        num_tokens = min(self.sliding_window - 1 + config.max_num_batched_tokens, config.max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: AttentionSpec


def layer_specs(shape, tp: int, block_size: int, dtype: int) -> dict[str, AttentionSpec]:
    """Each attention layer's spec as the model runner makes it (Attention / MLAAttention.get_kv_cache_spec):
    MLA one head of kv_lora_rank + qk_rope_head_dim; else max(1, kv_heads // tp) heads of head_dim; a
    layer with a window a SlidingWindowSpec."""
    specs = {}
    for i in range(shape.n_layers):
        name = f"model.layers.{i}.self_attn.attn"
        if shape.is_mla:
            specs[name] = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                           head_size=shape.kv_lora_rank + shape.qk_rope_head_dim, dtype=dtype)
        elif shape.window_at(i):
            specs[name] = SlidingWindowSpec(block_size=block_size, num_kv_heads=max(1, shape.n_kv_heads // tp),
                                            head_size=shape.head_dim, dtype=dtype, sliding_window=shape.window_at(i))
        else:
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=max(1, shape.n_kv_heads // tp),
                                            head_size=shape.head_dim, dtype=dtype)
    return specs


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, AttentionSpec]) -> bool:
    values = list(kv_cache_spec.values())
    return all(spec == values[0] for spec in values[1:])  # KVCacheSpec.merge asserts them equal


def is_uniform_type(kv_cache_specs: dict[str, AttentionSpec]) -> bool:
    one_spec = next(iter(kv_cache_specs.values()))
    if isinstance(one_spec, FullAttentionSpec):
        return all(isinstance(spec, FullAttentionSpec) for spec in kv_cache_specs.values())
    return all(isinstance(spec, SlidingWindowSpec) and spec.sliding_window == one_spec.sliding_window
               for spec in kv_cache_specs.values())


def get_kv_cache_groups(kv_cache_spec: dict[str, AttentionSpec]) -> list[KVCacheGroupSpec]:
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return [KVCacheGroupSpec(list(kv_cache_spec), next(iter(kv_cache_spec.values())))]
    assert not is_uniform_type(kv_cache_spec), "UniformTypeKVCacheSpecs: no preset needs it"
    assert len({s.page_size_bytes for s in kv_cache_spec.values()}) == 1  # unify_kv_cache_spec_page_size
    same_type_layers: dict[AttentionSpec, list[str]] = defaultdict(list)
    for layer_name, layer_spec in kv_cache_spec.items():
        same_type_layers[layer_spec].append(layer_name)
    min_num_layers = min(len(layers) for layers in same_type_layers.values())
    group_size = min_num_layers
    max_num_layers = max(len(layers) for layers in same_type_layers.values())
    if max_num_layers < min_num_layers * 1.5:
        group_size = max_num_layers
    grouped_layers = []
    for layers in same_type_layers.values():
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            grouped_layers.append(layers[i::num_groups])
    return [KVCacheGroupSpec(names, kv_cache_spec[names[0]]) for names in grouped_layers]


def get_num_blocks(num_layers: int, available_memory: int, page_size: int) -> int:
    return max(int(available_memory // page_size // num_layers), 0)


def num_blocks_of(kv_cache_groups: list[KVCacheGroupSpec], available_memory: int) -> int:
    """get_kv_cache_config_from_groups's num_blocks (the general case: one spec per group)."""
    group_size = max(len(group.layer_names) for group in kv_cache_groups)
    page_sizes = {group.kv_cache_spec.page_size_bytes for group in kv_cache_groups}
    assert len(page_sizes) == 1  # get_uniform_page_size
    return get_num_blocks(group_size, available_memory, page_sizes.pop())


def get_max_concurrency(config: Config, kv_cache_groups: list[KVCacheGroupSpec], num_blocks: int) -> float:
    num_layer_per_group = max(len(group.layer_names) for group in kv_cache_groups)
    max_memory_usage_per_request = num_layer_per_group * sum(
        group.kv_cache_spec.max_memory_usage_bytes(config) for group in kv_cache_groups)
    memory_per_block = kv_cache_groups[0].kv_cache_spec.page_size_bytes * num_layer_per_group
    num_block_per_request = cdiv(max_memory_usage_per_request, memory_per_block)
    return num_blocks / num_block_per_request


def max_memory_usage_bytes_from_groups(config: Config, kv_cache_groups: list[KVCacheGroupSpec]) -> int:
    group_size = max(len(group.layer_names) for group in kv_cache_groups)  # a worker's projected groups
    page_size = kv_cache_groups[0].kv_cache_spec.page_size_bytes
    blocks_needed = sum(cdiv(group.kv_cache_spec.max_memory_usage_bytes(config), page_size)
                        for group in kv_cache_groups)
    return group_size * page_size * blocks_needed


def estimate_max_model_len(config: Config, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int) -> int:
    def fits(model_len: int) -> bool:
        c = Config(model_len, config.max_num_batched_tokens)
        return max_memory_usage_bytes_from_groups(c, kv_cache_groups) <= available_memory

    left, right = 1, config.max_model_len
    if not fits(left):
        return 0
    result = 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


def cache_tokens(kv_cache_groups: list[KVCacheGroupSpec], num_blocks: int) -> int:
    """_report_kv_cache_config: "GPU KV cache size: N tokens"."""
    return num_blocks // len(kv_cache_groups) * min(g.kv_cache_spec.block_size for g in kv_cache_groups)


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    layers_per_partition = num_hidden_layers // pp_size
    partitions = [layers_per_partition for _ in range(pp_size)]
    if remaining_layers := num_hidden_layers % pp_size:
        for i in range(2, remaining_layers + 2):
            partitions[-i] += 1
    start_layer = sum(partitions[:pp_rank])
    return start_layer, start_layer + partitions[pp_rank]


def project_kv_cache_groups_to_worker(global_kv_cache_groups: list[KVCacheGroupSpec],
                                      worker_spec: dict[str, AttentionSpec]) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec([n for n in group.layer_names if n in worker_spec], group.kv_cache_spec)
            for group in global_kv_cache_groups]


def workers_of(specs: dict[str, AttentionSpec], pp: int) -> list[dict[str, AttentionSpec]]:
    """Each pipeline rank's layers' specs (the model runner of rank r builds layers get_pp_indices gives it)."""
    items = list(specs.items())
    return [dict(items[slice(*get_pp_indices(len(items), rank, pp))]) for rank in range(pp)]


def get_kv_cache_configs(specs: dict[str, AttentionSpec], pp: int, available_memory: list[int]):
    """(global groups, num_blocks): every worker's blocks from its projected groups, then the smallest."""
    global_groups = get_kv_cache_groups(specs)
    blocks = [num_blocks_of(project_kv_cache_groups_to_worker(global_groups, w), mem)
              for w, mem in zip(workers_of(specs, pp), available_memory)]
    return global_groups, min(blocks)


def auto_fit_max_model_len(config: Config, specs: dict[str, AttentionSpec], pp: int,
                           available_memory: list[int]) -> int:
    """_auto_fit_max_model_len: the longest max_model_len every worker's projected groups hold."""
    global_groups = get_kv_cache_groups(specs)
    return min(estimate_max_model_len(config, project_kv_cache_groups_to_worker(global_groups, w), mem)
               for w, mem in zip(workers_of(specs, pp), available_memory))
