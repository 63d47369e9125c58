"""Transformers' DynamicCache in a training step, op by op, in bytes on memcalc.exact.sim.

A model called with use_cache (every config's default; the Trainer leaves it on) makes a DynamicCache
(modeling_llama.py LlamaModel.forward: `if use_cache and cache is None: cache = DynamicCache(...)`), and
each attention layer hands its keys and values to it after RoPE (`cache.update(key_states, value_states,
layer_idx)`). cache_utils.py DynamicLayer.update concatenates them onto an empty tensor, a copy of each,
keeps the copies and returns them: attention runs on the copies. DynamicSlidingWindowLayer keeps a view of
its copies, the same storage. The cache leaves with the model's output (CausalLMOutputWithPast's
past_key_values), once compute_loss has taken the loss. A model that checkpoints its layers turns
use_cache off (utils/generic.py merge_with_config_defaults): nothing is kept. With a cache,
create_causal_mask skips its packed-sequence check (masking_utils.py _preprocess_mask_arguments: only
without a cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import aten
from .aten_operands import made
from .config import Config
from .sim import Graph
from .tensors import Tensor

if TYPE_CHECKING:  # only for annotations
    from .hf_family import HFModel


def kept(cfg: Config) -> bool:
    """Whether the forward makes a cache: use_cache on, unless the model checkpoints its layers
    (utils/generic.py merge_with_config_defaults: use_cache=True is incompatible with gradient
    checkpointing, set to False)."""
    return cfg.use_cache and cfg.recompute != "full"


def start(m: HFModel) -> None:
    """XModel.forward: DynamicCache(config=self.config) where the forward keeps one (no tensors yet)."""
    m.cache = [] if kept(m.cfg) else None


def update(g: Graph, m: HFModel, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
    """cache.update(key_states, value_states, layer_idx): DynamicLayer.lazy_initialization's two empty
    tensors (torch.tensor([])), then torch.cat([self.keys, key_states], dim=-2) and the same for the values:
    the copies, kept by the cache and returned. Without a cache (or a layer checkpointed whole): the states."""
    if m.cache is None:
        return key_states, value_states
    empty_keys = made(g, (0,), "tensor", dtype=key_states.dtype)
    empty_values = made(g, (0,), "tensor", dtype=value_states.dtype)
    keys = aten.cat(g, [key_states], 2)
    values = aten.cat(g, [value_states], 2)
    del empty_keys, empty_values  # self.keys, self.values rebound to the copies
    m.cache.append((keys, values))
    return keys, values


def release(m: HFModel) -> None:
    """The model's output, and the cache it holds, dropped."""
    m.cache = None
