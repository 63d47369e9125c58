"""QLoRA's 4-bit base, op by op in bytes on memcalc.exact.sim.graph: bitsandbytes 0.50's Linear4bit (nf4, double
quantisation) under PEFT's LoRA, as verify/qlora.py builds it.

Storage (bitsandbytes/functional.py quantize_4bit, compress_statistics=True): per weight of N·K elements the
packed data, ceil(N·K/2) uint8 as ((N·K+1)//2, 1); absmax of each 64-element block quantised to uint8 (n/64
bytes) with its nested state: an fp32 absmax per 256 blocks and its own copy of the 256-entry fp32 dynamic map
(quantize_blockwise: code.to(device, copy=True)), an fp32 offset (the absmax's mean); the 16-entry fp32 nf4
code (get_4bit_type, one per weight); and once, the dynamic map itself (name2qmap["dynamic"]).

Compute: nn/modules.py Linear4bit.forward casts x to the compute dtype and calls autograd/_functions.py
MatMul4Bit, a custom autograd Function (nothing saved through save_for_backward: the packed weight is kept on
ctx). Its forward on CUDA, past 1,536 tokens a micro-batch (backends/cuda/ops.py _gemm_4bit_custom_max_m),
is _dequant_linear_fallback: the absmax dequantised into an fp32 buffer, plus the offset, the weight into a
buffer of x's dtype, F.linear; its backward dequantises again (functional.dequantize_4bit) and multiplies.
PEFT's peft/tuners/lora/bnb.py Linear4bit.forward clones the base's output, and casts the adapters' input and
output where autocast is off (torch.is_autocast_enabled(), which asks CUDA's: on CPU always).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.model.finetune import ALL_PROJECTIONS

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .lora import adapter

if TYPE_CHECKING:
    from .family import HFModel

BLOCK = 64  # Params4bit's blocksize (bitsandbytes/nn/modules.py)
NESTED_BLOCK = 256  # quantize_4bit's quantize_blockwise(_absmax - offset, blocksize=256)
CODE = 16  # entries of the nf4 code (get_4bit_type)
DYNAMIC = 256  # entries of the dynamic map the nested absmax is quantised with (create_dynamic_map)
MAX_FUSED_TOKENS = 1536  # CUDA's gemm_4bit takes its unfused path past this many rows (_gemm_4bit_custom_max_m)


@dataclass
class QuantWeight:
    """One 4-bit weight as the device holds it (functional.QuantState), and its (out, in) shape."""

    data: Tensor
    absmax: Tensor
    absmax2: Tensor
    code2: Tensor
    code: Tensor
    offset: Tensor
    shape: tuple[int, int]

    @property
    def blocks(self) -> int:
        return math.ceil(self.shape[0] * self.shape[1] / BLOCK)


def quantized(name: str, quantize: str) -> bool:
    """Whether replace_with_bnb_linear makes this parameter 4-bit: every projection of the blocks (not lm_head)."""
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    return bool(quantize) and name.endswith(".weight") and leaf in ALL_PROJECTIONS  # not lm_head


def quantize(g: Graph, name: str, shape: tuple) -> QuantWeight:
    """Params4bit._quantize's result: the packed data (a frozen parameter) and its QuantState."""
    n = int(shape[0]) * int(shape[1])
    blocks = math.ceil(n / BLOCK)
    data = g.empty(((n + 1) // 2, 1), "uint8", "param " + name, kind="param")
    data.name = name
    state = [g.empty(s, d, "quant_state " + name, kind="param") for s, d in (
        ((blocks,), "uint8"), ((math.ceil(blocks / NESTED_BLOCK),), "fp32"), ((DYNAMIC,), "fp32"), ((CODE,), "fp32"),
        ((), "fp32"))]  # fmt: skip
    return QuantWeight(data, *state, (int(shape[0]), int(shape[1])))


def dynamic_map(g: Graph) -> Tensor:
    """functional.name2qmap["dynamic"]: made once, on the device of the first nested quantisation."""
    return g.empty((DYNAMIC,), "fp32", "quant_state dynamic map", kind="param")


def linear4bit(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """Linear4bit.forward: x.to(compute_dtype) (the model's dtype), matmul_4bit, .to(the input's dtype)."""
    inp_dtype = x.dtype
    x = aten.to(g, x, m.cfg.precision)
    out = matmul_4bit(g, x, m.quant[name], m.p.get(name + ".bias"), m.cfg.device == "cuda")
    return aten.to(g, out, inp_dtype)


def matmul_4bit(g: Graph, x: Tensor, q: QuantWeight, bias: Tensor | None, cuda: bool = True) -> Tensor:
    """MatMul4Bit.apply(x, packed weight, bias): forward _dequant_linear_fallback (CUDA), backward grad_x = grad
    @ dequantize_4bit(weight) (no gradient for the frozen weight and bias). On CPU tensors the forward is one
    custom op, backends/default/ops.py _gemm_4bit_default_impl, whose dequantised absmax and weight are made
    inside it, below the dispatcher where verify's tracker sees only its output (what CUDA adds: cuda_only)."""
    N, K = q.shape
    lead = x.shape[:-1]
    rows = math.prod(int(d) for d in lead)
    flops = 2 * rows * N * K

    def rule(gs):
        grad = gs[0]
        w = dequantize_4bit(g, q, grad.dtype)
        da = g.empty(lead + (K,), grad.dtype, "mm")  # torch.matmul(grad, w): folded to 2-D, mm, viewed back
        g.kernel("mm", (grad, w), (da,), "tensor", flops, "linear", dtype=grad.dtype)
        del w
        return [da]

    node = g.begin("MatMul4Bit", [x], rule)
    if not cuda:
        out = g.empty(lead + (N,), x.dtype, "gemm_4bit")
        g.kernel("gemm_4bit", (x, q.data) if bias is None else (bias, x, q.data), (out,), "tensor", flops, "linear",
                 dtype=x.dtype)  # fmt: skip
        g.end(node, [out])
        return out
    absmax_dq = g.empty((q.blocks,), "fp32", "empty_like")  # torch.empty_like(absmax_8bit, dtype=fp32)
    g.kernel("dequantize_blockwise", (q.absmax, q.absmax2, q.code2), (absmax_dq,))
    absmax = made(g, (q.blocks,), "add", absmax_dq, q.offset)  # absmax_dq + absmax_offset
    w = g.empty((N, K), x.dtype, "empty")  # B_dq = torch.empty(shapeB, dtype=A.dtype)
    g.kernel("dequantize_4bit", (q.data, absmax), (w,))
    op = "mm" if bias is None else "addmm"  # F.linear(A, B_dq, bias) on the fold
    out = g.empty(lead + (N,), x.dtype, op)
    g.kernel(op, (x, w) if bias is None else (bias, x, w), (out,), "tensor", flops, "linear", dtype=x.dtype)
    del absmax, absmax_dq, w  # the fallback's locals, in order
    g.end(node, [out])
    return out


def dequantize_4bit(g: Graph, q: QuantWeight, dtype: str) -> Tensor:
    """functional.dequantize_4bit: absmax = dequantize_blockwise(absmax, state2) (fp32, one per 64-block);
    absmax += offset (in place); the weight dequantised (N, K) in the state's dtype; absmax dies as it returns."""
    absmax = made(g, (q.blocks,), "dequantize_blockwise", q.absmax, q.absmax2, q.code2)
    g.kernel("add_", (absmax, q.offset), (absmax,))
    return made(g, q.shape, "dequantize_4bit", q.data, absmax, dtype=dtype)


def lora_linear4bit(g: Graph, m: HFModel, name: str, x: Tensor) -> Tensor:
    """peft/tuners/lora/bnb.py Linear4bit.forward: result = base_layer(x).clone(); where autocast is off
    (torch.is_autocast_enabled(): CUDA's region; never on CPU) x cast to lora_A's dtype and the adapters'
    output cast back; result = result + lora_B(lora_A(dropout(x))) * scaling."""
    result = linear4bit(g, m, name, x)
    result = aten.reshape_copy(g, result, result.shape)  # result.clone()
    a, b = m.p[name + ".lora_A.weight"], m.p[name + ".lora_B.weight"]
    requires_conversion = m.cfg.device == "cpu" or g.autocast is None
    expected_dtype = result.dtype
    if requires_conversion:
        x = aten.to(g, x, a.dtype)
    output = adapter(g, x, a, b, m.cfg.finetune.lora_dropout)
    if requires_conversion:
        output = aten.to(g, output, expected_dtype)
    result = aten.add(g, result, output)
    del x, output
    return result
