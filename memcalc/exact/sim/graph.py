"""PyTorch's eager memory behaviour, simulated in bytes: no values, no torch.

The pieces mirror PyTorch's own, so that lifetimes come out the same:
  Storage   bytes that exist while a tensor or a saved-tensor slot refers to them (memcalc.exact.sim.tensors,
            with Tensor and LiveBytes, the live bytes and their peaks)
  Tensor    a shape and dtype over a storage (views share it); grad_fn is the Node that made it
  Node      one autograd node: the storages it saved for backward, released once it has run, and a
            rule that allocates its gradients in the order the aten backward formula does
  Graph     records the nodes in forward; runs the backward engine (memcalc.exact.sim.backward) and
            non-reentrant checkpointing, with or without a selective-checkpoint policy
            (memcalc.exact.sim.checkpoint)

When Graph.kernels is a list, every kernel the step launches is recorded there too (Kernel): its
FLOPs and the HBM bytes it reads and writes, tagged with the phase, the part of the model and the
layer it belongs to. memcalc.time.roofline turns them into time.

Equal copies run in turn (a layer's routed experts of one token count: memcalc.exact.builder.moe) are
simulated once, inside a region (repeated(), and in backward the region their nodes carry): their
tensors stand for every copy (memcalc.exact.sim.tensors.Region), their kernels are counted once per copy.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ..base.config import ITEMSIZE
from ..base.kernel import Kernel
from .backward import Backward
from .checkpoint import Checkpointing, Frame, Slot, StopRecompute
from .offload import Offloader
from .tensors import LiveBytes, Storage, Tensor, elements

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
    nbytes: int  # one copy's
    dtype: str
    shape: tuple[int, ...]
    layer: int | None  # None outside the blocks
    scope: str  # the part of the model: "attention", "mlp", "head", ...
    copies: int = 1  # the equal storages it stands for (memcalc.exact.sim.tensors.Region)


class Node:
    # __weakref__: a rule that reads its node's saved storages holds it weakly (memcalc.exact.hf.liger), so that a
    # node recomputed but never run does not keep them in a cycle with its rule
    __slots__ = ("__weakref__", "dtypes", "edges", "function", "group", "layer", "leaf", "n_inputs", "name", "rule",
                 "saved", "scope", "seq")  # fmt: skip

    def __init__(self, name: str, seq: int, edges: list, rule: Callable, n_inputs: int, layer: int | None = None,
                 scope: str = "", group: tuple | None = None):  # fmt: skip
        self.name, self.seq, self.edges, self.rule = name, seq, edges, rule
        self.saved: list | None = []
        self.n_inputs = n_inputs  # gradient slots: one per forward output
        self.leaf: Tensor | None = None
        self.layer, self.scope = layer, scope  # where its forward ran: its backward's kernels belong there
        self.dtypes: list = []  # its inputs' dtypes: a gradient of another dtype is cast to its input's
        self.group = group  # (name, copies) of the equal copies it is one of, run in turn; None if single
        self.function = False  # an autograd.Function's (a PyNode): its saved tensors are released first to last

    def __lt__(self, other: Node) -> bool:  # heapq pops the smallest: make that the highest seq
        return self.seq > other.seq


class Graph(Checkpointing, Backward):
    """Ops record nodes here; backward() runs them; checkpoint() and the rebuild mirror torch's."""

    def __init__(self, mem: LiveBytes):
        self.mem = mem
        self.seq = 0
        self.grad_enabled = True
        self._layer: int | None = None  # the block being run (see layer)
        self.saved_terms: list[SavedTerm] | None = None  # see record_saves()
        self.saved_ids: dict[int, weakref.ref] = {}  # id of each storage noted -> the storage, while it lives
        self.scope = ""  # the part of the model running, for SavedTerm.scope
        self.frame: Frame | None = None  # the checkpoint region running forward
        self.rebuilding: Frame | None = None  # the region being recomputed in backward
        self.recomputing = False  # a reentrant checkpoint's function running again in backward
        self.rebuilt_bytes = 0  # the most activation bytes one recompute brought back
        self.in_backward = False
        self.flops: dict[tuple[str, str], int] = {}  # (forward | backward | recompute, kind) -> FLOPs
        self.kernels: list[Kernel] | None = None  # every kernel launched, when recording
        self.stage = "forward"  # outside backward: forward, or the recipe's accumulate | optimizer
        self.autocast = None  # the autocast region running (memcalc.exact.aten.cast_policy.Autocast), if any
        self.fp8 = ""  # torchao's float8 recipe the blocks' linears train in (memcalc.exact.aten.float8), if any
        self.region: tuple[str, int] | None = None  # (name, copies) of the equal copies running, if any
        self.recording = None  # what each allocation is, under a timeline (memcalc.exact.sim.events.Recording)
        self.stream = 0  # the CUDA stream allocations are made on: the default, unless a library switches (FSDP2)
        self.post_accumulate = None  # a parameter's post-accumulate-grad hook (torchtune's optimizer in backward)
        self.offload: Offloader | None = None  # an activation offloading context's hooks (memcalc.exact.sim.offload)
        # the step as verify's TorchDispatchMode sees it (StepConfig.watched): there every tensor is subclass-like, and
        # backward formulas that branch on it (gather's, index_select's) run out of place
        self.watched = False

    @property
    def copies(self) -> int:
        """How many equal copies what runs now stands for: a region's, else 1."""
        return 1 if self.region is None else self.region[1]

    @contextlib.contextmanager
    def repeated(self, name: str, copies: int):
        """What runs inside is `copies` equal copies run in turn, simulated once (memcalc.exact.sim.tensors.Region);
        name tells the copies of one group apart from another's (their nodes, in backward)."""
        if copies == 1:
            yield
            return
        self.enter_region((name, copies))
        try:
            yield
        except StopRecompute:  # the copies before the last would run what the last stops before
            raise RuntimeError("a recompute stopped early inside a region of equal copies") from None
        finally:
            self.leave_region()

    def enter_region(self, group: tuple[str, int]) -> None:
        self.region = group
        self.mem.open_region(group[1])

    def leave_region(self) -> None:
        if self.region is not None:
            self.region = None
            self.mem.close_region()

    def each(self, params: list[Tensor]):
        """The parameters in turn, as a per-tensor loop visits them: a run of one group's copies (a layer's
        equal experts) inside its region, so that their temporaries peak as they would one after another."""
        for p in params:
            group = group_of(p)
            if group != self.region:
                self.leave_region()
                if group is not None:
                    self.enter_region(group)
            yield p
        self.leave_region()

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
        recompute = self.rebuilding is not None or self.recomputing
        phase = "recompute" if recompute else "backward" if self.in_backward else self.stage
        n = self.copies  # in a region: one copy's kernel, run by each; outside, it reads every copy of a tensor
        if count:
            self.flops[(phase, count)] = self.flops.get((phase, count), 0) + n * int(counted or flops)
        if self.kernels is None:
            return
        read = written = most = 0
        for t in reads:
            if t is not None:
                read += t if t.__class__ is int else t.nbytes if n > 1 else t.nbytes * t.copies
        for t in writes:
            if t.__class__ is int:  # bytes written into a tensor that exists already (an amax slot)
                written += t
                continue
            each = 1 if n > 1 else t.copies
            written += t.nbytes * each
            most = max(most, t.numel * each)
        if flops is None:  # elementwise: its arithmetic per element times the elements written
            flops = VECTOR_FLOPS.get(op, 1) * most
        self.kernels.append(Kernel(op, unit, dtype, int(flops), int(counted or flops) if count else 0, count,
                                   read, written, phase, self.scope, self.layer, n))  # fmt: skip

    # -- tensors -----------------------------------------------------------------------------
    def empty(self, shape, dtype: str, op: str, kind: str = "activation", copies: int | None = None) -> Tensor:
        """A new tensor; copies: how many equal ones it stands for (default: the running region's)."""
        shape, copies = tuple(shape), self.copies if copies is None else copies
        n = elements(shape)
        return Tensor(self.storage(n * ITEMSIZE[dtype] * copies, op, kind, copies), shape, dtype, n)

    def storage(self, nbytes: int, op: str, kind: str, copies: int) -> Storage:
        """A new tensor's storage (memcalc.exact.replay.inductor's graph numbers its own; a recording notes its
        origin)."""
        if self.recording is not None:
            return self.recording.storage(self, nbytes, op, kind, copies)
        return Storage(self.mem, nbytes, op, kind, copies)

    def view(self, t: Tensor, shape) -> Tensor:
        """A tensor over t's storage (no node: callers attach one when t needs grad)."""
        return Tensor(t.storage, shape, t.dtype, copies=t.copies)

    def leaf(self, t: Tensor) -> Tensor:
        """t made a leaf that requires grad (requires_grad_(True) on a tensor no gradient reaches): its gradient is
        accumulated into its .grad."""
        if t.grad_fn is None:
            t.grad_fn = Node("AccumulateGrad", LEAF_SEQ, [], None, 1, self.layer, self.scope)
            t.grad_fn.leaf = t
        return t

    def param(self, shape, dtype: str, name: str, copies: int = 1) -> Tensor:
        """A parameter; with copies > 1, that many equal ones (a group of equal experts: see group_of)."""
        t = self.empty(shape, dtype, "param " + name, kind="param", copies=copies)
        t.name = name
        t.grad_fn = Node("AccumulateGrad", LEAF_SEQ, [], None, 1, layer_of(name), group=group_of(t))
        t.grad_fn.leaf = t
        return t

    # -- forward -----------------------------------------------------------------------------
    def begin(self, name: str, inputs: list, rule: Callable, saved: list[tuple[Tensor, str]] = (),
              function: bool = False) -> Node | None:  # fmt: skip
        """Before an op's kernel runs: its node, if any input needs grad, and the inputs it saves.
        (Autograd packs saved inputs before the kernel and saved outputs after: see end().) function: an
        autograd.Function's node (Node.function)."""
        if not self.grad_enabled:
            return None
        edges = [None if t is None or t.grad_fn is None else (t.grad_fn, t.output_nr) for t in inputs]
        if edges.count(None) == len(edges):  # no input needs grad
            return None
        self.seq += 1
        node = Node(name, self.seq, edges, rule, 0, self.layer, self.scope, self.region)
        node.dtypes = [None if t is None else t.dtype for t in inputs]
        node.function = function
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
        if self.rebuilding is not None:  # recomputing a checkpoint region: the frame takes what a node still needs
            frame = self.rebuilding
            frame.repacked += 1
            if frame.holders[frame.repacked - 1]() is not None:  # else the node that saved it has died
                frame.recomputed[frame.repacked - 1] = t.storage
            if frame.repacked == frame.n_saved:
                raise StopRecompute  # torch's early stop: the last saved tensor is rebuilt
            return t.storage  # the recompute's own node holds it (the pack hook's x.detach()) while it lives
        if self.frame is not None:  # inside a checkpoint region: a placeholder, no bytes kept
            slot = Slot(self.frame, self.frame.n_saved)
            self.frame.holders.append(weakref.ref(slot))
            return slot
        self.note_saved(t, op, what)
        return t.storage if self.offload is None else self.offload.pack(t)

    def mark(self, t: Tensor, role: str, detail: str) -> None:
        """Under a timeline, what t's storage turned out to be (memcalc.exact.sim.events.Recording.note)."""
        if self.recording is not None:
            self.recording.note(t.storage, role, detail)

    def record_saves(self) -> None:
        """From now on, note every activation storage saved for backward, once per storage."""
        self.saved_terms, self.saved_ids = [], {}

    def note_saved(self, t: Tensor, op: str, what: str) -> None:
        self.mark(t, "saved", f"{op}: {what}")
        if self.saved_terms is None or t.storage.kind != "activation":
            return
        noted = self.saved_ids.get(id(t.storage))
        if noted is not None and noted() is t.storage:  # once per storage; one freed in forward (saved by a
            return  # node nothing needs: a frozen block's checkpoint) may leave its id to a new one
        self.saved_ids[id(t.storage)] = weakref.ref(t.storage)
        s = t.storage
        self.saved_terms.append(SavedTerm(op, what, s.nbytes // s.copies, t.dtype, t.shape, self.layer, self.scope,
                                          s.copies))  # fmt: skip


def scope_of(name: str) -> str:
    """The scope a parameter's optimizer and accumulation kernels run in: "experts" for a routed expert's
    weights (a layout splits them over ep), else none."""
    return "experts" if ".experts." in name else ""


def group_of(p: Tensor) -> tuple[str, int] | None:
    """The group of equal copies a parameter (or its shard, named as it) stands for: (the name up to the
    expert's, copies); None for a single one. Its region in backward and in per-tensor loops is that."""
    if p.copies == 1:
        return None
    parts = p.name.split(".")
    return ".".join(parts[: parts.index("experts") + 2]), p.copies


def layer_of(name: str) -> int | None:
    """The block a parameter belongs to, from its name: the first number in it (blocks.3.attn.wq.weight,
    model.layers.3.self_attn.q_proj.weight -> 3); None outside the blocks (tok_emb.weight)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)
