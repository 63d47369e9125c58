"""PyTorch's eager memory behaviour, simulated in bytes: no values, no torch.

The pieces mirror PyTorch's own, so that lifetimes come out the same:
  Storage   bytes that exist while a tensor or a saved-tensor slot refers to them (a c10 StorageImpl),
            freed by CPython's reference count as a StorageImpl is freed by its own
  Tensor    a shape and dtype over a storage (views share it); grad_fn is the Node that made it
  Node      one autograd node: the storages it saved for backward, released once it has run, and a
            rule that allocates its gradients in the order the aten backward formula does
  Graph     runs the backward engine (of the nodes that are ready, the highest sequence number runs
            first, as in torch's ReadyQueue; AccumulateGrad before all) and non-reentrant
            checkpointing (saved tensors become placeholders in forward; the region is re-run at the
            first unpack in backward and stops once its last saved tensor is rebuilt)
Gradients reaching one input twice are summed out of place, as torch's InputBuffer does unless it
owns the first gradient alone (never the case in these models: measured on meta and on CPU).
"""

from __future__ import annotations

import contextlib
import heapq
import math
from dataclasses import dataclass
from typing import Callable

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "bool": 1, "int64": 8, "uint64": 8, "int32": 4}
LEAF_SEQ = 2**62  # AccumulateGrad runs as soon as it is ready (torch: UINT64_MAX priority)


@dataclass
class Memory:
    """Live bytes, and the peak since reset_peak() with the op that reached it."""

    live_bytes: int = 0
    peak_bytes: int = 0
    peak_at: str = ""
    phase: str = ""
    timeline: list[tuple[str, str, int, int]] | None = None  # (phase, op, ±bytes, live) when recording

    def alloc(self, nbytes: int, op: str) -> None:
        self.live_bytes += nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, op, nbytes, self.live_bytes))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: {op}"

    def free(self, nbytes: int, op: str) -> None:
        self.live_bytes -= nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, "free " + op, -nbytes, self.live_bytes))

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: (start)"


class Storage:
    __slots__ = ("mem", "nbytes", "op", "kind")

    def __init__(self, mem: Memory, nbytes: int, op: str, kind: str = "activation"):
        self.mem, self.nbytes, self.op, self.kind = mem, nbytes, op, kind
        mem.alloc(nbytes, op)

    def __del__(self) -> None:
        self.mem.free(self.nbytes, self.op)


class Tensor:
    __slots__ = ("storage", "shape", "dtype", "grad_fn", "output_nr", "grad", "name")

    def __init__(self, storage: Storage, shape, dtype: str):
        self.storage, self.shape, self.dtype = storage, tuple(shape), dtype
        self.grad_fn: Node | None = None
        self.output_nr = 0
        self.grad: Tensor | None = None
        self.name = ""

    @property
    def requires_grad(self) -> bool:
        return self.grad_fn is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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


class Slot:
    """A saved tensor inside a checkpointed region: an index into its Frame, no bytes."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: Frame, index: int):
        self.frame, self.index = frame, index


class Frame:
    """One non-reentrant checkpoint region; its inputs live as long as its placeholders."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.n_saved = 0
        self.recomputed: dict[int, Storage] | None = None


class Node:
    __slots__ = ("name", "seq", "edges", "rule", "saved", "n_inputs", "leaf")

    def __init__(self, name: str, seq: int, edges: list, rule: Callable, n_inputs: int):
        self.name, self.seq, self.edges, self.rule = name, seq, edges, rule
        self.saved: list | None = []
        self.n_inputs = n_inputs  # gradient slots: one per forward output
        self.leaf: Tensor | None = None

    def __lt__(self, other: Node) -> bool:  # heapq pops the smallest: make that the highest seq
        return self.seq > other.seq


class StopRecompute(Exception):
    pass


