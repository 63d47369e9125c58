"""QLoRA's base: Transformers' linear projections as bitsandbytes' 4-bit layers, as a QLoRA script loads them.

    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.bfloat16)

transformers/integrations/bitsandbytes.py replace_with_bnb_linear makes every nn.Linear but the output layer a
bnb.nn.Linear4bit(in, out, bias, compute_dtype, compress_statistics=True, quant_type="nf4",
quant_storage=uint8); its Params4bit is quantised as it is moved to the device (bitsandbytes 0.50
nn/modules.py Params4bit._quantize: functional.quantize_4bit). On meta the library's fake kernels give every
tensor its shape (bitsandbytes/_ops.py register_fake), so quantisation runs there too.

One switch makes meta run what CUDA runs: a training step's micro-batch has more than 1,536 tokens, where
bitsandbytes' CUDA gemm_4bit takes its unfused path (backends/cuda/ops.py _gemm_4bit_custom_max_m,
_dequant_linear_fallback): the nested absmax dequantised into an fp32 buffer, plus the offset, the weight
dequantised into a buffer of the input's dtype, then F.linear; on meta the op's fake kernel allocates its output
alone. cuda_gemm_4bit() runs the fallback's allocations in its place. Its backward (autograd/_functions.py
MatMul4Bit.backward: functional.dequantize_4bit, then matmul) runs alike everywhere.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch import nn

from memcalc.model.finetune import ALL_PROJECTIONS

from .recipes import bitsandbytes


def quantized(model: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """replace_with_bnb_linear over the blocks' projections, each quantised on the device (nf4, double
    quantisation, blocksize 64, the compute dtype the model's)."""
    bnb = bitsandbytes()
    maps = bnb.functional.name2qmap
    if "dynamic" in maps and maps["dynamic"].device.type != device:  # as a process on this device alone makes it
        maps["dynamic"] = bnb.functional.create_dynamic_map().to(device)
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in ALL_PROJECTIONS or not isinstance(module, nn.Linear):  # the blocks' projections
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        new = bnb.nn.Linear4bit(module.in_features, module.out_features, module.bias is not None, dtype,
                                compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                device="meta")  # fmt: skip
        new.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", quant_storage=torch.uint8, blocksize=64, module=new)  # fmt: skip
        new.weight._quantize(torch.device(device))
        if module.bias is not None:
            new.bias = nn.Parameter(module.bias.data, requires_grad=module.bias.requires_grad)
        new.train(module.training)
        setattr(parent, leaf, new)
        del module
    model.is_loaded_in_4bit = model.is_quantized = True  # quantizer_bnb_4bit.py, quantizers/base.py: PEFT reads them
    return model


def quant_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What a 4-bit weight keeps beside its packed data (functional.QuantState): absmax (uint8 under double
    quantisation), the 4-bit code, the offset, the nested state's fp32 absmax and its copy of the dynamic map; and
    the map itself (functional.name2qmap, made on the device by the first quantisation): the device holds them,
    though they are neither parameters nor buffers."""
    from bitsandbytes.functional import name2qmap

    out = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        out += [state.absmax, state.code, state.offset]
        if state.state2 is not None:
            out += [state.state2.absmax, state.state2.code]
    if not out:  # no 4-bit layer: the map, made for another model, is not this one's
        return out
    device = next(model.parameters()).device
    return out + [t for t in name2qmap.values() if t.device == device]


def dequant_linear(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                   absmax_offset=None):  # fmt: skip
    """backends/cuda/ops.py _dequant_linear_fallback's allocations, its dequantisations left out (meta has no values,
    and bitsandbytes' fake for dequantize_4bit.out compares a torch.Size with a list, so it refuses every call):
    absmax_dq = empty_like(absmax_8bit, fp32); absmax = absmax_dq + absmax_offset; B_dq = empty(shapeB, A.dtype);
    F.linear(A, B_dq, bias). absmax lives until the function returns, as CUDA's local does."""
    if absmax_8bit is not None:
        absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
        absmax = absmax_dq + absmax_offset  # noqa: F841  (what CUDA dequantises the weight with)
    B_dq = torch.empty(shapeB, dtype=A.dtype, device=A.device)
    return torch.nn.functional.linear(A, B_dq, bias)


@contextlib.contextmanager
def cuda_gemm_4bit():
    """While active (a meta run: verify/meta.py paths_for), MatMul4Bit's torch.ops.bitsandbytes.gemm_4bit.default
    is CUDA's unfused path, called as Python so that the tracker sees each of its ops (as a registered kernel, the
    op would be one allocation of its output). Only on meta: the dispatcher looks the op up by this name, which
    CPU's kernels then would not find."""
    ns = torch.ops.bitsandbytes
    saved = ns.gemm_4bit
    ns.gemm_4bit = SimpleNamespace(default=dequant_linear)
    try:
        yield
    finally:
        ns.gemm_4bit = saved
