"""TRL 1.16's GRPOTrainer generating without vLLM, measured: the policy's model.generate over the generation batch as
_generate_single_turn calls it (its GenerationConfig from GRPOConfig's defaults, gradient checkpointing off,
torch.no_grad(), the model in training mode), on CPU tensors at reduced size under verify/track.py's LiveBytes. Every
row runs to max_new_tokens: the end-of-sequence token is kept out of the sample (a hook on the head fills its logit
with a large negative, in place: nothing allocated), as memcalc.exact.hf.generate takes it.
"""

from __future__ import annotations

import tempfile
import warnings

import torch

from memcalc.model.finetune import FULL, Finetune
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks

from .hf import build_hf, cuda_dropout
from .track import LiveBytes

PAD, BOS, EOS = 0, 1, 2  # the tokenizer's special tokens: any ids the prompts do not use


def generation_config(completion_len: int):
    """GRPOTrainer.__init__'s GenerationConfig for use_vllm False (trl/trainer/grpo_trainer.py), from GRPOConfig's
    defaults."""
    from transformers import GenerationConfig
    from trl import GRPOConfig

    with warnings.catch_warnings():  # TrainingArguments' note on its deprecated gradient_checkpointing field
        warnings.simplefilter("ignore", FutureWarning)
        args = GRPOConfig(output_dir=tempfile.gettempdir(), report_to=[], use_cpu=True, bf16=False,
                          max_completion_length=completion_len)
    return GenerationConfig(max_new_tokens=completion_len, do_sample=True, pad_token_id=PAD, bos_token_id=BOS,
                            eos_token_id=[EOS], temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            cache_implementation=args.cache_implementation, disable_compile=True)  # fmt: skip


def measure_generate(shape: ModelShape, tricks: Tricks, rows: int, prompt_len: int, completion_len: int,
                     finetune: Finetune = FULL, autocast: bool = False,
                     timeline: bool = False) -> LiveBytes:  # fmt: skip
    """model.generate's live bytes on CPU tensors: the peak above the model, the prompts included."""
    torch.manual_seed(0)
    model = build_hf(shape, tricks, prompt_len + completion_len, device="cpu", autocast="cpu" if autocast else None,
                     finetune=finetune, trl="1.16", use_cache=True).model  # fmt: skip
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    base_model.set_attn_implementation("sdpa")  # as loaded (verify's own name forces the flash kernel in training)
    eos = torch.tensor([EOS])  # the end-of-sequence token never drawn: its logit filled in place, nothing made
    model.get_output_embeddings().register_forward_hook(lambda mod, args, out: out.index_fill_(-1, eos, -1e4))
    config = generation_config(completion_len)
    live = LiveBytes("cpu", timeline=timeline)
    live.track(list(model.parameters()) + list(model.buffers()))
    base = live.live_bytes
    with live, torch.no_grad(), cuda_dropout():  # F.dropout as CUDA runs it (LoRA's, in training mode)
        ids = torch.randint(EOS + 1, shape.vocab, (rows, prompt_len))
        mask = torch.ones_like(ids)
        live.reset_peak()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.shape == (rows, prompt_len + completion_len), out.shape
        del out, ids, mask
    live.base = base
    return live
