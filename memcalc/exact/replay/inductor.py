"""torch.compile's kernels, from the eager step's: what Inductor fuses, and what the fused kernels move.

torchtitan compiles each transformer block on its own (torchtitan/models/llama3/infra/parallelize.py
apply_compile @ b5bcd76c66d0acb1a08b176d9639425bc55e0b2a: torch.compile(block, fullgraph=True)), so the
embedding, the loss and the optimizer stay eager. Inside a block Inductor leaves the matmuls and the
attention kernel to their libraries (extern kernels: cuBLAS, the flash kernel) and generates Triton
kernels for everything between them, each fusing a run of pointwise ops and reductions that reads its
inputs from HBM once and writes only what outlives it (Ansel et al. 2024, "PyTorch 2", sec. 4.3).

The eager trace says which those are: a run of elementwise kernels of one block, one phase and one
kind of copy (unbroken by a matmul or attention) becomes one fused kernel; it reads each tensor made
before the run once, and writes each tensor it makes that is still alive when the run ends (one freed
inside it never reaches HBM). A reduction of a whole tensor to one number (float8's tensorwise amax)
ends a kernel: what uses the number reads the tensor again in the next one. What this leaves out:
the partitioner's recompute (min-cut, Inductor's default for training) saves fewer forward tensors
than eager does and recomputes them in backward; the forward writes here are eager's saved tensors,
an upper bound, and the memory verdict is the eager step's.
"""

from __future__ import annotations

import itertools

from ..base.kernel import STEP_PHASES, Kernel
from ..sim.graph import Graph
from ..sim.tensors import Storage, Tensor

SERIALS = itertools.count()
SCALAR_BYTES = 8  # a reduction written to one number (float32 or float64) ends a fused kernel
ALIVE = float("inf")  # freed after no kernel: alive at the step's end


class TracedStorage(Storage):
    """A storage that has a serial number and notes when it is freed: after how many kernels of the trace."""

    __slots__ = ("graph", "serial")

    def __init__(self, graph: FusionGraph, *args):
        super().__init__(*args)
        self.serial, self.graph = next(SERIALS), graph

    def __del__(self) -> None:
        super().__del__()
        if self.graph.kernels is not None:
            self.graph.freed[self.serial] = len(self.graph.kernels)


class FusionGraph(Graph):
    """A Graph whose kernels note which storages they read and write (their serials and bytes), and when
    each storage is freed, for fused()."""

    def __init__(self, mem):
        super().__init__(mem)
        self.operands: list[tuple[tuple, tuple]] = []  # per kernel: ((serial | None, bytes) read, ... written)
        self.freed: dict[int, int] = {}  # serial -> kernels launched when it was freed
        self.alias: dict[int, int] = {}  # serial -> the serial of the tensor that computes it first (fused())

    def storage(self, nbytes: int, op: str, kind: str, copies: int) -> Storage:
        return TracedStorage(self, self.mem, nbytes, op, kind, copies)

    def kernel(self, op: str, reads: tuple, writes: tuple, *args, **kwargs) -> None:
        before = None if self.kernels is None else len(self.kernels)
        super().kernel(op, reads, writes, *args, **kwargs)
        if before is None or len(self.kernels) == before:
            return
        n = self.copies
        read = tuple((None, t) if t.__class__ is int else (serial(t), t.nbytes if n > 1 else t.nbytes * t.copies)
                     for t in reads if t is not None)  # fmt: skip
        written = tuple((serial(t), t.nbytes * (1 if n > 1 else t.copies)) for t in writes)
        self.operands.append((read, written))


def serial(t: Tensor) -> int | None:
    return getattr(t.storage, "serial", None)


def fusable(k: Kernel) -> bool:
    """An elementwise kernel or reduction inside a compiled block, in its forward, backward or recompute."""
    return k.unit == "vector" and k.layer is not None and k.phase in STEP_PHASES


def fused(g: FusionGraph) -> list[Kernel]:
    """The trace's kernels with each run of fusable ones (one block, phase and copy count) as one kernel,
    the repeats of a computation dropped first (common_subexpressions)."""
    out: list[Kernel] = []
    run: list[int] = []
    kernels, dropped = g.kernels, common_subexpressions(g)
    for i, k in enumerate(kernels):
        if i in dropped:
            continue
        if run and not (fusable(k) and same_run(kernels[run[0]], k)):
            out.append(one_kernel(g, run, i))
            run = []
        if fusable(k):
            run.append(i)
            if ends_kernel(k):
                out.append(one_kernel(g, run, i + 1))
                run = []
        else:
            out.append(k)
    if run:
        out.append(one_kernel(g, run, len(kernels)))
    return out


def common_subexpressions(g: FusionGraph) -> set[int]:
    """The fusable kernels that repeat an earlier one of their block's graph (the same op on the same tensors,
    as float8's cast of one input for each of the linears that read it): the compiled graph computes it once
    (Inductor's common subexpression elimination). Their outputs become the first one's (g.alias), which
    lives until the last kernel that reads one of them."""
    seen: dict[tuple, tuple] = {}
    dropped: set[int] = set()
    for i, k in enumerate(g.kernels):
        if not fusable(k):
            continue
        reads, writes = g.operands[i]
        if any(s is None for s, _ in reads):
            continue  # a saved tensor known by its bytes: not matched
        key = (k.layer, k.phase, k.op, tuple(g.alias.get(s, s) for s, _ in reads), tuple(n for _, n in writes))
        first = seen.setdefault(key, tuple(s for s, _ in writes))
        if first == tuple(s for s, _ in writes):
            continue
        dropped.add(i)
        for (s, _), f in zip(writes, first):
            g.alias[s] = f
    for i, (reads, _) in enumerate(g.operands):  # a repeat's readers read the first: it lives until the last
        if i not in dropped:
            for s, _ in reads:
                if s in g.alias:
                    f = g.alias[s]
                    g.freed[f] = max(g.freed.get(f, ALIVE), i + 1)
    return dropped


def same_run(first: Kernel, k: Kernel) -> bool:
    return (k.layer, k.phase, k.count) == (first.layer, first.phase, first.count)


def ends_kernel(k: Kernel) -> bool:
    """A whole tensor reduced to one number: its users wait for it, so they run in the next kernel."""
    return k.write_bytes <= SCALAR_BYTES < k.read_bytes


def one_kernel(g: FusionGraph, run: list[int], end: int) -> Kernel:
    """Kernels run[0..] as one: each tensor made before the run read once, each one made in it and alive
    after kernel end - 1 written once, the FLOPs summed."""
    made: set[int] = set()
    read = written = flops = 0
    seen: set[int] = set()
    for i in run:
        reads, writes = g.operands[i]
        for s, nbytes in reads:
            s = g.alias.get(s, s)
            if s is None:
                read += nbytes
            elif s not in made and s not in seen:
                seen.add(s)
                read += nbytes
        for s, nbytes in writes:
            if s is not None and s not in made:
                made.add(s)
                if g.freed.get(s, ALIVE) > end:  # still alive when the run ends
                    written += nbytes
        flops += g.kernels[i].flops
    first = g.kernels[run[0]]
    return Kernel("fused", "vector", first.dtype, flops, 0, "", read, written, first.phase, first.scope, first.layer,
                  first.count)  # fmt: skip
