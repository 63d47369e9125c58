"""TRL 1.3-1.12's PPOTrainer's models (--rl ppo), for memcalc.exact.hf.ppo (the PPO epochs) and ppo_rollout (the
rollout): the critic's architecture (--critic) and what the replay refuses, the value, reward and reference models
beside the policy, the optimizer's groups over the two that train, and how ppo_trainer.forward and get_reward call
a model (its inputs, a backbone's or a causal LM's output with output_hidden_states, the score head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .dynamic_cache import start

if TYPE_CHECKING:
    from memcalc.model.shape import ModelShape

    from .family import Family, HFModel


@dataclass(frozen=True)
class Critic:
    """The value and reward models' architecture: its shape, model_type and family."""

    shape: ModelShape
    arch: str
    family: Family


def check_ppo(cfg, family, arch: str, critic: Critic) -> None:
    """Refuse what the replay does not run as PPOTrainer does: QLoRA, DoRA, modules to save and frozen weights (with_ppo
    says so first; the toolbox's variants meet it here), checkpointing (nothing enables it: PPOTrainer never
    runs Trainer.__init__, which reads PPOConfig.gradient_checkpointing), decoders other than Llama's (position_ids
    and the bool mask as the callers hand them), a sliding window, dropout (disable_dropout_in_model turns
    nn.Dropout off, not every family's attention dropout), a prompt of no token."""
    from memcalc.errors import InputError
    from memcalc.model.rl import PPO_FINETUNES

    from .llama import llama_model

    ft = cfg.finetune
    if not ft.trains_all and not ft.lora or ft.quantize or ft.dora or ft.modules_to_save:
        raise InputError(PPO_FINETUNES.format(ft.label))
    if cfg.recompute != "none":
        raise InputError("--rl ppo with activation checkpointing: TRL 1.12's PPOTrainer never enables it (it does not "
                         "run Trainer.__init__, which reads PPOConfig.gradient_checkpointing); drop ckpt")  # fmt: skip
    for what, fam, name, shape in (("", family, arch, cfg.shape), (" (--critic)", critic.family, critic.arch,
                                                                     critic.shape)):  # fmt: skip
        if fam.decoder is not llama_model or shape.sliding_window:
            raise InputError(f"--rl ppo is replayed on Llama's decoder (Llama, Qwen2, Qwen3, Mistral without a "
                             f"window), not {name}{what}" + (" with a sliding window" if shape.sliding_window else ""))
        if shape.dropout:
            raise InputError(f"--rl ppo on a model with dropout{what}: disable_dropout_in_model turns its nn.Dropout "
                             "modules off but not every family's attention dropout, which is not replayed")
    if cfg.stack.ppo.completion_len >= cfg.seq_len:
        raise InputError(f"--completion-len {cfg.stack.ppo.completion_len} leaves no prompt in --seq {cfg.seq_len}: "
                         "the sequence is the prompt and the response together")  # fmt: skip


class Output:
    """The policy's CausalLMOutputWithPast as the loop holds it: its cache's keys and values, its hidden states."""

    def __init__(self, cache: list, hidden: list[Tensor]):
        self.cache = cache
        self.hidden = tuple(hidden)


def value_params(family, shape) -> list[tuple[str, tuple]]:
    """AutoModelForSequenceClassification(num_labels=1): the backbone's parameters, then score (1, hidden), no bias."""
    return [(n, s) for n, s in family.params(shape) if n != "lm_head.weight"] + [("score.weight", (1, shape.hidden))]


