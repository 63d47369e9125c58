"""One rank of FSDP2 as torchtitan runs it, replayed in bytes: the step memcalc.exact simulates, with
FSDP2's own allocations at the moments its hooks make them (what each unit allocates at each hook:
memcalc.exact.replay.fsdp2_units). Here: a rank's memory by part (Ledger), the graph whose block and unit
boundaries fire the hooks (FSDPGraph), and the step and its phases (fsdp2_phases, fsdp2_step).

verify/builder.py's model computes the logits with F.linear on lm_head's weight (lm_head's forward never
runs): the root's post-forward completes [norm, lm_head] (_force_complete_incomplete_states) and hooks its
pre-backward on the loss. Units whose inputs need no gradient (the token table, the root) run their
post-backward in the root's final callback (_root_post_backward_final_callback), before backward returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK
from memcalc.model.tricks import Tricks

from ..base.config import Phases, StepConfig
from ..sim.events import Recording
from ..sim.graph import Graph, Node
from ..sim.tensors import LiveBytes, Tensor
from . import meta
from .fsdp2_units import FSDP2, Param, units_for

PARTS = ("sharded state", "sharded gradients", "FSDP2 unsharded parameters", "FSDP2 all-gather buffers",
         "bf16 unsharded gradients", "FSDP2 reduce-scatter inputs", "inputs and buffers", "activations and temporaries")  # fmt: skip
CATEGORY = (("FSDP2 shard ", "sharded state"), ("AdamW ", "sharded state"), ("FSDP2 sharded grads", "sharded gradients"),
            ("FSDP2 reduce-scatter output", "sharded gradients"), ("FSDP2 unsharded ", "FSDP2 unsharded parameters"),
            ("FSDP2 all-gather ", "FSDP2 all-gather buffers"), ("FSDP2 reduce-scatter input", "FSDP2 reduce-scatter inputs"),
            ("input", "inputs and buffers"), ("buffer ", "inputs and buffers"), ("param ", "stand-ins"))  # fmt: skip


def category(op: str) -> str:
    """The part of a rank's memory an allocation belongs to, by the op that made it."""
    return next((part for prefix, part in CATEGORY if op.startswith(prefix)), "activations and temporaries")


class Ledger(LiveBytes):
    """memcalc.exact.sim.tensors.LiveBytes that also keeps live bytes by part, and their split at each phase's peak.
    grads(): the bf16 unsharded gradients live now (sim activations autograd stole into .grad), moved from
    'activations and temporaries' to their own part."""

    def __init__(self, timeline: bool = False):
        super().__init__(timeline=[] if timeline else None)
        self.parts: dict[str, int] = dict.fromkeys(PARTS + ("stand-ins",), 0)
        self.at_peak: dict[str, int] = {}
        self.grads = lambda: 0
        self.recording: Recording | None = None  # each allocation's origin and stream, where recorded

    def alloc(self, nbytes: int, op: str, copies: int = 1) -> None:
        self.parts[category(op)] += nbytes
        higher = self.live_bytes + nbytes > self.peak_bytes
        super().alloc(nbytes, op, copies)
        if higher:
            self.at_peak = self.split()

    def free(self, nbytes: int, op: str, copies: int = 1) -> None:
        self.parts[category(op)] -= nbytes
        super().free(nbytes, op, copies)

    def reset_peak(self) -> None:
        super().reset_peak()
        self.at_peak = self.split()

    def split(self) -> dict[str, int]:
        out = {part: self.parts[part] for part in PARTS}
        grads = self.grads()
        out["bf16 unsharded gradients"] = grads
        out["activations and temporaries"] -= grads
        return out


