"""Transformers' DynamicCache in a training step, op by op, in bytes on memcalc.exact.sim.graph.

A model called with use_cache (every config's default; the Trainer leaves it on) makes a DynamicCache
(modeling_llama.py LlamaModel.forward: `if use_cache and cache is None: cache = DynamicCache(...)`), and
each attention layer hands its keys and values to it after RoPE (`cache.update(key_states, value_states,
layer_idx)`). cache_utils.py DynamicLayer.update concatenates them onto an empty tensor, a copy of each,
keeps the copies and returns them: attention runs on the copies. A config with a sliding window makes a
DynamicSlidingWindowLayer for each sliding layer (cache_utils.py get_layer_types_and_kwargs: layer_types, or
every layer where sliding_window is set): it keeps a view of its copies, the same storage, and a 0-d int64
tensor of its window. The cache leaves with the model's output (CausalLMOutputWithPast's
past_key_values), once compute_loss has taken the loss. A model that checkpoints its layers turns
use_cache off (utils/generic.py merge_with_config_defaults): nothing is kept. With a cache,
create_causal_mask skips its packed-sequence check (masking_utils.py _preprocess_mask_arguments: only
without a cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import Tensor

if TYPE_CHECKING:  # only for annotations
    from .family import HFModel


def kept(cfg: StepConfig) -> bool:
    """Whether the forward makes a cache: use_cache on, unless the model checkpoints its layers
    (utils/generic.py merge_with_config_defaults: use_cache=True is incompatible with gradient
    checkpointing, set to False)."""
    return cfg.use_cache and cfg.recompute != "full"


def start(m: HFModel) -> None:
    """XModel.forward: DynamicCache(config=self.config) where the forward keeps one (no tensors yet)."""
    m.cache = [] if kept(m.cfg) else None


def construct(g: Graph, m: HFModel) -> None:
    """DynamicCache(config=self.config), made after the embedding: each DynamicSlidingWindowLayer.__init__'s
    torch.tensor(self.sliding_window, dtype=torch.long) on the CPU, 8 bytes there (lift_fresh) where the
    model runs on CPU tensors, kept by the cache."""
    if m.cache is None or m.cfg.device != "cpu":
        return
    s = m.cfg.shape
    m.cache.append(tuple(made(g, (), "lift_fresh", dtype="int64") for i in range(s.n_layers) if s.window_at(i)))


def update(g: Graph, m: HFModel, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
    """cache.update(key_states, value_states, layer_idx) for layer g.layer: DynamicLayer.lazy_initialization's
    two empty tensors (torch.tensor([])), and a sliding layer's move of its _sliding_window_tensor to the keys'
    device, a new 0-d tensor it keeps (on CPU tensors the same one, made with the cache); then
    torch.cat([self.keys, key_states], dim=-2) and the same for the values: the copies, kept by the cache
    and returned (a sliding layer keeps views of them,
    full_key_states[:, :, -sliding_window + 1:]). Without a cache (or a layer checkpointed whole): the
    states."""
    if m.cache is None:
        return key_states, value_states
    if m.decoding:  # generate's later steps: DynamicLayer.update's cat onto the layer's keys and values
        return grown(g, m, key_states, value_states)
    empty_keys = made(g, (0,), "tensor", dtype=key_states.dtype)
    empty_values = made(g, (0,), "tensor", dtype=value_states.dtype)
    sliding = m.cfg.shape.window_at(g.layer) and m.cfg.device != "cpu"
    window = made(g, (), "_to_copy", dtype="int64") if sliding else None
    keys = aten.cat(g, [key_states], 2)
    values = aten.cat(g, [value_states], 2)
    del empty_keys, empty_values  # self.keys, self.values rebound to the copies
    m.cache.append((keys, values) if window is None else (keys, values, window))
    return keys, values


def grown(g: Graph, m: HFModel, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
    """torch.cat([self.keys, key_states], dim=-2), the keys rebound to it (the old ones freed), then the values
    (memcalc.exact.hf.generate's decode steps; the cache's entries are the layers' in order)."""
    keys, values = m.cache[g.layer]
    m.cache[g.layer] = None
    keys = aten.cat(g, [keys, key_states], 2)
    values = aten.cat(g, [values, value_states], 2)
    m.cache[g.layer] = (keys, values)
    return keys, values


def release(m: HFModel) -> None:
    """The model's output, and the cache it holds, dropped."""
    m.cache = None
