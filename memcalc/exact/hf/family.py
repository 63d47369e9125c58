"""What memcalc.exact.hf.model's families share: the model being replayed (HFModel) and one Transformers
architecture (Family): the config Transformers builds it from, its named_parameters(), its buffers, its
decoder's forward, and whether PEFT's LoRA is replayed on it.

Each family's module (llama, gpt2, gemma, olmo2, phi3, gpt_neox) defines its Family; memcalc.exact.hf.model
lists them by model_type (FAMILIES) and picks one by the shape's architecture; verify/hf.py builds each from
its config. This module imports nothing of theirs.
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
    outputs: tuple[str, ...] = ()  # its fused LM head's, where not its trainer's (memcalc.exact.hf.fused_head)
    reference: HFModel | None = None  # DPO's reference model beside it (memcalc.exact.hf.dpo), if it has one
    batch: dict[str, Tensor] = field(default_factory=dict)  # GRPO's buffered generation batch (memcalc.exact.hf.grpo)
    decoding: bool = False  # generate's decode steps: the cache grows a token (memcalc.exact.hf.generate)
    position_ids: Tensor | None = None  # the caller's (PPO's forward): no arange, rotary tables a row per sequence
    mask: Tensor | None = None  # the caller's 2-D bool attention mask (PPO's forward), read as it is
    captured: list[Tensor] | None = None  # output_hidden_states: each layer's input, then the normed output
    own_loop: object | None = None  # a trainer's own loop around the step (memcalc.exact.hf.ppo): what runs after

    def checkpoint(self, g: Graph):
        """How a GradientCheckpointingLayer checkpoints itself: torch.utils.checkpoint with the use_reentrant the
        stack gives gradient_checkpointing_kwargs (modeling_utils.py _activation_checkpointing_enable)."""
        return g.checkpoint_reentrant if self.cfg.stack.reentrant else g.checkpoint


@dataclass(frozen=True)
class Family:
    """One Transformers architecture as memcalc.exact.hf.model replays it and verify/hf.py builds it."""

    params: Callable[[ModelShape], list[tuple[str, tuple]]]  # named_parameters(), names and shapes, in order
    buffers: Callable[[ModelShape], list[tuple]]  # model.buffers(): name, shape (and "weights": the model's dtype)
    decoder: Callable[[Graph, HFModel, Tensor, tuple], Tensor]  # XModel.forward: token ids -> hidden states
    table: str  # the token embedding's name: what a tied lm_head reuses
    config: Callable[[ModelShape, int], dict]  # its configuration_<type>.py fields for a shape at a sequence length
    lora: bool = False  # PEFT's LoRA replayed on it: Llama's decoder, projections as memcalc.model.finetune's


NORM_EPS = 1e-5  # every norm's eps in the configs memcalc builds (it changes no byte)


def decoder_config(shape: ModelShape, seq_len: int, **extra) -> dict:
    """The fields Llama's configuration and those written after it share (configuration_llama.py)."""
    return dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
                num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                max_position_embeddings=max(seq_len, 2048), rms_norm_eps=NORM_EPS,
                tie_word_embeddings=shape.tied_embeddings, attention_dropout=shape.dropout, use_cache=False,
                **extra)  # fmt: skip


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