def models_for(g: Graph, cfg, family, arch: str, critic: Critic) -> tuple[HFModel, HFModel, HFModel | None]:
    """PPOTrainer's models beside the policy, each in the model's dtype with its own rotary buffers: the value model
    (the critic's architecture, trained with the policy under one optimizer, whatever the policy's fine-tuning), and
    what is only held in the step: the reward model (the critic's), and the reference (a copy of the policy where it
    is not PEFT's; under PEFT the policy with its adapters disabled)."""
    from memcalc.model.finetune import FULL

    from .family import HFModel

    dtype = cfg.weights_dtype

    def buffers(label: str, fam, shape) -> list[Tensor]:
        return [g.empty(b[1], dtype if b[2:] == ("weights",) else "fp32", f"{label} buffer {b[0]}", kind="buffer")
                for b in fam.buffers(shape)]  # fmt: skip

    value = {name: g.param(s, dtype, "value_model." + name) for name, s in value_params(critic.family, critic.shape)}
    value_cfg = replace(cfg, shape=critic.shape, stack=replace(cfg.stack, finetune=FULL))
    model = HFModel(value_cfg, critic.arch, value, buffers("value", critic.family, critic.shape))
    model.params = list(value.values())
    reward = {name: g.empty(s, dtype, "reward_model." + name, kind="weights")
              for name, s in value_params(critic.family, critic.shape)}  # fmt: skip
    scorer = HFModel(value_cfg, critic.arch, reward, buffers("reward", critic.family, critic.shape))
    reference = None
    if not cfg.finetune.lora:
        copy = {name: g.empty(s, dtype, "ref_policy." + name, kind="weights") for name, s in family.params(cfg.shape)}
        reference = HFModel(replace(cfg, stack=replace(cfg.stack, finetune=FULL)), arch, copy,
                            buffers("ref", family, cfg.shape))  # fmt: skip
    return model, scorer, reference


def decay_first(params: list[Tensor]) -> list[Tensor]:
    """Trainer.create_optimizer's groups: weight decay on all but biases and norms (get_decay_parameter_names), then
    those; AdamW makes each group's state and steps it in turn."""
    plain = [p for p in params if "norm" not in p.name and not p.name.endswith(".bias")]
    kept = {id(p) for p in plain}
    return plain + [p for p in params if id(p) not in kept]


def model_inputs(g: Graph, query_responses: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What forward() and get_reward hand a model: attention_mask = query_responses != pad_token_id, position_ids =
    attention_mask.cumsum(1) - attention_mask.long(), input_ids = query_responses.masked_fill(~attention_mask, 0)."""
    B, T = query_responses.shape
    with g.scoped("loss"):
        attention_mask = made(g, (B, T), "ne", query_responses, dtype="bool")
        counted = made(g, (B, T), "cumsum", attention_mask, dtype="int64")
        longs = made(g, (B, T), "_to_copy", attention_mask, dtype="int64")
        position_ids = made(g, (B, T), "sub", counted, longs, dtype="int64")
        del counted, longs
        padding = made(g, (B, T), "bitwise_not", attention_mask, dtype="bool")
        input_ids = made(g, (B, T), "masked_fill", query_responses, padding, dtype="int64")
        del padding
    return attention_mask, position_ids, input_ids


def run_backbone(g: Graph, model: HFModel, decoder: Callable, input_ids: Tensor, mask: Tensor,
                 position_ids: Tensor, use_cache: bool = True) -> Output:  # fmt: skip
    """A sequence-classification model's backbone (getattr(model, base_model_prefix)) with output_hidden_states, its
    cache as its config's use_cache has it, or none (get_reward passes use_cache=False)."""
    model.position_ids, model.mask, model.captured = position_ids, mask, []
    start(model)
    if not use_cache:
        model.cache = None
    decoder(g, model, input_ids, ())
    out = Output(model.cache, model.captured)
    model.cache = model.captured = model.position_ids = model.mask = None
    return out


def score_head(g: Graph, model: HFModel, hidden: Tensor) -> Tensor:
    """model.score(hidden_states[-1]): Linear(hidden, 1, bias=False), (B, T, 1)."""
    with g.scoped("value head"):
        return aten.linear(g, hidden, model.p["score.weight"], None, "score")


def run_causal_lm(g: Graph, m: HFModel, input_ids: Tensor, mask: Tensor, position_ids: Tensor,
                  causal_lm: Callable) -> tuple[Output, Tensor]:  # fmt: skip
    """A causal LM called with the mask, position_ids and output_hidden_states: its output (cache, hidden states)
    and its logits."""
    m.position_ids, m.mask, m.captured = position_ids, mask, []
    logits = causal_lm(g, m, input_ids, None, None)[1]
    output = Output(m.cache, m.captured)
    m.cache = m.captured = m.position_ids = m.mask = None
    return output, logits
