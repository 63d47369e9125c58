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
            first unpack in backward and stops once its last saved tensor is rebuilt), with or without
            a selective-checkpoint policy (create_selective_checkpoint_contexts: forward keeps the
            outputs of the ops the policy saves, and the recompute takes them instead of rerunning)
Gradients reaching one input twice are summed out of place, as torch's InputBuffer does unless it
owns the first gradient alone (never the case in these models: measured on meta and on CPU).

When Graph.kernels is a list, every kernel the step launches is recorded there too (Kernel): its
FLOPs and the HBM bytes it reads and writes, tagged with the phase, the part of the model and the
layer it belongs to. memcalc.time.roofline turns them into time.
"""

from __future__ import annotations

import contextlib
import heapq
from dataclasses import dataclass, field
from typing import Callable

from .config import ITEMSIZE
from .kernels import Kernel

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


def nbytes(x) -> int:
    """Bytes a kernel moves for an operand: an int as given; a tensor's elements, but no more than
    its storage holds (an expanded view is read once)."""
    return x if x.__class__ is int else x.nbytes


@dataclass
class Memory:
    """Live bytes, and the peak since reset_peak() with the op that reached it; and the peak of each
    segment of the step (segment_peaks): a block's part of a phase, or what runs before the first
    block or after the last (memcalc.exact.step.grown_phases grows two- and three-block steps from them)."""

    live_bytes: int = 0
    peak_bytes: int = 0
    peak_at: str = ""
    phase: str = ""
    timeline: list[tuple[str, str, int, int]] | None = None  # (phase, op, ±bytes, live) when recording
    segment: object = "before"  # a block's index, or "before" / "after" the blocks
    segment_peaks: dict = field(default_factory=dict)  # segment -> (its highest live bytes since reset_peak(), op)
    blocks_seen: list = field(default_factory=list)  # the blocks in the order the phase reached them
    segments: dict = field(default_factory=dict)  # phase -> (its segment_peaks, its blocks_seen), kept by the step

    def alloc(self, nbytes: int, op: str) -> None:
        self.live_bytes += nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, op, nbytes, self.live_bytes))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: {op}"
        if self.live_bytes > self.segment_peaks.get(self.segment, (0, ""))[0]:
            self.segment_peaks[self.segment] = (self.live_bytes, f"{self.phase}: {op}")

    def free(self, nbytes: int, op: str) -> None:
        self.live_bytes -= nbytes
        if self.timeline is not None:
            self.timeline.append((self.phase, "free " + op, -nbytes, self.live_bytes))

    def enter(self, layer: int | None) -> None:
        """What runs from now on belongs to block `layer`, or (None) to before or after the blocks."""
        if layer is None:
            self.segment = "after" if self.blocks_seen else "before"
        else:
            if layer not in self.blocks_seen:
                self.blocks_seen.append(layer)
            self.segment = layer
        # a segment holds at least what is live on entering it (a fused optimizer's block allocates nothing)
        self.segment_peaks.setdefault(self.segment, (self.live_bytes, f"{self.phase}: (entering {self.segment})"))

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: (start)"
        self.segment, self.segment_peaks, self.blocks_seen = "before", {"start": (self.live_bytes, self.peak_at)}, []


class Storage:
    __slots__ = ("mem", "nbytes", "op", "kind")

    # kind: activation | param | buffer | input | state | cached (an activation a selective checkpoint keeps)
    def __init__(self, mem: Memory, nbytes: int, op: str, kind: str = "activation"):
        self.mem, self.nbytes, self.op, self.kind = mem, nbytes, op, kind
        mem.alloc(nbytes, op)

    def __del__(self) -> None:
        self.mem.free(self.nbytes, self.op)


class Tensor:
    __slots__ = ("storage", "shape", "dtype", "grad_fn", "output_nr", "grad", "name", "numel", "nbytes")

    def __init__(self, storage: Storage, shape, dtype: str, numel: int | None = None):
        self.storage, self.shape, self.dtype = storage, tuple(shape), dtype
        self.grad_fn: Node | None = None
        self.output_nr = 0
        self.grad: Tensor | None = None
        self.name = ""
        self.numel = elements(self.shape) if numel is None else numel
        # what a kernel reads or writes of it: its elements, no more than its storage (an expanded view)
        self.nbytes = min(self.numel * ITEMSIZE[dtype], storage.nbytes)

    @property
    def requires_grad(self) -> bool:
        return self.grad_fn is not None


def elements(shape) -> int:
    """The product of a shape as a plain int (a product of memcalc.exact's Syms would build a name)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


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
    """One non-reentrant checkpoint region; its inputs live as long as its placeholders (torch's
    _CheckpointFrame, which the unpack hooks of the region's saved tensors hold).

    With a policy (selective checkpointing), policy(op, n) says whether the n-th call (from 1) of an op
    in the region keeps its outputs. They are kept in cache (torch.utils.checkpoint's SAC storage,
    shared by _CachingTorchDispatchMode and _CachedTorchDispatchMode and held with the frame): taken
    out as the recompute replays that call (the entry is _CONSUMED), or kept as long as the frame
    lives when early stop ends the recompute before it."""

    def __init__(self, fn: Callable, args: tuple, policy: Callable[[str, int], bool] | None = None):
        self.fn, self.args = fn, args
        self.n_saved = 0
        self.recomputed: dict[int, Storage] | None = None
        self.autocast = None  # the autocast region its forward ran in: recompute runs in it again
        self.policy = policy
        self.counts: dict[str, int] = {}  # op -> calls so far in this pass (the dispatch modes' func_counter)
        self.cache: dict[tuple[str, int], tuple[Tensor, ...]] = {}  # (op, index) -> its outputs, kept


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


class StopRecompute(Exception):
    pass


class Graph:
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

    # -- checkpoint ---------------------------------------------------------------------------
    def checkpoint(self, fn: Callable, *args, policy: Callable[[str, int], bool] | None = None):
        """torch.utils.checkpoint(fn, *args, use_reentrant=False): its inputs are kept, the rest rebuilt;
        with a policy, context_fn=create_selective_checkpoint_contexts(policy) (see Frame)."""
        with self.scoped("checkpoint"):
            for t in args:
                if isinstance(t, Tensor):
                    self.note_saved(t, "checkpoint", "input")
        frame = Frame(fn, args, policy)
        frame.autocast = self.autocast  # torch/utils/checkpoint.py: _get_autocast_kwargs at forward
        outer, self.frame = self.frame, frame
        try:
            return fn(*args)
        finally:
            self.frame = outer

    def outputs(self, op: str, make: Callable[[], tuple[Tensor, ...]], names: tuple[str, ...] = ("output",)
                ) -> tuple[Tensor, ...]:  # fmt: skip
        """An op's kernel: make() allocates its outputs and records the kernel. Inside a region with a
        policy, each call is counted per op; forward keeps the outputs the policy saves (detached
        aliases of the same storages: torch.utils.checkpoint._CachingTorchDispatchMode), and the
        recompute takes them back instead of running the op (_CachedTorchDispatchMode): no bytes, no
        kernel, no FLOPs. names: what each output is, for the saved terms."""
        frame = self.rebuilding if self.rebuilding is not None else self.frame
        if frame is None or frame.policy is None:
            return make()
        index = frame.counts.get(op, 0)
        frame.counts[op] = index + 1
        if frame is self.rebuilding:
            kept = frame.cache.pop((op, index), None)  # consumed: the cache lets go of it
            return kept if kept is not None else make()
        outs = make()
        if frame.policy(op, index + 1):
            frame.cache[(op, index)] = tuple(Tensor(t.storage, t.shape, t.dtype) for t in outs)
            for t, name in zip(outs, names):
                self.note_saved(t, op, f"{name}, kept by selective checkpointing")
                t.storage.kind = "cached"  # kept since forward: the recompute brings it back without bytes
        return outs

    def rebuild(self, frame: Frame) -> None:
        """The first unpack in backward: run the region again with grad on (and under the autocast it
        ran in: checkpoint.py's recompute_fn), keep what it saves."""
        frame.recomputed, frame.counts = {}, {}  # the recompute's mode counts afresh
        self.rebuilding, self.grad_enabled = frame, True
        region = contextlib.nullcontext() if frame.autocast is None else frame.autocast.region(self)
        try:
            with region:
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
        outer = self.layer, self.scope
        self.kernel("ones_like", (), (ones,))
        while ready:
            node = heapq.heappop(ready)
            self.layer, self.scope = node.layer, node.scope  # its kernels belong where its forward ran
            outs, grad, buf = self.run(node, buffers.pop(node)), None, None
            for edge, grad in zip(node.edges, outs):
                if edge is None or grad is None:
                    continue
                nxt, slot = edge
                buf = buffers.setdefault(nxt, [None] * nxt.n_inputs)
                if buf[slot] is None:
                    buf[slot] = grad
                else:  # InputBuffer: summed out of place
                    total = self.empty(grad.shape, grad.dtype, "add")
                    self.kernel("add", (buf[slot], grad), (total,))
                    buf[slot] = total
                    del total
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, nxt)
            del outs, grad, buf  # no lingering references: torch's engine holds none
        self.grad_enabled, self.in_backward = True, False
        self.layer, self.scope = outer

    def run(self, node: Node, grads: list) -> list:
        if node.leaf is not None:  # AccumulateGrad: the first gradient is stolen, not copied
            if node.leaf.grad is None:
                node.leaf.grad = grads[0]
            else:
                self.accumulate(node.leaf)
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
        self.validate(outs, node.dtypes)
        grads.clear()  # the incoming gradients die with call_function
        node.saved = None  # release_variables(): the saved tensors go
        return outs

    def accumulate(self, leaf: Tensor) -> None:
        """AccumulateGrad when the leaf already has a gradient: grad += new, in place (no bytes),
        one kernel that reads both and writes the sum."""
        self.kernel("add_", (leaf.grad, leaf.grad), (leaf.grad,))

    def validate(self, outs: list, dtypes: list) -> None:
        """autograd's validate_outputs (torch/csrc/autograd/engine.cpp), slot by slot, each replaced
        gradient freed at once: a (gradient, input shape) pair is summed to that shape, then a gradient
        of another dtype than its input (an autocast cast's, a promoted op's) is cast to it."""
        for i in range(len(outs)):
            out, outs[i] = outs[i], None
            if isinstance(out, tuple):
                grad, shape = out
                del out
                out = grad if grad.shape == tuple(shape) else self.summed(grad, shape)
                del grad
            if out is not None and dtypes[i] is not None and out.dtype != dtypes[i]:
                out = self.cast(out, dtypes[i])
            outs[i] = out
            del out

    def summed(self, grad: Tensor, shape) -> Tensor:
        """at::sum_to(grad, shape): a new tensor."""
        out = self.empty(shape, grad.dtype, "sum")
        self.kernel("sum", (grad,), (out,))
        return out

    def cast(self, grad: Tensor, dtype: str) -> Tensor:
        """grad.to(dtype): a new tensor."""
        out = self.empty(grad.shape, dtype, "_to_copy")
        self.kernel("_to_copy", (grad,), (out,))
        return out


def scope_of(name: str) -> str:
    """The scope a parameter's optimizer and accumulation kernels run in: "experts" for a routed expert's
    weights (a layout splits them over ep), else none."""
    return "experts" if ".experts." in name else ""


def layer_of(name: str) -> int | None:
    """The block a parameter belongs to, from its name: the first number in it (blocks.3.attn.wq.weight,
    model.layers.3.self_attn.q_proj.weight -> 3); None outside the blocks (tok_emb.weight)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


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
