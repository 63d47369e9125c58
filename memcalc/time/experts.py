"""A mixture of experts' GEMMs against the roofline: few tokens per expert make them memory-bound.

A dense MLP multiplies all T tokens by its weights; a routed expert gets T·k/E of them (balanced). Its
GEMM (t x h) @ (h x f) does 2·t·h·f FLOPs and moves its weights, h·f elements, whatever t is: the
arithmetic intensity is t·h·f / (t·h + h·f + t·f) FLOPs per element, about t when t is small against h
and f. Below the GPU's ridge point (its matmul rate over its HBM rate: 260 FLOPs/byte on an H100 at
memcalc's calibrated efficiencies) the GEMM waits on memory (Williams et al. 2009). A grouped GEMM
(one kernel for every expert, torch._grouped_mm, Megatron's GroupedMLP) saves the launches, not the
weight traffic: it is as memory-bound as its experts.
"""

from __future__ import annotations

import math

from memcalc.model.gpus import GPU
from memcalc.model.moe import BALANCED, Routing, routed_tokens
from memcalc.model.shape import ModelShape
from memcalc.records import record

from .calibration import ANCHOR_DIM, Calibration
from .roofline import byte_rate, flop_rate


@record(slots=True)
class Gemm:
    """(m x k) @ (k x n) in a 16-bit or 32-bit dtype, each operand read once and the result written once."""

    name: str
    m: int
    k: int
    n: int
    itemsize: int
    count: int  # how many such GEMMs a layer's forward runs (E experts)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def bytes(self) -> int:
        return self.itemsize * (self.m * self.k + self.k * self.n + self.m * self.n)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


@record(slots=True)
class GemmTime:
    """One GEMM's time on a GPU: the larger of its compute and memory times, at least the launch floor."""

    gemm: Gemm
    ridge: float  # FLOPs per byte where the two roofs meet
    compute_seconds: float
    memory_seconds: float
    launch_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds, self.launch_seconds)

    @property
    def bound(self) -> str:
        """compute or memory by the roofs (the launch floor apart: a grouped GEMM launches once)."""
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    @property
    def grouped_seconds(self) -> float:
        """All count GEMMs as one grouped kernel: their FLOPs and bytes summed, one launch."""
        n = self.gemm.count
        return max(n * self.compute_seconds, n * self.memory_seconds, self.launch_seconds)


def expert_gemms(shape: ModelShape, tokens: int, precision: str, routing: Routing = BALANCED) -> list[Gemm]:
    """A MoE layer's forward GEMMs: each routed expert's on its share of the routed tokens (gate and up,
    h -> f; down, f -> h), and the router's over every token (h -> E)."""
    w = 4 if precision == "fp32" else 2
    E, h, f = shape.n_experts, shape.hidden, shape.routed_ffn
    t = math.ceil(routed_tokens(shape, tokens, routing) / E)
    inputs = 2 if shape.gated_mlp else 1
    return [
        Gemm("gate/up, h->f" if inputs == 2 else "fc, h->f", t, h, f, w, inputs * E),
        Gemm("down, f->h", t, f, h, w, E),
        Gemm("router, h->E", tokens, h, E, 4 if shape.router_fp32 else w, 1),
    ]


def gemm_time(g: Gemm, precision: str, gpu: GPU, cal: Calibration) -> GemmTime:
    """Williams et al. 2009: t = max(FLOPs / (efficiency · peak), bytes / (efficiency · bandwidth), floor)."""
    dtype = "fp32" if g.itemsize == 4 else precision
    dim = 3 / (1 / g.m + 1 / g.k + 1 / g.n) if g.m else float(ANCHOR_DIM)  # as roofline.matmul_dim
    rate, moved = gpu.peak_flops(dtype) * cal.matmul_share(dim), byte_rate(gpu, cal)
    return GemmTime(g, rate / moved, g.flops / rate, g.bytes / moved, cal.launch_seconds)


def compute_bound_tokens(shape: ModelShape, precision: str, gpu: GPU, cal: Calibration) -> int:
    """The fewest tokens per expert at which its gate/up GEMM reaches the ridge (compute-bound)."""
    w = 4 if precision == "fp32" else 2
    ridge = flop_rate("tensor", precision, gpu, cal) / byte_rate(gpu, cal)
    h, f = shape.hidden, shape.routed_ffn
    # t·h·f / (t·h + h·f + t·f) >= ridge·w/2  <=>  t·(h·f - r·(h + f)) >= r·h·f, with r = ridge·w/2
    r = ridge * w / 2
    if h * f <= r * (h + f):
        return 0  # never: the GEMM stays memory-bound however many tokens come
    return math.ceil(r * h * f / (h * f - r * (h + f)))
