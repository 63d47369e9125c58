"""One data-parallel rank of memcalc's generic ZeRO, replayed in bytes: the stack's own step (its model,
recipe and optimizer, memcalc.exact.replay.meta) with each phase holding what a rank holds under ZeRO.

Rajbhandari et al. 2019 (sec. 5, Fig. 1) shard over the G ranks of a data-parallel group: stage 1 the
optimizer state, stage 2 the gradients too, stage 3 the weights too. The moments in time, per rank:
  state      each tensor's optimizer state (fp32 master, moments) for its shard, ⌈numel/G⌉ elements;
             stage 3 keeps the weights' shard only (the built weights are stand-ins: no bytes)
  forward    stage 3 gathers each unit's weights before it runs, the next unit's as a prefetch, and frees
             them as the unit ends (units: the embedding, each block, the head; FSDP's per-block
             wrapping, as the textbook's two gathered layers assume)
  backward   stage 3 gathers again, prefetching the unit before; stages 2-3 reduce-scatter a unit's
             gradients as backward leaves it: the shard is kept, the full gradients freed
  optimizer  the stack's optimizer over the shards: its temporaries shard-sized; the full gradients of
             stage 1 released shard by shard, as the one-GPU step releases them tensor by tensor; the
             updated weights all-gathered in place (stages 1-2)
  offload    (ZeRO-Offload, Ren et al. 2021) the optimizer state lives on the host and the optimizer steps
             there: each gradient leaves the GPU as it is reduced (stages 2-3) or after backward, and the
             GPU's optimizer phase allocates nothing; parameter offload keeps the weights' shards on the
             host too (ZeRO-Infinity, Rajbhandari et al. 2021), gathered onto the GPU unit by unit
A LoRA model's frozen base (its packed 4-bit weights for QLoRA) has no gradient and no optimizer state: stage 3
partitions and gathers it with the rest, stages 1-2 leave it whole on every rank.
Collectives run in place or into their output, with no staging buffers: engines with their own buffers
(FSDP2's, memcalc.exact.replay.fsdp2 and, over a LoRA model, memcalc.exact.replay.fsdp2_lora) are replayed on
their own. Where DeepSpeed runs the ZeRO (the Trainer's, through accelerate), its reduce bucket is added
(Sharding.bucket_numel: reduce_bucket_size elements in the 16-bit dtype, contiguous_gradients on by default):
stage 3 allocates it once, after its optimizer state (deepspeed/runtime/zero/stage3.py __init__: ipg_buckets'
torch.empty(reduce_bucket_size)), and keeps it; stages 1-2 at each backward's first gradient (stage_1_and_2.py
process_gradients -> setup_buckets), two with overlap_comm (off below stage 3), freed as backward ends
(_release_ipg_buffers). Here stages 1-2 allocate it as backward enters the first unit holding a trained parameter.
The Trainer's model loads before DeepSpeed shards it: Transformers builds an unquantized model under
deepspeed.zero.Init, each parameter partitioned as it is made, but a quantized one whole onto every GPU
(transformers/modeling_utils.py get_init_context: zero.Init only `if not is_quantized`; the bitsandbytes
quantizer's device_map {"": torch.cuda.current_device()}), which DeepSpeed's stage 3 partitions as the Trainer
prepares it (deepspeed/runtime/zero/parameter_offload.py _convert_to_zero_parameters): QLoRA's whole 4-bit model
is on each GPU at load (Zero.load_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..sim.graph import Graph, layer_of
from ..sim.tensors import LiveBytes, Tensor


@dataclass(frozen=True)
class Sharding:
    """How one rank holds the model state: the ZeRO stage over `ranks`, and what is offloaded."""

    zero: int = 0
    ranks: int = 1  # the data-parallel ranks ZeRO shards over
    offload: bool = False  # optimizer state on the host, the optimizer step there
    offload_params: bool = False  # the weights' shards on the host too (stage 3)
    fsdp2: str = ""  # FSDP2's param_dtype where FSDP2 shards a LoRA model (memcalc.exact.replay.fsdp2_lora), else ""
    bucket_numel: int = 0  # DeepSpeed's reduce_bucket_size where DeepSpeed runs the ZeRO, else 0 (no buckets)
    bucket_dtype: str = "bf16"  # its dtype: the 16-bit model's under DeepSpeed's bf16 or fp16 mode

    @property
    def shards(self) -> int:
        """How many ways the optimizer state is split: the ranks under ZeRO >= 1, else 1."""
        return self.ranks if self.zero >= 1 else 1

    @property
    def trivial(self) -> bool:
        """Whether a rank holds what one GPU holds: nothing sharded, nothing offloaded."""
        return self.shards == 1 and not self.offload


def shard_numel(numel: int, ranks: int) -> int:
    """One rank's part of a tensor: ⌈numel/G⌉ elements (the last rank's may be padding)."""
    return -(-numel // ranks)


TOKEN_TABLES = ("tok_emb.weight", "model.embed_tokens.weight", "transformer.wte.weight")  # builder's, hf's


def unit_of(name: str) -> int | str:
    """The unit a parameter is gathered with: its block, or the embedding ("before": the token and position
    tables) or the head ("after": the final norm, the output layer, the MTP module)."""
    layer = layer_of(name)
    if layer is not None:
        return layer
    return "before" if "emb" in name or ".wte." in name or ".wpe." in name else "after"


def units_of(params: list[Tensor]) -> dict[int | str, list[Tensor]]:
    """The parameters of each unit in the order forward runs them; a tied token table in the head's too."""
    blocks = sorted({u for p in params if isinstance(u := unit_of(p.name), int)})
    units: dict[int | str, list[Tensor]] = {u: [] for u in ["before", *blocks, "after"]}
    for p in params:
        units[unit_of(p.name)].append(p)
    if not any(p.name.startswith("lm_head") for p in params):  # tied: the output layer is the token table
        units["after"] += [p for p in params if p.name in TOKEN_TABLES]
    return units


