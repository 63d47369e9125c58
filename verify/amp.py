"""Accelerate's native AMP as the Trainer runs it (Accelerator.prepare_model), written out: Accelerate is not a
dependency here (tests/test_stack_amp.py holds it to Accelerate itself where it is installed)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def amp_forward(model, device_type: str, dtype: torch.dtype):
    """The Trainer trains through Accelerate (trainer.py autocast_smart_context_manager: "We rely on
    accelerate for autocast"): accelerate 1.15.0 accelerator.py Accelerator.prepare_model, with native
    AMP, makes model.forward = convert_outputs_to_fp32(torch.autocast(device_type, dtype)(forward)).
    So the forward runs under autocast (the region, and its cache of weight casts, ends when it
    returns) and every fp16/bf16 tensor of its output is then converted .float() (utils/operations.py
    convert_to_fp32, recursively_apply: a Mapping rebuilt as type(data)({k: ...})): the logits, one
    fp32 copy, made while the 16-bit logits are still held. Accelerate is not a dependency here, so
    these two wrappers are written out as it writes them. model: the module, or its forward (which
    prepare_model replaces on the module: verify/trl_dpo.py)."""

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            outputs = model(*args, **kwargs)
        return convert_to_fp32(outputs)

    return forward


def convert_to_fp32(data):
    """accelerate/utils/operations.py convert_to_fp32 (recursively_apply, _is_fp16_bf16_tensor)."""
    if isinstance(data, (tuple, list)):
        return type(data)(convert_to_fp32(o) for o in data)
    if isinstance(data, Mapping):
        return type(data)({k: convert_to_fp32(v) for k, v in data.items()})
    if isinstance(data, torch.Tensor) and data.dtype in (torch.float16, torch.bfloat16):
        return data.float()
    return data
