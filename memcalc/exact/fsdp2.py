"""One rank of FSDP2 as torchtitan runs it, replayed in bytes: the step memcalc.exact simulates, with
FSDP2's own allocations at the moments its hooks make them.

What one rank runs (torch 2.13 torch/distributed/fsdp/_fully_shard; torchtitan
torchtitan/distributed/fsdp.py apply_fsdp_to_decoder, its train step, torch.optim.AdamW fused):
  state      each parameter's dim-0 shard, padded to a multiple of G rows, in fp32 (_fsdp_param.py
             _sharded_param_data); AdamW's m and v of the unpadded shard (zeros_like of the DTensor) and
             its step counter (fused: a 4-byte tensor on the device); the sharded fp32 gradients, one
             reduce-scatter output per unit, from the previous step until zero_grad(set_to_none=True)
  units      torchtitan's fully_shard calls: the token table, [final norm, lm_head] (a tied table: [table,
             final norm]), each block, and the root (what is left: a learned position table)
  all-gather _fsdp_collectives.py foreach_all_gather: a bf16 copy of the unit's shards (the input, freed
             once copied in), the bf16 output of G shards; wait_for_unshard copies it out into each
             parameter's unsharded storage (_fsdp_param.py alloc_all_gather_outputs, padded rows); in
             forward the output is kept until the next unit's copy-out (comm_ctx.all_gather_state), in
             backward freed at once
  reshard    after forward (the policy: blocks and the table unless pipelined; [norm, lm_head] only
             'always'; the root never), and after backward (always); frees the unsharded storages
  backward   each unit's pre-backward unshards it and prefetches the unit that ran before it in forward
             (_backward_prefetch); its post-backward takes its bf16 gradients, reshards, frees the previous
             unit's reduce-scatter input (reduce_scatter_max_input_buffers = 1), allocates its own in fp32
             (reduce_dtype), copies the gradients in and drops them (foreach_reduce: the last one stays
             referenced by its loop variable until the function returns), allocates the fp32 output shard
             that becomes the sharded gradient
verify/builder.py's model computes the logits with F.linear on lm_head's weight (lm_head's forward never
runs): the root's post-forward completes [norm, lm_head] (_force_complete_incomplete_states) and hooks its
pre-backward on the loss. Units whose inputs need no gradient (the token table, the root) run their
post-backward in the root's final callback (_root_post_backward_final_callback), before backward returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks

from . import mirror
from .config import Config, Phases
from .sim import Graph, Memory, Node, Tensor

PARTS = ("sharded state", "sharded gradients", "FSDP2 unsharded parameters", "FSDP2 all-gather buffers",
         "bf16 unsharded gradients", "FSDP2 reduce-scatter inputs", "inputs and buffers", "activations and temporaries")  # fmt: skip
CATEGORY = (("FSDP2 shard ", "sharded state"), ("AdamW ", "sharded state"), ("FSDP2 sharded grads", "sharded gradients"),
            ("FSDP2 reduce-scatter output", "sharded gradients"), ("FSDP2 unsharded ", "FSDP2 unsharded parameters"),
            ("FSDP2 all-gather ", "FSDP2 all-gather buffers"), ("FSDP2 reduce-scatter input", "FSDP2 reduce-scatter inputs"),
            ("input", "inputs and buffers"), ("buffer ", "inputs and buffers"), ("param ", "stand-ins"))  # fmt: skip


def category(op: str) -> str:
    """The part of a rank's memory an allocation belongs to, by the op that made it."""
    return next((part for prefix, part in CATEGORY if op.startswith(prefix)), "activations and temporaries")


class Ledger(Memory):
    """memcalc.exact.sim.Memory that also keeps live bytes by part, and their split at each phase's peak.
    grads(): the bf16 unsharded gradients live now (sim activations autograd stole into .grad), moved from
    'activations and temporaries' to their own part."""

    def __init__(self, timeline: bool = False):
        super().__init__(timeline=[] if timeline else None)
        self.parts: dict[str, int] = dict.fromkeys(PARTS + ("stand-ins",), 0)
        self.at_peak: dict[str, int] = {}
        self.grads = lambda: 0

    def alloc(self, nbytes: int, op: str) -> None:
        self.parts[category(op)] += nbytes
        higher = self.live_bytes + nbytes > self.peak_bytes
        super().alloc(nbytes, op)
        if higher:
            self.at_peak = self.split()

    def free(self, nbytes: int, op: str) -> None:
        self.parts[category(op)] -= nbytes
        super().free(nbytes, op)

    def reset_peak(self) -> None:
        super().reset_peak()
        self.at_peak = self.split()

    def split(self) -> dict[str, int]:
        out = {part: self.parts[part] for part in PARTS}
        grads = self.grads()
        out["bf16 unsharded gradients"] = grads
        out["activations and temporaries"] -= grads
        return out