class ZeroGraph(Graph):
    """memcalc.exact.sim.graph.Graph whose unit boundaries, in forward and backward, call the rank's Zero."""

    def __init__(self, mem: LiveBytes):
        super().__init__(mem)
        self.zero: Zero | None = None

    @Graph.layer.setter
    def layer(self, value: int | None) -> None:
        Graph.layer.fset(self, value)
        if self.zero is not None and self.rebuilding is None:
            self.zero.at(value, self.in_backward)


class Zero:
    """One rank's shards, its gathered units and its reduced gradients (see the module doc)."""

    def __init__(self, g: ZeroGraph, params: list[Tensor], sharding: Sharding, frozen: list[Tensor] = ()):
        self.g, self.sharding, self.params = g, sharding, params
        self.host = Graph(LiveBytes())  # what lives in host memory: not this GPU's bytes
        self.frozen = list(frozen)  # LoRA's frozen base (QLoRA's packed 4-bit weights too): no grad, no state
        self.units = units_of(params + self.frozen if sharding.zero == 3 else params)
        self.order = list(self.units)
        self.gathered: dict[int | str, list[Tensor]] = {}
        self.grad_shards: dict[int, Tensor] = {}  # id(parameter) -> this rank's reduced gradient
        self.phase, self.current, self.seen_block = "idle", None, False
        self.bucket: Tensor | None = None  # DeepSpeed's reduce bucket, while it is allocated
        g.zero = self
        quantized = any(p.dtype == "uint8" for p in self.frozen)  # QLoRA's packed 4-bit weights (stored())
        self.load_bytes = g.mem.live_bytes if sharding.zero == 3 and sharding.bucket_numel and quantized else 0
        if sharding.zero == 3:  # the weights are their shards: the built ones stand in, with no bytes
            g.mem.live_bytes -= sum(p.storage.nbytes for p in params + self.frozen)
            if g.recording is not None:
                g.recording.elsewhere.update(p.storage.event for p in params + self.frozen)
            where = self.host if sharding.offload_params else g
            self.shards = [named(where.empty((shard_numel(p.numel, sharding.ranks),), p.dtype, "ZeRO-3 shard " + p.name,
                                             kind="state", copies=p.copies), p) for p in params]  # fmt: skip
            # stage 3 partitions every parameter, frozen ones too (deepspeed/runtime/zero/partition_parameters.py
            # Init: _convert_to_zero_parameters over all of module.parameters(), requires_grad or not)
            self.frozen_shards = [where.empty((shard_numel(stored(p)[0], sharding.ranks),), stored(p)[1],
                                              "ZeRO-3 shard " + p.name, kind="state") for p in self.frozen]  # fmt: skip
        else:  # views of the full weights: the optimizer updates this rank's part of each in place
            self.shards = [named(Tensor(p.storage, (shard_numel(p.numel, sharding.shards),), p.dtype), p)
                           for p in params]  # fmt: skip

    def optimizer_model(self, model) -> SimpleNamespace:
        """What the stack's recipe is built over: this rank's shards of the model's parameters."""
        return SimpleNamespace(cfg=model.cfg, params=self.shards, autocast=getattr(model, "autocast", None))

    def made_state(self, before: int) -> None:
        """Optimizer offload: the state the recipe made since `before` (live bytes then) is the host's. Then
        DeepSpeed's stage 3 allocates its reduce bucket on the GPU, offloaded or not, and keeps it."""
        if self.sharding.offload:
            self.g.mem.live_bytes = before
            rec = self.g.recording
            if rec is not None:  # what is alive of what the first step made: the host's
                rec.elsewhere.update(i for i in rec.origins if i >= rec.loaded and i not in rec.freed)
        if self.sharding.zero == 3 and self.sharding.bucket_numel:
            self.allocate_bucket(kind="state")

    def allocate_bucket(self, kind: str = "") -> None:
        """DeepSpeed's reduce bucket (ipg buffer): reduce_bucket_size elements, two under stages 1-2's
        overlap_comm (off by default there: memcalc replays the default)."""
        s = self.sharding
        self.bucket = self.g.empty((s.bucket_numel,), s.bucket_dtype, "DeepSpeed reduce bucket", kind=kind)

    # -- the unit boundaries ---------------------------------------------------------------------
    def start(self, phase: str) -> None:
        """forward or backward begins; forward enters the embedding's unit at once."""
        self.phase, self.current, self.seen_block = phase, None, False
        if phase == "forward":
            self.enter("before")

    def at(self, layer: int | None, backward: bool) -> None:
        """The graph moved to block `layer` (None: outside the blocks) in forward or in backward."""
        if self.phase != ("backward" if backward else "forward"):
            return
        if layer is not None:
            self.seen_block = True
        unit = layer if layer is not None else "before" if backward and self.seen_block else "after"
        if unit != self.current:
            if self.current is not None:
                self.leave(self.current)
            self.enter(unit)

    def end(self) -> None:
        """The phase is over: its last unit left; after backward every gradient not yet reduced is."""
        if self.current is not None:
            self.leave(self.current)
        if self.phase == "backward":
            if self.sharding.zero >= 2:
                self.reduce_scatter(self.params)
            elif self.sharding.offload:
                self.to_host(self.params)
            if self.sharding.zero < 3:
                self.bucket = None  # _release_ipg_buffers
        self.phase, self.current = "idle", None

    def enter(self, unit) -> None:
        self.current = unit
        if self.sharding.bucket_numel and self.bucket is None and self.phase == "backward" and \
                self.sharding.zero < 3 and self.units.get(unit):  # stages 1-2: the unit holds a trained parameter
            self.allocate_bucket()
        if self.sharding.zero == 3:
            i = self.order.index(unit) + (-1 if self.phase == "backward" else 1)
            self.gather(unit)
            if 0 <= i < len(self.order):
                self.gather(self.order[i])  # prefetch the unit that runs next

    def leave(self, unit) -> None:
        self.gathered.pop(unit, None)
        if self.phase == "backward" and self.sharding.zero >= 2:
            self.reduce_scatter(self.units.get(unit, []))  # a frozen block (--freeze) has nothing to reduce

    def gather(self, unit) -> None:
        """All-gather a unit's weights (ZeRO-3): full size, in their dtype, onto this GPU."""
        if unit not in self.gathered:
            self.gathered[unit] = [self.g.empty((stored(p)[0],), stored(p)[1], "ZeRO-3 gathered " + p.name,
                                                copies=p.copies) for p in self.units[unit]]  # fmt: skip

    # -- gradients and the optimizer step ------------------------------------------------------------
    def reduce_scatter(self, params) -> None:
        """Stages 2-3: each full gradient there is reduce-scattered into this rank's shard (on the host when
        offloaded; a later micro-batch's added into the kept one), then freed."""
        where = self.host if self.sharding.offload else self.g
        for p in self.g.each(params):  # equal experts' in turn (Graph.each)
            if p.grad is None:
                continue
            out = where.empty((shard_numel(p.numel, self.sharding.ranks),), p.grad.dtype, "reduce-scatter output",
                              copies=p.copies)  # fmt: skip
            self.grad_shards.setdefault(id(p), out)
            p.grad = None
            del out

    def to_host(self, params) -> None:
        """Stages 0-1 offloaded: after backward each full gradient is copied to the host, then freed here."""
        for p in params:
            if p.grad is not None:
                size = (shard_numel(p.numel, self.sharding.shards),)
                self.grad_shards.setdefault(id(p), self.host.empty(size, p.grad.dtype, "gradient to host", copies=p.copies))
                p.grad = None

    def update(self, recipe) -> None:
        """The stack's optimizer step over the shards, each holding its gradient's shard (stages 0-1: a view
        of the full gradient, which lives until the optimizer lets go of it); offloaded, the host's step."""
        for p, s in zip(self.params, self.shards):
            shard = self.grad_shards.pop(id(p), None)
            if shard is None and p.grad is not None:
                shard = Tensor(p.grad.storage, s.shape, p.grad.dtype)
            s.grad, p.grad = shard, None
            del shard
        if not self.sharding.offload:
            recipe.update()
        for s in self.shards:
            s.grad = None


def stored(p: Tensor) -> tuple[int, str]:
    """A parameter's elements and dtype as the engine shards and gathers it: its own, but QLoRA's packed 4-bit
    weight, which Params4bit keeps in bnb_4bit_quant_storage (bf16: two bytes hold four weights, so that FSDP and
    ZeRO-3 shard it as the bf16 weights beside it; bitsandbytes/nn/modules.py Params4bit quant_storage,
    transformers/integrations/bitsandbytes.py replace_with_bnb_linear)."""
    if p.dtype == "uint8":
        return -(-p.storage.nbytes // 2), "bf16"
    return p.numel, p.dtype


def named(t: Tensor, p: Tensor) -> Tensor:
    """t, named as the parameter it is a shard of (the optimizer's kernels go to that parameter's layer)."""
    t.name = p.name
    return t