class FSDPGraph(Graph):
    """memcalc.exact.sim.graph.Graph whose block and unit boundaries fire FSDP2's hooks (see the module doc)."""

    def __init__(self, mem: LiveBytes, cpu_norm_stats: bool = False):
        super().__init__(mem)
        self.fsdp: FSDP2 | None = None
        self.current: int | str | None = None  # forward: the block running; backward: the unit
        self.ones: Tensor | None = None
        self.cpu_norm_stats = cpu_norm_stats  # the CPU kernel's LayerNorm mean and rstd: its input's dtype

    # -- forward: the block loop sets layer, the embedding and the final norm open scopes ---------------
    @Graph.layer.setter
    def layer(self, value: int | None) -> None:
        Graph.layer.fset(self, value)
        f = self.fsdp
        if f is None or self.in_backward or self.rebuilding is not None:
            return
        if isinstance(self.current, int) and value != self.current:
            f.by_name[f"blocks.{self.current}"].post_forward(f)
        if isinstance(value, int) and value != self.current:
            f.by_name[f"blocks.{value}"].pre_forward(f)
        if value is None and isinstance(self.current, int):  # the blocks are done: the final norm runs next
            head = f.group_of("norm.weight")
            head.pre_forward(f)
        self.current = value

    def scoped(self, name: str):
        f = self.fsdp
        if f is not None and not self.in_backward and self.rebuilding is None:
            if name == "embedding" and self.current is None:
                root = f.by_name.get("root")
                if root is not None:
                    root.pre_forward(f)
                f.group_of("tok_emb.weight").pre_forward(f)
                self.current = "embedding"
            if name == "logits" and f.params_tied:  # the tied group completes with the final norm's forward
                f.group_of("norm.weight").post_forward(f)
        return super().scoped(name)

    def end(self, node, outputs, saved=()) -> None:
        super().end(node, outputs, saved)
        f = self.fsdp
        if f is None or self.in_backward or node is None or self.current != "embedding":
            return
        table = f.params["tok_emb.weight"]
        if node.name == "embedding" and any(e is not None and e[0] is table.grad_fn for e in node.edges):
            unit = f.group_of("tok_emb.weight")
            if unit.unit.name == "tok_emb":
                unit.post_forward(f)
            self.current = "after embedding"

    def root_post_forward(self) -> None:
        """The root's post-forward: its own group, the incomplete [norm, lm_head] (or tied) group, then the
        last all-gather output freed."""
        f = self.fsdp
        root = f.by_name.get("root")
        if root is not None:
            root.post_forward(f)
        if not f.params_tied:  # _force_complete_incomplete_states: lm_head's forward never ran
            f.group_of("norm.weight").post_forward(f)
        self.current = None
        state, f.all_gather_state = f.all_gather_state, None
        del state

    # -- backward: the engine's nodes, in order ------------------------------------------------------
    def empty(self, shape, dtype: str, op: str, kind: str = "activation", copies: int | None = None) -> Tensor:
        if self.cpu_norm_stats and op == "native_layer_norm" and dtype == "fp32" and tuple(shape)[-1] == 1:
            dtype = self.stats_dtype  # aten.native_layer_norm's CPU kernel: mean and rstd in the input's dtype
        t = super().empty(shape, dtype, op, kind, copies)
        if op == "ones_like" and self.fsdp is not None and self.in_backward is False and self.current == "loss":
            self.ones = t  # torch.autograd.backward's grad of the loss: it outlives the final callback
        return t

    def backward(self, root: Tensor) -> None:
        self.current = "loss"
        super().backward(root)
        self.final_callback()
        self.ones = None

    def run(self, node: Node, grads: list) -> list:
        f = self.fsdp
        if f is not None:
            self.before_node(f, node)
        return super().run(node, grads)

    def before_node(self, f: FSDP2, node: Node) -> None:
        head = f.group_of("norm.weight")
        if self.current == "loss":  # the hooks on the loss: the root's, then [norm, lm_head]'s
            root = f.by_name.get("root")
            if root is not None:
                root.pre_backward(f)
            if not f.params_tied:
                head.pre_backward(f)
            self.current = "head"
        if self.current == "head" and f.params_tied and node.scope == "final norm":
            head.pre_backward(f)
        layer = node.layer
        if isinstance(layer, int) and layer != self.current:
            if isinstance(self.current, int):
                f.by_name[f"blocks.{self.current}"].post_backward(f)
            elif not f.params_tied:
                head.post_backward(f)
            f.by_name[f"blocks.{layer}"].pre_backward(f)
            self.current = layer
        elif layer is None and isinstance(self.current, int):
            f.by_name[f"blocks.{self.current}"].post_backward(f)
            self.current = "embedding"
        if self.current == "embedding" and not f.params_tied:
            table = f.params["tok_emb.weight"]
            if any(e is not None and e[0] is table.grad_fn for e in node.edges):
                f.by_name["tok_emb"].pre_backward(f)

    def final_callback(self) -> None:
        """_root_post_backward_final_callback: the post-backward of every unit that has not run one (root
        first: the states in named_modules() order), then the kept reduce-scatter inputs freed."""
        f = self.fsdp
        order = [gr for gr in f.groups if gr.unit.name == "root"] + [gr for gr in f.groups if gr.unit.name != "root"]
        for gr in order:
            if gr.state != "post_backward":
                gr.post_backward(f)
            gr.state = "idle"
            gr.post_forward_indices.clear()  # finalize_backward
        f.post_forward_order.clear()
        f.reduce_scatter_inputs.clear()


