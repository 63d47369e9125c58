"""One rank of FSDP2 over PEFT's LoRA (and QLoRA) model, as accelerate and TRL shard it, replayed in bytes.

memcalc.exact.replay.zero's unit boundaries (ZeroGraph) fire FSDP2's hooks here, on Transformers' model as
memcalc.exact.hf builds it. What one rank runs (torch 2.13 torch/distributed/fsdp/_fully_shard; accelerate
accelerate/utils/fsdp_utils.py fsdp2_prepare_model: fully_shard on each decoder layer, then on the whole model,
MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)):
  units      each decoder layer, and the root: what no layer took (the token table, the final norm, lm_head)
  state      every parameter's dim-0 shard padded to a multiple of G rows in its own dtype (_fsdp_param.py
             _sharded_param_data): the frozen base's (QLoRA's packed 4-bit weights in their bf16 quant storage),
             and the adapters' in fp32 (PEFT's cast_adapter_dtype); the optimizer holds the adapters alone
             (requires_grad), fused AdamW's m and v of the unpadded shard and its step
  all-gather foreach_all_gather: each parameter cast to param_dtype where it differs (the fp32 adapters: the
             all-gather input, freed once copied in; the bf16 base goes in as it is), the param_dtype output
             of G shards, copied out into each parameter's unsharded storage; in forward the output is kept
             until the next unit's copy-out, in backward freed at once
  reshard    each layer after forward and after backward; the root never after forward (_fsdp_state.py
             _lazy_init: the root's post_forward_mesh_info is None), after backward in the final callback
  backward   a layer's pre-backward unshards it (copies out what was prefetched: wait_for_unshard) and prefetches
             the layer before it, the all-gather alone (_backward_prefetch, _prefetch_unshard; the root's
             pre-backward prefetches the last layer so, its copy-out waiting for that layer's turn); its
             post-backward takes the gradients of the parameters that have one (the adapters', in
             param_dtype: they ran unsharded in it), reshards, frees the previous reduce-scatter input, makes
             its own in reduce_dtype (fp32) over those parameters alone (foreach_reduce: fsdp_params_with_grad),
             and its fp32 output shard, which becomes the sharded gradient; the frozen base reduces nothing
"""

from __future__ import annotations

from ..sim.graph import layer_of
from ..sim.tensors import Tensor
from .fsdp2_units import Param
from .zero import Sharding, Zero, ZeroGraph, named, stored