@dataclass(frozen=True)
class Param:
    name: str
    dims: tuple[int, ...]  # on this TP rank

    def padded(self, g: int) -> int:
        """Elements of one rank's padded shard: ⌈d0/G⌉ rows (FSDP2 pads dim 0 to a multiple of G)."""
        return -(-self.dims[0] // g) * math.prod(self.dims[1:])

    def chunk(self, g: int, rank: int) -> int:
        """Elements of this rank's unpadded shard (torch.chunk's piece)."""
        c = -(-self.dims[0] // g)
        return max(0, min(c, self.dims[0] - rank * c)) * math.prod(self.dims[1:])


@dataclass(frozen=True)
class Unit:
    """One fully_shard call's parameter group."""

    name: str
    params: tuple[Param, ...]
    reshard_after_forward: bool


def units_for(shape: ModelShape, params: list[Param], reshard: bool | None, pipelined: bool = False) -> list[Unit]:
    """torchtitan's apply_fsdp_to_decoder, in its order of fully_shard calls. reshard: the policy ('always'
    True, 'never' False, None 'default': not under pipeline parallel, get_fsdp_reshard_after_forward_policy)."""
    policy = (not pipelined) if reshard is None else reshard
    always = reshard is True
    by_name = {p.name: p for p in params}

    def take(prefix: str) -> list[Param]:
        return [p for p in params if p.name == prefix or p.name.startswith(prefix + ".")]

    out = []
    if shape.tied_embeddings:
        out.append(Unit("tok_emb, norm", tuple(take("tok_emb") + take("norm")), always))
    else:
        out.append(Unit("tok_emb", tuple(take("tok_emb")), policy))
        out.append(Unit("norm, lm_head", tuple(take("norm") + take("lm_head")), always))
    out += [Unit(f"blocks.{i}", tuple(take(f"blocks.{i}")), policy) for i in range(shape.n_layers)]
    placed = {p.name for u in out for p in u.params}
    rest = tuple(p for p in by_name.values() if p.name not in placed)
    if rest:  # fully_shard(model): the root keeps what no child took (reshard_after_forward None: not the root)
        out.append(Unit("root", rest, False))
    return out


class Group:
    """FSDPParamGroup of one unit on one rank, its storages as sim tensors."""

    def __init__(self, unit: Unit, g: int, rank: int, sim: Graph, param_dtype: str):
        self.unit, self.g, self.sim, self.param_dtype = unit, g, sim, param_dtype
        self.sharded = [sim.empty((p.padded(g),), "fp32", f"FSDP2 shard {p.name}", kind="state") for p in unit.params]
        self.m = [sim.empty((p.chunk(g, rank),), "fp32", "AdamW exp_avg", kind="state") for p in unit.params]
        self.v = [sim.empty((p.chunk(g, rank),), "fp32", "AdamW exp_avg_sq", kind="state") for p in unit.params]
        self.steps = [sim.empty((1,), "fp32", "AdamW step", kind="state") for _ in unit.params]
        self.grads: Tensor | None = None  # the reduce-scatter output the sharded gradients view
        self.unsharded: list[Tensor] | None = None
        self.all_gather_output: Tensor | None = None  # pending: all-gathered, not yet copied out
        self.state = "idle"
        self.post_forward_indices: list[int] = []

    @property
    def shard_numel(self) -> int:
        return sum(p.padded(self.g) for p in self.unit.params)

    def unshard(self) -> None:
        """foreach_all_gather: the param_dtype copy of the shards (freed once copied into the output), then the
        output. Without a cast (param_dtype fp32: FSDPParamGroup._init_mp_dtypes drops it) the shards are the
        all-gather's inputs themselves (_get_param_all_gather_inputs: no foreach copy)."""
        if self.all_gather_output is not None or self.unsharded is not None:
            return
        copy_in = None
        if self.param_dtype != "fp32":
            copy_in = self.sim.empty((self.shard_numel,), self.param_dtype, "FSDP2 all-gather input")
        self.all_gather_output = self.sim.empty((self.shard_numel * self.g,), self.param_dtype,
                                                "FSDP2 all-gather output")  # fmt: skip
        del copy_in

    def wait_for_unshard(self, fsdp: FSDP2) -> None:
        """Copy-out into each parameter's unsharded storage (padded rows). Forward keeps the output until the
        next unit's copy-out (the previous one's is freed as this wait returns); backward frees it now."""
        if self.all_gather_output is None:
            return
        previous = fsdp.all_gather_state if self.state == "forward" else None
        if self.state == "forward":
            fsdp.all_gather_state = None
        self.unsharded = [self.sim.empty((p.padded(self.g) * self.g,), self.param_dtype, f"FSDP2 unsharded {p.name}")
                          for p in self.unit.params]  # fmt: skip
        if self.state == "forward" and self.g > 1:
            fsdp.all_gather_state = self.all_gather_output
        self.all_gather_output = None
        del previous

    def reshard(self) -> None:
        self.unsharded = None

    def pre_forward(self, fsdp: FSDP2) -> None:
        self.state = "forward"
        self.unshard()
        self.wait_for_unshard(fsdp)

    def post_forward(self, fsdp: FSDP2) -> None:
        if self.unit.reshard_after_forward:
            self.reshard()
        self.post_forward_indices.append(len(fsdp.post_forward_order))
        fsdp.post_forward_order.append(self)
        self.state = "idle"

    def pre_backward(self, fsdp: FSDP2) -> None:
        if self.state == "pre_backward":
            return
        self.state = "pre_backward"
        self.unshard()
        self.wait_for_unshard(fsdp)
        if self.post_forward_indices:  # _backward_prefetch: the unit that ran before this one in forward
            i = self.post_forward_indices.pop()
            if i > 0:
                target = fsdp.post_forward_order[i - 1]
                outer, target.state = target.state, "pre_backward"
                target.unshard()
                target.state = outer

    def post_backward(self, fsdp: FSDP2) -> None:
        """post_backward and foreach_reduce, in their order."""
        self.state = "post_backward"
        grads = fsdp.inflight = []
        for p in fsdp.sim_params(self.unit):
            if p.grad is not None:
                grads.append(p.grad)
                p.grad = None
        self.reshard()
        if fsdp.reduce_scatter_inputs:  # the oldest kept reduce-scatter input goes first
            fsdp.reduce_scatter_inputs.pop(0)
        if not grads:
            return
        numel = sum(p.padded(self.g) * self.g for p in self.unit.params)
        rs_input = self.sim.empty((numel,), "fp32", "FSDP2 reduce-scatter input")
        last = grads[-1] if self.g > 1 else None  # foreach_reduce's loop variable holds the last one
        grads.clear()
        fsdp.inflight = [last] if last is not None else []
        output = self.sim.empty((numel // self.g,), "fp32", "FSDP2 reduce-scatter output")
        if self.grads is None:
            self.grads = output  # the new sharded gradients view it
        fsdp.inflight = []
        del output, last
        fsdp.reduce_scatter_inputs.append(rs_input)


class FSDP2:
    """The rank's units and the state they share (FSDPCommContext)."""

    def __init__(self, sim: Graph, units: list[Unit], g: int, rank: int, param_dtype: str):
        self.sim, self.g = sim, g
        self.groups = [Group(u, g, rank, sim, param_dtype) for u in units]
        self.by_name = {gr.unit.name: gr for gr in self.groups}
        self.all_gather_state: Tensor | None = None
        self.post_forward_order: list[Group] = []
        self.reduce_scatter_inputs: list[Tensor] = []
        self.params: dict[str, Tensor] = {}  # the simulated model's parameters, by name
        self.params_tied = False  # a tied table: one unit [table, final norm], no RegisterPostBackward on it
        self.inflight: list[Tensor] = []  # the gradients a post-backward holds between .grad and its reduce

    def unsharded_grad_bytes(self) -> int:
        """The bf16 unsharded gradients live now: on the parameters, or held by a post-backward."""
        if not self.sim.in_backward and not self.inflight:
            return 0
        live = {id(t.storage): t.storage.nbytes for t in self.params.values() if t.grad is not None}
        live |= {id(t.storage): t.storage.nbytes for t in self.inflight}
        return sum(live.values())

    def sim_params(self, unit: Unit) -> list[Tensor]:
        return [self.params[p.name] for p in unit.params]

    def group_of(self, name: str) -> Group | None:
        return next((gr for gr in self.groups if any(p.name == name for p in gr.unit.params)), None)

    def begin_step(self) -> None:
        """The previous step's sharded gradients (one reduce-scatter output per unit)."""
        for gr in self.groups:
            gr.grads = self.sim.empty((gr.shard_numel,), "fp32", "FSDP2 sharded grads", kind="state")

    def zero_grad(self) -> None:
        """torch.optim zero_grad(set_to_none=True), the first thing torchtitan's train step does."""
        for gr in self.groups:
            gr.grads = None


class FSDPGraph(Graph):
    """memcalc.exact.sim.Graph whose block and unit boundaries fire FSDP2's hooks (see the module doc)."""

    def __init__(self, mem: Memory, cpu_norm_stats: bool = False):
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
    def empty(self, shape, dtype: str, op: str, kind: str = "activation") -> Tensor:
        if self.cpu_norm_stats and op == "native_layer_norm" and dtype == "fp32" and tuple(shape)[-1] == 1:
            dtype = self.stats_dtype  # aten.native_layer_norm's CPU kernel: mean and rstd in the input's dtype
        t = super().empty(shape, dtype, op, kind)
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
        """The step as memcalc.exact.config.Phases counts one GPU's: state less the inputs, every peak."""
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
                 timeline: bool = False) -> tuple[Fsdp2Phases, Memory]:  # fmt: skip
    """The measured step of one FSDP2 rank (tp = 1, pp = 1) of `ranks` sharding ranks: zero_grad, forward,
    backward, fused AdamW. reshard: reshard_after_forward (None: torchtitan's default policy). params: the
    parameter tensors as verify/builder.py registers them (on this TP rank; None: the built model's, tp = 1);
    param_dtype is the precision's
    (bf16, or fp32: torchtitan's mixed_precision_param). cpu_norm_stats: LayerNorm's statistics as the CPU
    kernel keeps them (the fake process group runs CPU kernels), not CUDA's fp32."""
    cfg = Config(shape, seq_len, micro_batch, tricks.precision, tricks.flash, tricks.recompute, 1, "adamw",
                 "reference", "pure", "fused", ckpt_every=tricks.ckpt_every)  # fmt: skip
    mem = Ledger(timeline)
    sim = FSDPGraph(mem, cpu_norm_stats)
    sim.stats_dtype = tricks.precision
    model = mirror.build(sim, cfg)
    mem.live_bytes -= mem.parts["stand-ins"]  # the built weights stand in for the unsharded ones: not resident
    mem.parts["stand-ins"] = 0
    if params is None:
        params = [Param(p.name, tuple(int(d) for d in p.shape)) for p in model.params]
    inputs = verify_inputs(sim, seq_len, micro_batch)
    inputs_bytes = sum(t.storage.nbytes for t in inputs)
    idx, targets = (sim.view(inputs[0], (micro_batch, seq_len)),) * 2 if len(inputs) == 1 else inputs
    units = units_for(shape, params, reshard)
    fsdp = FSDP2(sim, units, ranks, rank, tricks.precision)
    fsdp.params = {p.name: p for p in model.params}
    fsdp.params_tied = shape.tied_embeddings
    mem.grads = fsdp.unsharded_grad_bytes
    fsdp.begin_step()
    state = mem.live_bytes
    sim.fsdp = fsdp
    mem.phase = "forward"
    mem.reset_peak()
    fsdp.zero_grad()
    loss = mirror.forward(sim, model, idx, targets)
    sim.root_post_forward()
    forward = (mem.peak_bytes, mem.peak_at, mem.at_peak)
    retained = mem.parts["activations and temporaries"]
    mem.phase = "backward"
    mem.reset_peak()
    sim.backward(loss)
    del loss
    backward = (mem.peak_bytes, mem.peak_at, mem.at_peak)
    mem.phase = "optimizer"
    mem.reset_peak()  # fused AdamW updates in place: its peak is what backward leaves
    optimizer = mem.peak_bytes
    return Fsdp2Phases(state, forward[0], backward[0], optimizer, forward[1], backward[1], forward[2], backward[2],
                       inputs_bytes, retained, mem.parts["sharded gradients"]), mem  # fmt: skip


def fsdp2_step(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, ranks: int,
               reshard: bool | None) -> Phases:  # fmt: skip
    """Rank 0's step on CUDA's kernels, as the fsdp2 stack's verdict counts it: kept on disk between runs
    (memcalc.exact.cache), as one GPU's step is."""
    from dataclasses import asdict

    from .cache import remembered

    key = (shape, seq_len, micro_batch, tricks, ranks, reshard)
    replay = lambda: asdict(fsdp2_phases(shape, seq_len, micro_batch, tricks, ranks, reshard)[0].phases())
    return Phases(**remembered("fsdp2", key, replay))