class Graph:
    """Ops record nodes here; backward() runs them; checkpoint() and the rebuild mirror torch's."""

    def __init__(self, mem: Memory):
        self.mem = mem
        self.seq = 0
        self.grad_enabled = True
        self.layer: int | None = None  # the block being run, for SavedTerm.layer
        self.saved_terms: list[SavedTerm] | None = None  # see record_saves()
        self.saved_ids: set[int] = set()
        self.scope = ""  # the part of the model running, for SavedTerm.scope
        self.frame: Frame | None = None  # the checkpoint region running forward
        self.rebuilding: Frame | None = None  # the region being recomputed in backward
        self.rebuilt_bytes = 0  # the most activation bytes one recompute brought back
        self.in_backward = False
        self.flops: dict[tuple[str, str], int] = {}  # (forward | backward | recompute, kind) -> FLOPs

    @contextlib.contextmanager
    def scoped(self, name: str):
        """Label what runs inside with a part of the model (restored after)."""
        outer, self.scope = self.scope, name
        try:
            yield
        finally:
            self.scope = outer

    def flop(self, kind: str, n: int) -> None:
        """Count a matmul's FLOPs (2·m·k·n) as FlopCounterMode does, where its kernel runs."""
        phase = "recompute" if self.rebuilding is not None else "backward" if self.in_backward else "forward"
        self.flops[(phase, kind)] = self.flops.get((phase, kind), 0) + int(n)

    # -- tensors -----------------------------------------------------------------------------
    def empty(self, shape, dtype: str, op: str, kind: str = "activation") -> Tensor:
        shape = tuple(shape)
        return Tensor(Storage(self.mem, int(math.prod(shape)) * ITEMSIZE[dtype], op, kind), shape, dtype)

    def view(self, t: Tensor, shape) -> Tensor:
        """A tensor over t's storage (no node: callers attach one when t needs grad)."""
        return Tensor(t.storage, shape, t.dtype)

    def param(self, shape, dtype: str, name: str) -> Tensor:
        t = self.empty(shape, dtype, "param " + name, kind="param")
        t.name = name
        t.grad_fn = Node("AccumulateGrad", LEAF_SEQ, [], None, 1)
        t.grad_fn.leaf = t
        return t

    # -- forward -----------------------------------------------------------------------------
    def begin(self, name: str, inputs: list, rule: Callable, saved: list[tuple[Tensor, str]] = ()) -> Node | None:
        """Before an op's kernel runs: its node, if any input needs grad, and the inputs it saves.
        (Autograd packs saved inputs before the kernel and saved outputs after: see end().)"""
        if not self.grad_enabled or not any(t is not None and t.requires_grad for t in inputs):
            return None
        self.seq += 1
        edges = [(t.grad_fn, t.output_nr) if t is not None and t.requires_grad else None for t in inputs]
        node = Node(name, self.seq, edges, rule, 0)
        node.saved = [self.save(t, name, what) for t, what in saved]
        return node

    def end(self, node: Node | None, outputs: list[Tensor], saved: list[tuple[Tensor, str]] = ()) -> None:
        """After the kernel: the outputs get the node as grad_fn, then saved outputs are packed."""
        if node is None:
            return
        node.n_inputs = len(outputs)
        for k, t in enumerate(outputs):
            t.grad_fn, t.output_nr = node, k
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

    # -- checkpoint ---------------------------------------------------------------------------
    def checkpoint(self, fn: Callable, *args):
        """torch.utils.checkpoint(fn, *args, use_reentrant=False): its inputs are kept, the rest rebuilt."""
        with self.scoped("checkpoint"):
            for t in args:
                if isinstance(t, Tensor):
                    self.note_saved(t, "checkpoint", "input")
        frame = Frame(fn, args)
        outer, self.frame = self.frame, frame
        try:
            return fn(*args)
        finally:
            self.frame = outer

    def rebuild(self, frame: Frame) -> None:
        """The first unpack in backward: run the region again with grad on, keep what it saves."""
        frame.recomputed = {}
        self.rebuilding, self.grad_enabled = frame, True
        try:
            frame.fn(*frame.args)
        except StopRecompute:
            pass
        finally:
            self.rebuilding, self.grad_enabled = None, False
        kept = {id(t.storage) for t in frame.args if isinstance(t, Tensor)}
        unique = {id(s): s for s in frame.recomputed.values() if s.kind == "activation" and id(s) not in kept}
        self.rebuilt_bytes = max(self.rebuilt_bytes, sum(s.nbytes for s in unique.values()))
        del unique

    # -- backward -----------------------------------------------------------------------------
    def backward(self, root: Tensor) -> None:
        """root.backward() for a scalar root: torch.autograd's engine on one thread, in bytes."""
        deps = dependencies(root.grad_fn)
        ones = self.empty(root.shape, root.dtype, "ones_like")  # torch.autograd.backward holds it to the end
        buffers: dict[Node, list] = {root.grad_fn: [ones]}
        ready = [root.grad_fn]
        self.grad_enabled, self.in_backward = False, True
        while ready:
            node = heapq.heappop(ready)
            outs, grad, buf = self.run(node, buffers.pop(node)), None, None
            for edge, grad in zip(node.edges, outs):
                if edge is None or grad is None:
                    continue
                nxt, slot = edge
                buf = buffers.setdefault(nxt, [None] * nxt.n_inputs)
                buf[slot] = grad if buf[slot] is None else self.empty(grad.shape, grad.dtype, "add")  # InputBuffer
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, nxt)
            del outs, grad, buf  # no lingering references: torch's engine holds none
        self.grad_enabled, self.in_backward = True, False

    def run(self, node: Node, grads: list) -> list:
        if node.leaf is not None:  # AccumulateGrad: the first gradient is stolen, not copied
            if node.leaf.grad is None:
                node.leaf.grad = grads[0]
            return []
        rebuilt = any(isinstance(s, Slot) for s in node.saved)
        if rebuilt:  # a checkpointed node: rebuild its region at the first unpack
            frame = next(s.frame for s in node.saved if isinstance(s, Slot))
            if frame.recomputed is None:
                self.rebuild(frame)
            node.saved = [frame.recomputed.pop(s.index) if isinstance(s, Slot) else s for s in node.saved]
        outs = node.rule(grads)
        if rebuilt:  # unpacked rebuilt tensors were locals of apply(): they die as it returns
            node.saved = None
        outs = [self.reduce(o) for o in outs]  # validate_outputs: broadcast gradients summed
        grads.clear()  # the incoming gradients die with call_function
        node.saved = None  # release_variables(): the saved tensors go
        return outs

    def reduce(self, out):
        """A (gradient, input shape) pair is summed to that shape (autograd's validate_outputs)."""
        if not isinstance(out, tuple):
            return out
        grad, shape = out
        return grad if grad.shape == tuple(shape) else self.empty(shape, grad.dtype, "sum")


def dependencies(root: Node) -> dict[Node, int]:
    """How many gradients each node waits for (torch's compute_dependencies)."""
    deps: dict[Node, int] = {}
    seen, stack = {id(root)}, [root]
    while stack:
        node = stack.pop()
        for edge in node.edges:
            if edge is None:
                continue
            nxt = edge[0]
            deps[nxt] = deps.get(nxt, 0) + 1
            if id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return deps
