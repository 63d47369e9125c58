"""TRL 1.3-1.12's PPOTrainer (trl.experimental.ppo, --rl ppo) as itself, whichever release is first on the path:
PPOTrainer.train() run for its updates on real CPU tensors, every allocation watched (verify/track.py LiveBytes), the
trainer's own regions marked where its code calls out: batch_generation (the rollout, then its scoring), the PPO
epoch's shuffle, each micro-batch's accumulate(), accelerator.backward, the optimizer's step and zero_grad, and the
empty_cache() after each mini-batch's `del`. memcalc.exact.hf.ppo and ppo_rollout replay the same;
tests/test_ppo.py sets them side by side.

The recipe is TRL's examples/scripts/ppo/ppo.py: a causal LM policy and its reference, a value model and a reward
model (AutoModelForSequenceClassification, num_labels 1) of the policy's architecture or the critic's, loaded in one
dtype; the trainer's Accelerator is built without mixed_precision (Transformers 5's TrainingArguments no longer sets
ACCELERATE_MIXED_PRECISION): nothing autocasts. The pad token is outside the vocabulary and no stop token is set, so
every prompt and response position is real (the most a step holds) and each response is response_length long. The
dataset holds three batches, so that the update's is not the loader's last (Accelerate syncs, and so steps, at every
micro-batch of the last).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field

import torch

from memcalc.model.finetune import FULL, Finetune
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks

from .hf import DTYPES, attention_for, hf_config, register_attention
from .lora import lora_config
from .track import LiveBytes


@dataclass
class PpoRun:
    """One update's watched allocations and where the trainer's regions begin."""

    live: LiveBytes
    marks: list[tuple[str, int, int]] = field(default_factory=list)  # (region, timeline index, live bytes)

    def mark(self, what: str) -> None:
        self.live.phase = what
        self.marks.append((what, len(self.live.timeline), self.live.live_bytes))

    def region(self, start: str, nth: int, end: str) -> tuple[int, int, int]:
        """The timeline from the nth mark `start` to the first `end` after it: (first index, last index, live
        bytes at the start)."""
        starts = [m for m in self.marks if m[0] == start]
        _, first, base = starts[nth]
        last = next(i for what, i, _ in self.marks if what == end and i > first)
        return first, last, base


def models(shape: ModelShape, seq_len: int, tricks: Tricks, critic: ModelShape | None = None):
    """The policy, its reference, the value and reward models (critic's architecture, else the policy's) as the
    example loads them, in the trick set's dtype, with the trick set's attention, in training mode."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    register_attention()
    config = hf_config(shape, seq_len, use_cache=True)  # every config's default: PPO's forward passes none
    config.bos_token_id = 1  # a begin token, as a checkpoint's config has (generate makes a tensor of it)
    scoring = hf_config(critic or shape, seq_len, use_cache=True)
    scoring.num_labels = 1
    kwargs = dict(dtype=DTYPES[tricks.precision], attn_implementation=attention_for(tricks, "cpu"))
    torch.manual_seed(0)
    return (AutoModelForCausalLM.from_config(config, **kwargs), AutoModelForCausalLM.from_config(config, **kwargs),
            AutoModelForSequenceClassification.from_config(scoring, **kwargs),
            AutoModelForSequenceClassification.from_config(scoring, **kwargs))  # fmt: skip


class Tokens:
    """The processing class the trainer reads: a pad token past the vocabulary (no position is padding), an end
    token no sample can be; padding stacks equal-length prompts."""

    def __init__(self, vocab: int):
        self.pad_token_id, self.eos_token_id = vocab, vocab + 1

    def __call__(self, features: list[dict]) -> dict:
        return {"input_ids": torch.tensor([f["input_ids"] for f in features])}

    def save_pretrained(self, *args, **kwargs) -> None:
        pass