class Fsdp2Lora(Zero):
    """One FSDP2 rank's shards, unsharded units and reduce-scatters over a model some of whose weights are frozen."""

    def __init__(self, g: ZeroGraph, params: list[Tensor], sharding: Sharding, frozen: list[Tensor] = ()):
        self.g, self.sharding, self.params, self.frozen = g, sharding, params, list(frozen)
        self.host = g  # nothing is offloaded (Zero.made_state, update: the GPU's)
        G, self.G, everything = sharding.ranks, sharding.ranks, params + self.frozen
        self.units: dict[int | str, list[Tensor]] = {"root": []}
        for p in everything:
            self.units.setdefault(unit_of(p.name), []).append(p)
        self.order = list(self.units)
        self.dims = {id(p): Param(p.name, dims_of(p)) for p in everything}
        self.param_dtype = sharding.fsdp2
        g.mem.live_bytes -= sum(p.storage.nbytes for p in everything)  # the built weights stand in for unsharded ones
        self.sharded = [g.empty((self.dims[id(p)].padded(G),), shard_dtype(p), "FSDP2 shard " + p.name, kind="state")
                        for p in everything]  # fmt: skip
        trained = {id(p) for p in params}
        by_id = {id(p): s for p, s in zip(everything, self.sharded)}
        self.shards = [named(Tensor(by_id[id(p)].storage, (self.dims[id(p)].chunk(G, 0),), "fp32"), p)
                       for p in everything if id(p) in trained]  # fmt: skip
        self.gathered: dict[int | str, list[Tensor]] = {}
        self.pending: dict[int | str, Tensor] = {}  # all-gather outputs not yet copied out (backward prefetches)
        self.grad_shards: dict[int, Tensor] = {}
        self.kept: Tensor | None = None  # forward's last all-gather output (comm_ctx.all_gather_state)
        self.rs_inputs: list[Tensor] = []  # reduce_scatter_max_input_buffers = 1
        self.phase, self.current, self.seen_block = "idle", None, False
        g.zero = self

    def start(self, phase: str) -> None:
        self.phase, self.current, self.seen_block = phase, None, False
        if phase == "forward":
            self.unshard("root")  # the root's pre-forward
            self.current = "root"
        elif self.order[-1] != "root":  # the root's pre-backward (hooked on the loss) prefetches the unit that ran
            self.all_gather(self.order[-1])  # before its post-forward: the last layer (_backward_prefetch)

    def at(self, layer: int | None, backward: bool) -> None:
        if self.phase != ("backward" if backward else "forward"):
            return
        unit = layer if layer is not None else "root"
        if unit == self.current:
            return
        if isinstance(self.current, int):
            self.leave(self.current)
        self.current = unit
        if isinstance(unit, int):
            self.enter(unit)

    def enter(self, unit) -> None:
        self.unshard(unit)  # pre_backward: unshard (no-op if prefetched), wait_for_unshard (its copy-out)
        if self.phase == "backward":
            i = self.order.index(unit) - 1  # _backward_prefetch: the layer that ran before this one in forward
            if i >= 0 and isinstance(self.order[i], int):
                self.all_gather(self.order[i])  # _prefetch_unshard: the all-gather alone, copied out at its turn

    def leave(self, unit) -> None:
        if self.phase == "forward":
            self.gathered.pop(unit, None)  # reshard after forward
        else:
            self.post_backward(unit)

    def end(self) -> None:
        if isinstance(self.current, int):
            self.leave(self.current)
        if self.phase == "forward":  # the root's post-forward: the kept all-gather output freed, the root kept
            self.kept = None
        else:  # the final callback: the root's post-backward, then the kept reduce-scatter input freed
            self.post_backward("root")
            self.rs_inputs.clear()
        self.phase, self.current = "idle", None

    def all_gather(self, unit) -> None:
        """foreach_all_gather (FSDPParamGroup.unshard): the output, pending until its copy-out (a backward
        prefetch is copied out when its own unit's pre-backward waits for it)."""
        if unit in self.gathered or unit in self.pending:
            return
        ps = self.units[unit]
        numel = sum(self.padded(p) for p in ps)
        cast = [self.g.empty((self.padded(p),), self.param_dtype, "FSDP2 all-gather input")
                for p in ps if shard_dtype(p) != self.param_dtype]  # fmt: skip
        self.pending[unit] = self.g.empty((numel * self.G,), self.param_dtype, "FSDP2 all-gather output")
        cast.clear()

    def unshard(self, unit) -> None:
        """foreach_all_gather (unless prefetched) and its copy-out, wait_for_unshard (see the module doc)."""
        if unit in self.gathered:
            return
        self.all_gather(unit)
        ps = self.units[unit]
        output = self.pending.pop(unit)
        previous = self.kept if self.phase == "forward" else None
        self.kept = None
        self.gathered[unit] = [self.g.empty((self.padded(p) * self.G,), self.param_dtype, "FSDP2 unsharded " + p.name)
                               for p in ps]  # fmt: skip
        if self.phase == "forward" and self.G > 1:
            self.kept = output
        del output, previous

    def post_backward(self, unit) -> None:
        """post_backward and foreach_reduce, in their order (see the module doc)."""
        grads = [p.grad for p in self.units[unit] if p.grad is not None]
        with_grad = [p for p in self.units[unit] if p.grad is not None]
        for p in with_grad:
            p.grad = None
        self.gathered.pop(unit, None)
        if self.rs_inputs:
            self.rs_inputs.pop(0)
        if not with_grad:
            return
        numel = sum(self.padded(p) * self.G for p in with_grad)
        rs_input = self.g.empty((numel,), "fp32", "FSDP2 reduce-scatter input")
        last = grads[-1] if self.G > 1 else None  # foreach_reduce's loop variable holds the last one
        grads.clear()
        output = self.g.empty((numel // self.G,), "fp32", "FSDP2 reduce-scatter output")
        for p in with_grad:  # each sharded gradient is a view of the output
            self.grad_shards.setdefault(id(p), Tensor(output.storage, (self.dims[id(p)].chunk(self.G, 0),), "fp32"))
        del output, last
        self.rs_inputs.append(rs_input)

    def padded(self, p: Tensor) -> int:
        return self.dims[id(p)].padded(self.G)


def unit_of(name: str) -> int | str:
    """The fully_shard unit a parameter is in: its decoder layer, else the root."""
    layer = layer_of(name)
    return "root" if layer is None else layer


def dims_of(p: Tensor) -> tuple[int, ...]:
    """A parameter's shape as FSDP2 shards it (dim 0): QLoRA's packed weight in its bf16 storage, (n/4, 1)."""
    numel, dtype = stored(p)
    if dtype != p.dtype:
        return (numel, 1)
    return tuple(int(d) for d in p.shape) or (1,)


def shard_dtype(p: Tensor) -> str:
    """The sharded parameter's dtype: its own (PEFT's adapters in fp32 are built as fp32; the model here runs
    them in param_dtype), QLoRA's packed weight its bf16 quant storage."""
    if p.name and p.name.rpartition(".")[0].rpartition(".")[2] in ("lora_A", "lora_B"):
        return "fp32"
    return stored(p)[1]
