"""FSDP2 over PEFT's LoRA model, one rank on PyTorch's fake process group, every phase's peak (issue 40).

accelerate's fsdp2_prepare_model (accelerate/utils/fsdp_utils.py): fully_shard on each decoder layer, then on
the whole model, MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32); the model Transformers built in the trick
set's dtype and PEFT wrapped (verify/hf.py build_hf, verify/lora.py); torch.optim.AdamW(fused=True) over what
requires grad (the adapters); the Trainer's step: forward, backward, optimizer.step, zero_grad(set_to_none).
Live bytes are counted on fake tensors, FSDP2's storage resizes included (verify/dist_measure.py).
memcalc.exact.replay.fsdp2_lora replays the same step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from memcalc.model.finetune import Finetune
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks

from .dist_measure import CountingFakeMode, count_resizes, storage_bytes, to_fake
from .hf import build_hf
from .recipes import DTYPES


def measure_fsdp2_lora(shape: ModelShape, seq_len: int, tricks: Tricks, finetune: Finetune, ranks: int) -> dict:
    """Rank 0 of `ranks`: live bytes between steps (after two steps) and the third step's phase peaks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        mesh = init_device_mesh("cpu", (ranks,))
        trainer_model = build_hf(shape, tricks, seq_len, finetune=finetune)
        peft_model = trainer_model.model
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[tricks.precision], reduce_dtype=torch.float32)
        for layer in peft_model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(peft_model, mesh=mesh, mp_policy=mp)
        return measured(trainer_model, shape, seq_len)
    finally:
        dist.destroy_process_group()


def measured(model, shape: ModelShape, seq_len: int) -> dict:
    mode = CountingFakeMode()
    with count_resizes(mode):
        to_fake(model, mode)
        with mode:
            idx = torch.randint(0, shape.vocab, (1, seq_len))  # two tensors, as memcalc.exact.replay.meta's inputs
            targets = torch.randint(0, shape.vocab, (1, seq_len))
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, fused=True)
            trainer_step(model, optimizer, idx, targets, mode)
            trainer_step(model, optimizer, idx, targets, mode)
            between = mode.live_bytes
            peaks = trainer_step(model, optimizer, idx, targets, mode)
            out = {"between steps": between, "weights": storage_bytes(model.parameters())}
    return out | {f"{phase} peak": peak for phase, peak in peaks.items()}


def trainer_step(model, optimizer, idx, targets, mode: CountingFakeMode) -> dict[str, int]:
    """Transformers' Trainer: forward and loss, backward, optimizer.step, model.zero_grad (set_to_none)."""
    peaks = {}
    mode.reset_peak("forward")
    loss = model(idx, targets)
    peaks["forward"] = mode.peak_bytes
    mode.reset_peak("backward")
    loss.backward()
    del loss
    peaks["backward"] = mode.peak_bytes
    mode.reset_peak("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peaks["optimizer"] = mode.peak_bytes
    return peaks
