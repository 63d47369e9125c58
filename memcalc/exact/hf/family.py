"""What memcalc.exact.hf.model's families share: the model being replayed (HFModel) and how one Transformers
architecture is built (Family): its named_parameters(), its buffers and its decoder's forward.

Each family's module (hf_llama, hf_gpt2, hf_gemma, hf_olmo2, hf_phi3, hf_gpt_neox) defines its Family;
memcalc.exact.hf.model picks one by the shape's architecture. This module imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memcalc.model.shape import ModelShape

from ..aten.cast_policy import Autocast
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import Tensor


@dataclass
class HFModel:
    cfg: StepConfig
    arch: str
    p: dict[str, Tensor]  # the parameters by name
    rope: list[Tensor]  # model.buffers() in order: rotary tables fp32, Gemma's embed_scale in the model's dtype
    params: list[Tensor] = field(default_factory=list)  # those that train (all but frozen), in parameters() order
    autocast: Autocast | None = None  # the autocast recipe's: the forward Accelerate prepared runs under it
    cache: list[tuple[Tensor, Tensor]] | None = None  # the forward's DynamicCache: each layer's keys and values
    quant: dict = field(default_factory=dict)  # QLoRA: each 4-bit projection's QuantWeight (memcalc.exact.hf.qlora)
    held: list[Tensor] = field(default_factory=list)  # besides parameters and buffers: QLoRA's shared dynamic map


@dataclass(frozen=True)
class Family:
    """One Transformers architecture as memcalc.exact.hf.model replays it."""

    params: Callable[[ModelShape], list[tuple[str, tuple]]]  # named_parameters(), names and shapes, in order
    buffers: Callable[[ModelShape], list[tuple]]  # model.buffers(): name, shape (and "weights": the model's dtype)
    decoder: Callable[[Graph, HFModel, Tensor, tuple], Tensor]  # XModel.forward: token ids -> hidden states
    table: str  # the token embedding's name: what a tied lm_head reuses


def rope_buffers(shape: ModelShape) -> list[tuple[str, tuple]]:
    """LlamaRotaryEmbedding.__init__: inv_freq and original_inv_freq, rope_dim/2 each (fp32)."""
    return [(name, (shape.rope_dim // 2,)) for name in ("inv_freq", "original_inv_freq")]


def decoder_params(s: ModelShape, layer: Callable[[str], list[tuple[str, tuple]]]) -> list[tuple[str, tuple]]:
    """named_parameters() as LlamaForCausalLM and the decoders written after it register them: model.embed_tokens,
    each layer's (layer: the family's, given the layer's prefix), model.norm, then lm_head where untied."""
    out = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.n_layers):
        out += layer(f"model.layers.{i}.")
    out.append(("model.norm.weight", (s.hidden,)))
    return out + ([] if s.tied_embeddings else [("lm_head.weight", (s.vocab, s.hidden))])
