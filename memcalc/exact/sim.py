"""PyTorch's eager memory behaviour, simulated in bytes: no values, no torch.

The pieces mirror PyTorch's own, so that lifetimes come out the same:
  Storage   bytes that exist while a tensor or a saved-tensor slot refers to them (memcalc.exact.tensors,
            with Tensor and Memory, the live bytes and their peaks)
  Tensor    a shape and dtype over a storage (views share it); grad_fn is the Node that made it
  Node      one autograd node: the storages it saved for backward, released once it has run, and a
            rule that allocates its gradients in the order the aten backward formula does
  Graph     records the nodes in forward; runs the backward engine (memcalc.exact.backward) and
            non-reentrant checkpointing, with or without a selective-checkpoint policy
            (memcalc.exact.checkpoint)

When Graph.kernels is a list, every kernel the step launches is recorded there too (Kernel): its
FLOPs and the HBM bytes it reads and writes, tagged with the phase, the part of the model and the
layer it belongs to. memcalc.time.roofline turns them into time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from .backward import Backward
from .checkpoint import Checkpointing, Frame, Slot, StopRecompute
from .config import ITEMSIZE
from .kernels import Kernel
from .tensors import Memory, Storage, Tensor, elements

# Memory and Tensor live in memcalc.exact.tensors; memcalc.exact.zero and mirror import them from here.
__all__ = ["LEAF_SEQ", "VECTOR_FLOPS", "Graph", "Node", "SavedTerm", "layer_of", "scope_of", "Memory", "Tensor"]

LEAF_SEQ = 2**62  # AccumulateGrad runs as soon as it is ready (torch: UINT64_MAX priority)
# Arithmetic per output element of the elementwise kernels, counted from each op's formula (the
# rest count 1; copies, cats and gathers 0). It seldom decides a kernel's time on the GPUs here: an
# elementwise kernel moves 4-24 bytes per element, far below the FP32 peak's ~20 FLOPs per HBM byte.
VECTOR_FLOPS = {
    "gelu": 9, "gelu_backward": 16, "silu": 4, "silu_backward": 7, "_softmax": 5, "_softmax_backward_data": 3,
    "_log_softmax": 5, "_log_softmax_backward_data": 3, "native_dropout": 2, "native_dropout_backward": 2,
    "native_layer_norm": 8, "native_layer_norm_backward": 12, "lerp_": 2, "addcmul_": 3, "addcdiv_": 3,
    "clone": 0, "cat": 0, "_to_copy": 0, "copy_": 0, "embedding": 0, "embedding_dense_backward": 0,
    "nll_loss_backward": 0, "arange": 0, "ones_like": 0,
}  # fmt: skip


@dataclass(frozen=True)
class SavedTerm:
    """One storage saved for backward: the op whose node saved it, what it is, its bytes."""

    op: str
    what: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    layer: int | None  # None outside the blocks
    scope: str  # the part of the model: "attention", "mlp", "head", ...


class Node:
    __slots__ = ("name", "seq", "edges", "rule", "saved", "n_inputs", "leaf", "layer", "scope", "dtypes")

    def __init__(self, name: str, seq: int, edges: list, rule: Callable, n_inputs: int, layer: int | None = None,
                 scope: str = ""):  # fmt: skip
        self.name, self.seq, self.edges, self.rule = name, seq, edges, rule
        self.saved: list | None = []
        self.n_inputs = n_inputs  # gradient slots: one per forward output
        self.leaf: Tensor | None = None
        self.layer, self.scope = layer, scope  # where its forward ran: its backward's kernels belong there
        self.dtypes: list = []  # its inputs' dtypes: a gradient of another dtype is cast to its input's

    def __lt__(self, other: Node) -> bool:  # heapq pops the smallest: make that the highest seq
        return self.seq > other.seq


class Graph(Checkpointing, Backward):
    """Ops record nodes here; backward() runs them; checkpoint() and the rebuild mirror torch's."""

    def __init__(self, mem: Memory):
        self.mem = mem
        self.seq = 0
        self.grad_enabled = True
        self._layer: int | None = None  # the block being run (see layer)
        self.saved_terms: list[SavedTerm] | None = None  # see record_saves()
        self.saved_ids: set[int] = set()
        self.scope = ""  # the part of the model running, for SavedTerm.scope
        self.frame: Frame | None = None  # the checkpoint region running forward
        self.rebuilding: Frame | None = None  # the region being recomputed in backward
        self.rebuilt_bytes = 0  # the most activation bytes one recompute brought back
        self.in_backward = False
        self.flops: dict[tuple[str, str], int] = {}  # (forward | backward | recompute, kind) -> FLOPs
        self.kernels: list[Kernel] | None = None  # every kernel launched, when recording
        self.stage = "forward"  # outside backward: forward, or the recipe's accumulate | optimizer
        self.autocast = None  # the autocast region running (memcalc.exact.autocast.Autocast), if any

    @property
    def layer(self) -> int | None:
        """The block being run (None: outside the blocks): for SavedTerm.layer, a kernel's layer, and the
        memory's segments."""
        return self._layer

    @layer.setter
    def layer(self, value: int | None) -> None:
        self._layer = value
        self.mem.enter(value)

    @contextlib.contextmanager
    def scoped(self, name: str):
        """Label what runs inside with a part of the model (restored after)."""
        outer, self.scope = self.scope, name
        try:
            yield
        finally:
            self.scope = outer

    def kernel(self, op: str, reads: tuple, writes: tuple, unit: str = "vector", flops: int | None = None,
               count: str = "", counted: int = 0, dtype: str = "") -> None:  # fmt: skip
        """One kernel: reads and writes are tensors (or byte counts); a matmul passes its FLOPs and the
        kind FlopCounterMode counts it under (counted: its count where that differs from flops)."""
        phase = "recompute" if self.rebuilding is not None else "backward" if self.in_backward else self.stage
        if count:
            self.flops[(phase, count)] = self.flops.get((phase, count), 0) + int(counted or flops)
        if self.kernels is None:
            return
        read = written = most = 0
        for t in reads:
            if t is not None:
                read += t if t.__class__ is int else t.nbytes
        for t in writes:
            written += t.nbytes
            most = max(most, t.numel)
        if flops is None:  # elementwise: its arithmetic per element times the elements written
            flops = VECTOR_FLOPS.get(op, 1) * most
        self.kernels.append(Kernel(op, unit, dtype, int(flops), int(counted or flops) if count else 0, count,
                                   read, written, phase, self.scope, self.layer))  # fmt: skip

    # -- tensors -----------------------------------------------------------------------------
    def empty(self, shape, dtype: str, op: str, kind: str = "activation") -> Tensor:
        shape = tuple(shape)
        n = elements(shape)
        return Tensor(Storage(self.mem, n * ITEMSIZE[dtype], op, kind), shape, dtype, n)

    def view(self, t: Tensor, shape) -> Tensor:
        """A tensor over t's storage (no node: callers attach one when t needs grad)."""
        return Tensor(t.storage, shape, t.dtype)

    def param(self, shape, dtype: str, name: str) -> Tensor:
        t = self.empty(shape, dtype, "param " + name, kind="param")
        t.name = name
        t.grad_fn = Node("AccumulateGrad", LEAF_SEQ, [], None, 1, layer_of(name))
        t.grad_fn.leaf = t
        return t

    # -- forward -----------------------------------------------------------------------------
    def begin(self, name: str, inputs: list, rule: Callable, saved: list[tuple[Tensor, str]] = ()) -> Node | None:
        """Before an op's kernel runs: its node, if any input needs grad, and the inputs it saves.
        (Autograd packs saved inputs before the kernel and saved outputs after: see end().)"""
        if not self.grad_enabled:
            return None
        edges = [None if t is None or t.grad_fn is None else (t.grad_fn, t.output_nr) for t in inputs]
        if edges.count(None) == len(edges):  # no input needs grad
            return None
        self.seq += 1
        node = Node(name, self.seq, edges, rule, 0, self.layer, self.scope)
        node.dtypes = [None if t is None else t.dtype for t in inputs]
        if saved:
            node.saved = [self.save(t, name, what) for t, what in saved]
        return node

    def end(self, node: Node | None, outputs: list[Tensor], saved: list[tuple[Tensor, str]] = ()) -> None:
        """After the kernel: the outputs get the node as grad_fn, then saved outputs are packed."""
        if node is None:
            return
        node.n_inputs = len(outputs)
        for k, t in enumerate(outputs):
            t.grad_fn, t.output_nr = node, k
        if saved:
            node.saved += [self.save(t, node.name, what) for t, what in saved]

    def save(self, t: Tensor, op: str, what: str):
        if self.rebuilding is not None:  # recomputing a checkpoint region: the frame takes it
            frame = self.rebuilding
            frame.recomputed[len(frame.recomputed)] = t.storage
            if len(frame.recomputed) == frame.n_saved:
                raise StopRecompute  # torch's early stop: the last saved tensor is rebuilt
            return None
        if self.frame is not None:  # inside a checkpoint region: a placeholder, no bytes kept
            self.frame.n_saved += 1
            return Slot(self.frame, self.frame.n_saved - 1)
        self.note_saved(t, op, what)
        return t.storage

    def record_saves(self) -> None:
        """From now on, note every activation storage saved for backward, once per storage."""
        self.saved_terms, self.saved_ids = [], set()

    def note_saved(self, t: Tensor, op: str, what: str) -> None:
        if self.saved_terms is None or t.storage.kind != "activation" or id(t.storage) in self.saved_ids:
            return  # (a saved storage stays alive through forward, so its id is not reused meanwhile)
        self.saved_ids.add(id(t.storage))
        self.saved_terms.append(SavedTerm(op, what, t.storage.nbytes, t.dtype, t.shape, self.layer, self.scope))


def scope_of(name: str) -> str:
    """The scope a parameter's optimizer and accumulation kernels run in: "experts" for a routed expert's
    weights (a layout splits them over ep), else none."""
    return "experts" if ".experts." in name else ""


def layer_of(name: str) -> int | None:
    """The block a parameter belongs to, from its name: the first number in it (blocks.3.attn.wq.weight,
    model.layers.3.self_attn.q_proj.weight -> 3); None outside the blocks (tok_emb.weight)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)

