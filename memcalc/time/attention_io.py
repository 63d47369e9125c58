"""The attention core alone, standard against flash: HBM traffic, FLOPs and roofline time.

FlashAttention's claim (Dao et al. 2022, arXiv 2205.14135, Fig. 2) is that standard attention is
slow because it moves the s×s scores, probabilities and dropout mask through HBM in forward and
backward, and that the fused kernel wins although it does more FLOPs (its backward recomputes QKᵀ).
This replays the model's own attention core (memcalc.exact.builder.layers.core: scale, causal mask, softmax,
dropout, the two batched matmuls; or the flash op) forward and backward, kernel by kernel.
"""

from __future__ import annotations

from memcalc.exact.builder.layers import core
from memcalc.exact.base.config import StepConfig
from memcalc.exact.base.kernel import Kernel
from memcalc.exact.sim.graph import Graph
from memcalc.exact.sim.tensors import LiveBytes
from memcalc.model.gpus import GPU
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.records import record

from .calibration import Calibration
from .roofline import kernel_seconds


@record(slots=True)
class AttentionTime:
    """Forward + backward of the attention core alone (no projections), as the model runs it."""

    flash: bool
    flops_counted: int  # FlopCounterMode's count: non-causal, flash's backward QKᵀ included
    flops: int  # executed (the causal flash kernel skips the masked half)
    bytes: int  # HBM reads + writes
    seconds: float  # roofline time on the GPU


def attention_kernels(batch: int, heads: int, seq_len: int, head_dim: int, precision: str, flash: bool,
                      dropout: float = 0.0) -> list[Kernel]:  # fmt: skip
    """The kernels of the model's attention core, forward and backward, from q, k, v of shape
    (batch, heads, seq, head_dim); dO is a ones tensor (its making is not counted)."""
    shape = ModelShape(n_layers=1, hidden=heads * head_dim, n_heads=heads, vocab=1, dropout=dropout)
    cfg = StepConfig(shape, seq_len, batch, Tricks(precision, flash))
    g = Graph(LiveBytes())
    g.kernels = []
    q, k, v = (g.param((batch, heads, seq_len, head_dim), precision, name) for name in "qkv")
    future = None if flash else g.empty((seq_len, seq_len), "bool", "buffer future", kind="buffer")
    y = core(g, cfg, q, k, v, future)
    g.backward(y)
    return [k for k in g.kernels if k.scope == "attention core"]


def attention_time(batch: int, heads: int, seq_len: int, head_dim: int, precision: str, flash: bool, gpu: GPU,
                   cal: Calibration, dropout: float = 0.0) -> AttentionTime:  # fmt: skip
    ks = attention_kernels(batch, heads, seq_len, head_dim, precision, flash, dropout)
    return AttentionTime(flash, sum(k.counted for k in ks), sum(k.flops for k in ks),
                         sum(k.read_bytes + k.write_bytes for k in ks),
                         sum(max(kernel_seconds(k, gpu, cal)) for k in ks))  # fmt: skip