def verify_inputs(sim: Graph, seq_len: int, micro_batch: int) -> list[Tensor]:
    """verify/dist_measure.py inputs(): one (b, s + 1) int64 draw, idx = [:, :-1] and targets = [:, 1:] made
    contiguous. At b = 1 both slices are contiguous already: views of the draw, one storage of s + 1 ids."""
    if micro_batch == 1:
        return [sim.empty((1, seq_len + 1), "int64", "input", kind="input")]
    return [sim.empty((micro_batch, seq_len), "int64", "input", kind="input") for _ in range(2)]


@dataclass(frozen=True)
class Fsdp2Phases:
    """One rank's measured-step bytes, as torch's fake process group counts them."""

    state_bytes: int  # live between steps: shards, AdamW state and step counters, sharded grads, inputs
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    forward_peak_at: str
    backward_peak_at: str
    forward_parts: dict[str, int]  # the forward peak split by part (PARTS)
    backward_parts: dict[str, int]
    inputs_bytes: int = 0  # the token ids, in state_bytes
    retained_bytes: int = 0  # what forward leaves alive: saved tensors and the loss
    grads_bytes: int = 0  # the sharded gradients backward leaves

    def phases(self) -> Phases:
        """The step as memcalc.exact.base.config.Phases counts one GPU's: state less the inputs, every peak."""
        return Phases(self.state_bytes - self.grads_bytes - self.inputs_bytes, self.inputs_bytes,
                      self.state_bytes - self.inputs_bytes, self.retained_bytes, self.grads_bytes,
                      self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes,
                      self.forward_peak_at, self.backward_peak_at, "optimizer: (start)")  # fmt: skip

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)

    @property
    def peak_parts(self) -> dict[str, int]:
        """The split of the step's peak (forward's or backward's: fused AdamW allocates nothing)."""
        return self.backward_parts if self.backward_peak_bytes >= self.forward_peak_bytes else self.forward_parts


