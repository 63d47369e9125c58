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


REPLAY = "memcalc.exact.replay.fsdp2_lora: FSDP2's hooks over PEFT's model replayed on memcalc.exact"
DEVICE = "cuda"  # the replay's kernels: CUDA's (on Llama's RMSNorm and without flash, the fake CPU group's alike)
PHASES = ("between steps", "forward peak", "backward peak", "optimizer peak")


def replayed(shape: ModelShape, seq_len: int, tricks: Tricks, stack, ranks: int) -> dict[str, int]:
    """The same step replayed (memcalc.exact.replay.fsdp2_lora) on CPU's kernels, as the fake group runs them."""
    from memcalc.exact.base.config import StepConfig
    from memcalc.exact.replay.meta import simulate
    from memcalc.exact.replay.zero import Sharding

    cfg = StepConfig(shape, seq_len, 1, tricks, stack, "adamw", 1, DEVICE)
    p = simulate(cfg, warm_up=True, sharding=Sharding(3, ranks, fsdp2=tricks.precision))[0]
    return dict(zip(PHASES, (p.state_bytes + p.inputs_bytes, p.forward_peak_bytes, p.backward_peak_bytes,
                             p.optimizer_peak_bytes)))  # fmt: skip


def verify_fsdp2_lora(model, setup, tricks: Tricks, layout):
    """`memcalc verify --fsdp N --lora R --stack fsdp2`: rank 0 of PEFT's model under FSDP2 on the fake process
    group against the replay, live bytes between steps and each phase's peak, every one judged to the byte."""
    import time

    from memcalc.errors import InputError
    from memcalc.model.params import n_params
    from memcalc.verification.dist_results import DistResult, RankCheck, RankRow

    s, ft = setup, setup.stack.finetune
    if not ft.lora or ft.quantize or s.micro_batch != 1 or s.grad_accum != 1 or s.stack.recipe != "pure":
        raise InputError("verify --fsdp N with --lora and --stack fsdp2 checks LoRA (not QLoRA or frozen parts) at "
                         "micro-batch 1 under --recipe pure (the base loaded in bf16, no autocast)")  # fmt: skip
    if tricks.flash or tricks.precision != "bf16":
        raise InputError("verify --fsdp N with --lora and --stack fsdp2 runs bf16 without flash: the fake process group "
                         "computes on fake CPU tensors, where the CUDA flash op's outputs are not CUDA's (one GPU on "
                         "meta checks flash: memcalc verify --lora R --recipe pure --device meta)")  # fmt: skip
    start = time.perf_counter()
    measured = measure_fsdp2_lora(model.shape, s.seq_len, tricks, ft, layout.dp)
    seconds = time.perf_counter() - start
    predicted = replayed(model.shape, s.seq_len, tricks, s.stack, layout.dp)
    rows = tuple(RankRow(q, predicted[q], measured[q], (), True, REPLAY) for q in PHASES)
    notes = ("PEFT's LoRA model under fully_shard per decoder layer and the root, MixedPrecisionPolicy(param_dtype, "
             "fp32), torch.optim.AdamW(fused=True) over the adapters, the Trainer's step; the fake process group, "
             "rank 0",)  # fmt: skip
    return DistResult(model.shape.name, n_params(model.shape), s.seq_len, 1, tricks, layout, "meta", "fake",
                      layout.world, (RankCheck(0, 0, 0, rows),), torch.__version__, seconds, notes)  # fmt: skip
