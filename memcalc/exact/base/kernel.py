"""One kernel of a replayed step (Kernel): the record the simulator writes as it runs and the roofline times."""

from __future__ import annotations


class Kernel:
    """One kernel of the step: what it computes and what it moves through HBM. (A plain record, as
    Storage and Tensor are: thousands are made per step.)"""

    __slots__ = ("op", "unit", "dtype", "flops", "counted", "count_kind", "read_bytes", "write_bytes", "phase",
                 "scope", "layer", "count")  # fmt: skip

    def __init__(self, op: str, unit: str, dtype: str, flops: int, counted: int, count_kind: str, read_bytes: int,
                 write_bytes: int, phase: str, scope: str, layer: int | None, count: int = 1):  # fmt: skip
        self.op = op  # the aten op (mm, _softmax_backward_data, addcdiv_, ...)
        self.unit = unit  # tensor (a matmul), flash (the fused attention kernel) or vector (elementwise, reductions)
        self.dtype = dtype  # its operands' dtype: picks the tensor-core rate
        self.flops = flops  # what it executes (a causal flash kernel skips the masked half)
        self.counted = counted  # what FlopCounterMode counts for it: matmuls only, attention non-causal
        self.count_kind = count_kind  # linear | logits | attention for a counted matmul, else ""
        self.read_bytes = read_bytes  # inputs read from HBM, each once (a broadcast input: its own size)
        self.write_bytes = write_bytes  # outputs written
        self.phase = phase  # forward | backward | recompute | accumulate | optimizer
        self.scope = scope  # the part of the model: "attention core", "mlp", "loss", ...
        self.layer = layer  # the block it belongs to; None outside the blocks
        self.count = count  # how many times the step launches it there (equal experts' kernels: one record)

    def key(self) -> tuple:
        """Everything but the layer: two blocks run kernels with equal keys."""
        return (self.op, self.unit, self.dtype, self.flops, self.counted, self.count_kind, self.read_bytes,
                self.write_bytes, self.phase, self.scope)  # fmt: skip

    def __repr__(self) -> str:
        times = f" x{self.count}" if self.count > 1 else ""
        return (f"Kernel({self.phase} {self.scope} {self.op}{times}: {self.flops:,} FLOPs, {self.read_bytes:,} B read, "
                f"{self.write_bytes:,} B written)")  # fmt: skip


STEP_PHASES = ("forward", "backward", "recompute")  # run once per micro-batch
