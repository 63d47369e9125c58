"""FSDP2's units and their parameter groups on one rank, in bytes: which parameters each fully_shard call
takes (Param, Unit, units_for), what each group allocates and frees at each of its hooks (Group), and the
state the units share (FSDP2). memcalc.exact.replay.fsdp2 fires the hooks as the replayed step runs.

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
  streams    the caching allocator keeps each stream's freed blocks for that stream alone, so FSDP2's own
             streams hold blocks the step's cannot reuse: foreach_all_gather allocates the all-gather input
             and output under `with device_handle.stream(all_gather_copy_in_stream)` (the stream
             FSDPCommContext.get_all_gather_streams gives a synchronous unshard in forward and pre-backward);
             foreach_reduce allocates the reduce-scatter input on the current stream and its output under
             `with device_handle.stream(reduce_scatter_stream)`; the unsharded parameters
             (foreach_all_gather_copy_out) and everything else, on the current (default) stream. No
             record_stream: FSDP2 orders the streams by events and keeps the tensors referenced instead
  optimizer  fused AdamW makes a parameter's state in its first step (_init_group: step, exp_avg,
             exp_avg_sq, parameter by parameter in the model's order); FSDP2(lazy_state=True) makes it so
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from memcalc.model.shape import ModelShape

from ..sim.graph import Graph
from ..sim.tensors import Tensor

# The CUDA streams FSDP2 allocates on (memcalc.exact.sim.graph.Graph.stream), torch 2.13
# torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py FSDPCommContext.lazy_init
DEFAULT, ALL_GATHER_COPY_IN, REDUCE_SCATTER = 0, 1, 2


@contextlib.contextmanager
def on_stream(sim: Graph, stream: int):
    """`with device_handle.stream(stream)`: what is allocated inside is allocated on that stream."""
    outer, sim.stream = sim.stream, stream
    try:
        yield
    finally:
        sim.stream = outer


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

    def __init__(self, unit: Unit, g: int, rank: int, sim: Graph, param_dtype: str, lazy_state: bool = False):
        self.unit, self.g, self.rank, self.sim, self.param_dtype = unit, g, rank, sim, param_dtype
        self.sharded = [sim.empty((p.padded(g),), "fp32", f"FSDP2 shard {p.name}", kind="state") for p in unit.params]
        self.m: list[Tensor] = []
        self.v: list[Tensor] = []
        self.steps: list[Tensor] = []
        if not lazy_state:
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
        stream = ALL_GATHER_COPY_IN if self.state in ("forward", "pre_backward") else DEFAULT
        with on_stream(self.sim, stream):
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
        with on_stream(self.sim, REDUCE_SCATTER):
            output = self.sim.empty((numel // self.g,), "fp32", "FSDP2 reduce-scatter output")
        if self.grads is None:
            self.grads = output  # the new sharded gradients view it
        fsdp.inflight = []
        del output, last
        fsdp.reduce_scatter_inputs.append(rs_input)


class FSDP2:
    """The rank's units and the state they share (FSDPCommContext)."""

    def __init__(self, sim: Graph, units: list[Unit], g: int, rank: int, param_dtype: str, lazy_state: bool = False):
        self.sim, self.g = sim, g
        self.groups = [Group(u, g, rank, sim, param_dtype, lazy_state) for u in units]
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
        """The previous step's sharded gradients (one reduce-scatter output per unit, on its stream)."""
        with on_stream(self.sim, REDUCE_SCATTER):
            for gr in self.groups:
                gr.grads = self.sim.empty((gr.shard_numel,), "fp32", "FSDP2 sharded grads", kind="state")

    def optimizer_step(self) -> None:
        """Fused AdamW's step: in place, but the first makes each parameter's state (_init_group: the step
        counter, exp_avg, exp_avg_sq, parameter by parameter in the model's order) where FSDP2 was built
        with lazy_state."""
        for name in self.params:
            gr = self.group_of(name)
            if len(gr.steps) == len(gr.unit.params):
                continue
            p = next(p for p in gr.unit.params if p.name == name)
            gr.steps.append(self.sim.empty((1,), "fp32", "AdamW step", kind="state"))
            gr.m.append(self.sim.empty((p.chunk(gr.g, gr.rank),), "fp32", "AdamW exp_avg", kind="state"))
            gr.v.append(self.sim.empty((p.chunk(gr.g, gr.rank),), "fp32", "AdamW exp_avg_sq", kind="state"))

    def zero_grad(self) -> None:
        """torch.optim zero_grad(set_to_none=True), the first thing torchtitan's train step does."""
        for gr in self.groups:
            gr.grads = None