def fsdp2_phases(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, ranks: int, reshard: bool | None,
                 rank: int = 0, params: list[Param] | None = None, cpu_norm_stats: bool = False,
                 timeline: bool = False, warm_up: bool = False) -> tuple[Fsdp2Phases, LiveBytes]:  # fmt: skip
    """The measured step of one FSDP2 rank (tp = 1, pp = 1) of `ranks` sharding ranks: zero_grad, forward,
    backward, fused AdamW. reshard: reshard_after_forward (None: torchtitan's default policy). params: the
    parameter tensors as verify/builder.py registers them (on this TP rank; None: the built model's, tp = 1);
    param_dtype is the precision's
    (bf16, or fp32: torchtitan's mixed_precision_param). cpu_norm_stats: LayerNorm's statistics as the CPU
    kernel keeps them (the fake process group runs CPU kernels), not CUDA's fp32. timeline: every allocation
    recorded (mem.timeline, and sim.recording: each one's origin and stream), the built stand-ins noted as
    elsewhere. warm_up: a first step runs before the measured one, with no gradients before it, making
    AdamW's state in its optimizer step (as torch's does), in place of the state made up front."""
    cfg = StepConfig(shape, seq_len, micro_batch, tricks, replace(DEFAULT_STACK, recipe="pure", impl="fused"))
    mem = Ledger(timeline)
    sim = FSDPGraph(mem, cpu_norm_stats)
    if timeline:
        sim.recording = mem.recording = Recording(mem)
    sim.stats_dtype = tricks.precision
    model = meta.build(sim, cfg)
    if timeline:  # the built weights stand in for the unsharded ones: not on the GPU
        sim.recording.elsewhere.update(p.storage.event for p in model.params)
    mem.live_bytes -= mem.parts["stand-ins"]  # the built weights stand in for the unsharded ones: not resident
    mem.parts["stand-ins"] = 0
    if params is None:
        params = [Param(p.name, tuple(int(d) for d in p.shape)) for p in model.params]
    inputs = verify_inputs(sim, seq_len, micro_batch)
    inputs_bytes = sum(t.storage.nbytes for t in inputs)
    idx, targets = (sim.view(inputs[0], (micro_batch, seq_len)),) * 2 if len(inputs) == 1 else inputs
    units = units_for(shape, params, reshard)
    fsdp = FSDP2(sim, units, ranks, rank, tricks.precision, lazy_state=warm_up)
    fsdp.params = {p.name: p for p in model.params}
    fsdp.params_tied = shape.tied_embeddings
    mem.grads = fsdp.unsharded_grad_bytes
    sim.fsdp = fsdp
    if timeline:
        sim.recording.loaded = len(mem.timeline)
    if warm_up:
        train_step(sim, mem, fsdp, model, idx, targets)
    else:
        fsdp.begin_step()
    state = mem.live_bytes
    forward, retained, backward, optimizer = train_step(sim, mem, fsdp, model, idx, targets)
    return Fsdp2Phases(state, forward[0], backward[0], optimizer, forward[1], backward[1], forward[2], backward[2],
                       inputs_bytes, retained, mem.parts["sharded gradients"]), mem  # fmt: skip


def train_step(sim: FSDPGraph, mem: Ledger, fsdp: FSDP2, model, idx: Tensor, targets: Tensor) -> tuple:
    """torchtitan's train step on one rank: zero_grad, forward, backward, fused AdamW; each phase's peak (with
    its op and split), and what forward leaves alive."""
    mem.phase = "forward"
    mem.reset_peak()
    fsdp.zero_grad()
    loss = meta.forward(sim, model, idx, targets)
    sim.root_post_forward()
    forward = (mem.peak_bytes, mem.peak_at, mem.at_peak)
    retained = mem.parts["activations and temporaries"]
    mem.phase = "backward"
    mem.reset_peak()
    sim.backward(loss)
    del loss
    backward = (mem.peak_bytes, mem.peak_at, mem.at_peak)
    mem.phase = "optimizer"
    mem.reset_peak()  # fused AdamW updates in place: its peak is what backward leaves (or its first step's state)
    fsdp.optimizer_step()
    return forward, retained, backward, mem.peak_bytes


def fsdp2_step(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, ranks: int,
               reshard: bool | None) -> Phases:  # fmt: skip
    """Rank 0's step on CUDA's kernels, as the fsdp2 stack's verdict counts it: kept on disk between runs
    (memcalc.exact.base.cache), as one GPU's step is."""
    from dataclasses import asdict

    from ..base.cache import remembered

    key = (shape, seq_len, micro_batch, tricks, ranks, reshard)
    replay = lambda: asdict(fsdp2_phases(shape, seq_len, micro_batch, tricks, ranks, reshard)[0].phases())
    return Phases(**remembered("fsdp2", key, replay))
