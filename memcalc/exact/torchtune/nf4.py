"""torchao's NF4Tensor, the frozen base of torchtune's QLoRA, in bytes on memcalc.exact.sim.graph: its storage and
linear_nf4 (torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py in torchao 0.18, the installed one; the same
code as torchao/dtypes/nf4tensor.py, where torchtune 0.6.1 imports it from).

Storage (NF4Tensor.from_tensor, block_size 64, scaler_block_size 256, to_nf4's defaults) of a weight of n elements in
the model's dtype: quantized_data, n/2 uint8 (two 4-bit codes a byte); quantized_scalers, n/64 int8 (each block's
absmax less their mean, quantised per 256 blocks: double_quantize_scalers); quantization_factor, n/64/256 in the
weight's dtype; scaler_mean, one scalar of it; nf4, the 16-entry code in it. torchtune's FrozenNF4Linear and
LoRALinear(quantize_base=True) hold one each (torchtune/modules/low_precision/nf4_linear.py, modules/peft/lora.py).

Compute: linear_nf4 is LinearNF4, a custom autograd Function that saves the NF4 weight itself (no activation) and
runs F.linear(input, weight.to(input.dtype)); .to(dtype) is get_original_weight(): both halves of each byte to int64
indices (8 bytes an element), each looked up in the code, the scalers dequantised, repeated (a clone) and
multiplied, then stacked into the weight: about 14 bytes an element at once, freed as it returns. Backward
dequantises again for grad_output @ weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor

BLOCK = 64  # to_nf4(block_size=64)
SCALER_BLOCK = 256  # to_nf4(scaler_block_size=256)
CODE = 16  # the nf4 lookup table


@dataclass
class NF4Weight:
    """One NF4Tensor: its inner tensors (__tensor_flatten__'s) and the (out, in) shape it stands for."""

    data: Tensor  # quantized_data: the frozen parameter as named_parameters() lists it
    scalers: Tensor
    factor: Tensor
    mean: Tensor
    code: Tensor
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def to_nf4(g: Graph, name: str, shape: tuple, dtype: str) -> NF4Weight:
    """NF4Tensor.from_tensor's inner tensors for a weight of that (out, in) shape and dtype (int8 scalers are
    counted as uint8: one byte each either way)."""
    n = int(shape[0]) * int(shape[1])
    data = g.empty((n // 2,), "uint8", "param " + name, kind="param")
    data.name = name
    inner = [g.empty(s, d, "nf4 " + name, kind="param") for s, d in (
        ((n // BLOCK,), "uint8"), ((n // BLOCK // SCALER_BLOCK,), dtype), ((), dtype), ((CODE,), dtype))]  # fmt: skip
    return NF4Weight(data, *inner, (int(shape[0]), int(shape[1])))


def nf4_bytes(rows: int, cols: int, itemsize: int = 2) -> int:
    """One weight's NF4Tensor bytes (to_nf4's storage above)."""
    n = rows * cols
    return n // 2 + n // BLOCK + itemsize * (n // BLOCK // SCALER_BLOCK + 1 + CODE)


def original_weight(g: Graph, w: NF4Weight) -> Tensor:
    """NF4Tensor.get_original_weight: (data >> 4).to(long), (data & 0b1111).to(long), nf4[each], the scalers
    dequantised ((int8 view / factor.unsqueeze(-1)).flatten() + scaler_mean), repeated.flatten() (a clone) times
    each half, both stacked and reshaped to the weight: its locals die as it returns the stacked one."""
    half, dt = w.numel // 2, w.code.dtype
    shifted = made(g, (half,), "__rshift__", w.data, dtype="uint8")
    first_elements = made(g, (half,), "_to_copy", shifted, dtype="int64")
    del shifted
    masked = made(g, (half,), "bitwise_and", w.data, dtype="uint8")
    second_elements = made(g, (half,), "_to_copy", masked, dtype="int64")
    del masked
    dequantized_first = made(g, (half,), "index", w.code, first_elements, dtype=dt)
    dequantized_second = made(g, (half,), "index", w.code, second_elements, dtype=dt)
    quotient = made(g, w.scalers.shape, "div", w.scalers, w.factor, dtype=dt)
    scalers = made(g, w.scalers.shape, "add", quotient, w.mean, dtype=dt)
    del quotient
    repeated = made(g, (half,), "clone", scalers, dtype=dt)  # repeated.flatten(): an expand cannot view
    scaled_first = made(g, (half,), "mul", dequantized_first, repeated, dtype=dt)
    del repeated
    repeated = made(g, (half,), "clone", scalers, dtype=dt)
    scaled_second = made(g, (half,), "mul", dequantized_second, repeated, dtype=dt)
    del repeated
    weight = made(g, w.shape, "stack", scaled_first, scaled_second, dtype=dt)  # .reshape(self.shape): a view
    del first_elements, second_elements, dequantized_first, dequantized_second, scalers, scaled_first, scaled_second
    return weight


def linear_nf4(g: Graph, x: Tensor, w: NF4Weight) -> Tensor:
    """LinearNF4.apply(input, weight): forward F.linear(input, weight.to(input.dtype)) under no grad (w.t(), the
    input folded to 2-D, mm, viewed back), saving the NF4 weight; backward grad_output @ weight.to(grad.dtype)."""
    N, K = w.shape
    lead = x.shape[:-1]
    rows = math.prod(int(d) for d in lead)
    flops = 2 * rows * N * K

    def rule(gs):
        grad = gs[0]
        weight = original_weight(g, w)
        da = g.empty(lead + (K,), grad.dtype, "mm")  # matmul: grad viewed 2-D, mm, _unsafe_view
        g.kernel("mm", (grad, weight), (da,), "tensor", flops, "linear", dtype=grad.dtype)
        del weight
        return [da]

    node = g.begin("LinearNF4", [x], rule)
    weight = original_weight(g, w)
    out = g.empty(lead + (N,), x.dtype, "mm")
    g.kernel("mm", (x, weight), (out,), "tensor", flops, "linear", dtype=x.dtype)
    del weight
    g.end(node, [out])
    return out