def run_ppo(shape: ModelShape, seq_len: int, completion: int, micro_batch: int, grad_accum: int, tricks: Tricks,
            finetune: Finetune = FULL, critic: ModelShape | None = None, rollout_batch: int = 64, epochs: int = 2,
            updates: int = 1) -> PpoRun:  # fmt: skip
    """One update of PPOTrainer.train() (total_episodes = micro_batch x grad_accum: one rollout, `epochs` PPO epochs
    of one mini-batch), watched from the moment train() is called. finetune: LoRA as PPOTrainer applies it (its
    peft_config: the policy alone wrapped, no reference model passed, the policy's disabled adapters in its place);
    critic: the value and reward models' shape (--critic)."""
    from datasets import Dataset
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trainer_module

    policy, ref, value, reward = models(shape, seq_len, tricks, critic)
    tokens = Tokens(shape.vocab)
    prompt = seq_len - completion
    rows = micro_batch * grad_accum
    data = Dataset.from_dict({"input_ids": [[1 + (i + j) % (shape.vocab - 1) for j in range(prompt)]
                                           for i in range((updates + 2) * rows)]})  # fmt: skip
    args = PPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "memcalc-ppo"),
                     per_device_train_batch_size=micro_batch, gradient_accumulation_steps=grad_accum,
                     num_ppo_epochs=epochs, num_mini_batches=1, response_length=completion,
                     local_rollout_forward_batch_size=rollout_batch, total_episodes=rows * updates, use_cpu=True,
                     bf16=tricks.precision == "bf16", report_to=[], num_sample_generations=0, save_strategy="no",
                     logging_steps=1, disable_tqdm=True)  # fmt: skip
    peft_config = lora_config(policy.config.model_type, finetune) if finetune.lora else None
    ppo = PPOTrainer(args=args, processing_class=tokens, model=policy, ref_model=None if peft_config else ref,
                     reward_model=reward, value_model=value, train_dataset=data, data_collator=tokens,
                     peft_config=peft_config)  # fmt: skip
    run = PpoRun(LiveBytes("cpu", timeline=True))
    held = [] if peft_config else list(ref.parameters()) + list(ref.buffers())
    del ref
    run.live.track(list(ppo.model.parameters()) + list(ppo.model.buffers()) + held + list(reward.parameters()) +
                   list(reward.buffers()))  # fmt: skip
    with marked(run, ppo, trainer_module), run.live:
        ppo.train()
    return run


@contextlib.contextmanager
def marked(run: PpoRun, ppo, module):
    """The trainer's regions marked as its code reaches them (each patch restored after)."""
    accelerator, optimizer = ppo.accelerator, ppo.optimizer
    shuffle, accumulate, backward = module.np.random.permutation, accelerator.accumulate, accelerator.backward
    step, zero_grad, empty_cache = optimizer.step, optimizer.zero_grad, module.empty_cache
    generate = module.batch_generation

    def generation(*args, **kwargs):
        run.mark("rollout")
        out = generate(*args, **kwargs)
        run.mark("scoring")
        return out

    def permutation(n):
        run.mark("epoch")
        return shuffle(n)

    @contextlib.contextmanager
    def accumulating(model):
        run.mark("forward")
        with accumulate(model):
            yield

    def backwards(loss, **kwargs):
        run.mark("backward")
        backward(loss, **kwargs)

    def stepped(*args, **kwargs):
        run.mark("optimizer")
        return step(*args, **kwargs)

    def zeroed(*args, **kwargs):
        zero_grad(*args, **kwargs)
        run.mark("metrics")

    def emptied():
        run.mark("emptied")
        empty_cache()

    module.np.random.permutation, module.empty_cache, module.batch_generation = permutation, emptied, generation
    accelerator.accumulate, accelerator.backward = accumulating, backwards
    optimizer.step, optimizer.zero_grad = stepped, zeroed
    try:
        yield
    finally:
        module.np.random.permutation, module.empty_cache, module.batch_generation = shuffle, empty_cache, generate
        del accelerator.accumulate, accelerator.backward, optimizer.step, optimizer.zero_grad
