"""One rank of a (dp × tp) job, measured: the bytes it holds and the bytes one block saves.

Every count is of local shards (a DTensor's _local_tensor) and of storages, once each: FSDP2's
reduce-scattered gradients are views of one buffer per parameter group, its padded shards are
views of a padded storage, and a tensor saved by several ops is kept once.
The step is verify/recipes.py's Recipe (fp32 master, AdamW m and v per local shard): a warm-up step
(FSDP2 sets up its buffers lazily), then the measured one.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_leaves

from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.model.layout import Layout

from .builder import build, init_weights
from .dist_plan import parallelize
from .meta import meta_kernels
from .recipes import DTYPES, Recipe


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def storage_key(t: torch.Tensor) -> int:
    return local(t).untyped_storage()._cdata


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages under these tensors' local shards."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = local(t).untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class BlockSaved:
    """Bytes saved for backward by block k: from the end of block k−1's forward to the end of block
    k's, so that full recompute's saved block input (torch.utils.checkpoint saves it just before the
    block runs) is counted too. Parameters (sharded and all-gathered), buffers and the RoPE tables
    every block shares are left out; storages are held until forward ends (no reuse of ids)."""

    def __init__(self, model: torch.nn.Module, k: int):
        self.k, self.done, self.model = k, 0, model
        self.excluded = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
        self.saved: dict[int, int] = {}
        self.held: list[torch.UntypedStorage] = []
        blocks = model.blocks
        blocks[0].register_forward_pre_hook(self.shared_inputs)
        blocks[k].register_forward_pre_hook(self.gathered_params)
        for block in blocks:
            block.register_forward_hook(self.finished)

    def shared_inputs(self, module, args) -> None:
        self.excluded.update(storage_key(t) for t in args[1:] if isinstance(t, torch.Tensor))  # cos, sin, mask

    def gathered_params(self, module, args) -> None:
        self.excluded.update(storage_key(p) for p in module.parameters())  # FSDP2's unsharded parameters

    def finished(self, module, args, output) -> None:
        self.done += 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.done == self.k:
            s = local(t).untyped_storage()
            if s._cdata not in self.excluded and s._cdata not in self.saved:
                self.saved[s._cdata] = s.nbytes()
                self.held.append(s)
        return t

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """What per-op selective AC keeps instead of saving (builder.sac_contexts' observer): block k's too."""
        for t in tensors:
            self.pack(t)

    @contextlib.contextmanager
    def hooks(self):
        """The saved-tensor hooks, and the model's per-op SAC observer, for one forward and backward."""
        self.done = 0
        self.model.sac_observer = self.keep
        try:
            with saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            self.model.sac_observer = None

    @property
    def total_bytes(self) -> int:
        return sum(self.saved.values())


def inputs(shape: ModelShape, seq_len: int, micro_batch: int, device: torch.device, seed: int):
    """Token ids and targets; the ranks of one TP group must see the same batch (same seed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, shape.vocab, (micro_batch, seq_len + 1), generator=g).to(device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def to_fake(module: torch.nn.Module, mode, device: str = "cpu") -> None:
    """Materialise a meta-built (and sharded) module as fake tensors of `mode`, non-fake inputs allowed
    for that call only."""
    mode.allow_non_fake_inputs = True
    with mode:
        module.to_empty(device=device)
    mode.allow_non_fake_inputs = False


def build_parallel(shape: ModelShape, seq_len: int, tricks: Tricks, layout: Layout, mesh, device: str,
                   fake_mode=None) -> torch.nn.Module:  # fmt: skip
    """The model on meta, split (TP, then FSDP2), then materialised: fake tensors or real, initialised."""
    model = build(shape, meta_kernels(tricks), seq_len, DTYPES[tricks.precision])
    parallelize(model, layout, mesh)
    if fake_mode is not None:
        to_fake(model, fake_mode, device)
    else:
        model.to_empty(device=device)
        init_weights(model)
    return model


def run_step(recipe: Recipe, idx, targets, tp: bool, hooks=None) -> None:
    """Forward and backward (the logits vocab-parallel under TP), saved-tensor hooks on forward."""
    with loss_parallel() if tp else contextlib.nullcontext():
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = recipe.forward(idx, targets)
        recipe.backward(loss)
    del loss


def measure_rank(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout, mesh,
                 device: str, fake_mode=None) -> dict[str, int]:  # fmt: skip
    """Per-rank bytes after a warm-up step: weights, grads after backward, optimizer state after
    the update, and the bytes one block (the second) saves for backward."""
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    model = build_parallel(shape, seq_len, tricks, layout, mesh, device, fake_mode)
    k = 1 if shape.n_layers > 1 else 0
    with ctx:
        dp_rank = mesh["dp"].get_local_rank()
        idx, targets = inputs(shape, seq_len, micro_batch, torch.device(device), seed=dp_rank)
        recipe = Recipe(model, tricks.precision)
        tp = layout.tp > 1
        run_step(recipe, idx, targets, tp)
        recipe.update()
        weights = storage_bytes(model.parameters())
        saved = BlockSaved(model, k)
        run_step(recipe, idx, targets, tp, saved.hooks())
        saved.held.clear()
        grads = storage_bytes(p.grad for p in model.parameters())
        recipe.update()
        optimizer = storage_bytes(recipe.state_tensors())
    return {"weights": weights, "grads": grads, "optimizer state": optimizer, "saved by one block": saved.total_bytes}


# ---- FSDP2 as torchtitan runs it: every phase's peak ---------------------------------------------------


class CountingFakeMode(FakeTensorMode):
    """FakeTensorMode that counts live bytes as verify/track.py's LiveBytes does: each fake output's storage
    from the op that makes it until it is freed (weakref.finalize), the peak since reset_peak() and where.
    Fake tensors are made here for every op, a DTensor's local ones included (a dispatch mode above DTensor
    would see only the wrapper), and resize_ is counted through count_resizes (FSDP2 frees and reallocates
    its unsharded parameters by resizing their storages: _fsdp_param.py alloc_storage, free_storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live_bytes = self.peak_bytes = 0
        self.phase, self.peak_at = "", ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs or {})
        if out is not NotImplemented:
            for t in tree_leaves(out):
                if isinstance(t, FakeTensor):
                    self.count(t.untyped_storage(), func.overloadpacket.__name__)
        return out

    def count(self, storage: torch.UntypedStorage, op: str) -> None:
        key, size = storage._cdata, storage.nbytes()
        old = self.sizes.get(key)
        if old == size:
            return
        if old is None:
            weakref.finalize(storage, self.free, key)
        self.sizes[key] = size
        self.live_bytes += size - (old or 0)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, f"{self.phase}: {op}"

    def free(self, key: int) -> None:
        self.live_bytes -= self.sizes.pop(key)

    def reset_peak(self, phase: str) -> None:
        self.phase = phase
        self.peak_bytes, self.peak_at = self.live_bytes, f"{phase}: (start)"


@contextlib.contextmanager
def count_resizes(mode: CountingFakeMode):
    """torch.UntypedStorage.resize_ is no tensor op: counted by wrapping it while the mode measures
    (torch/distributed/_tools/mem_tracker.py MemTracker._track_resize does the same)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        if size or storage._cdata in mode.sizes:
            mode.count(storage, "resize_")
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def torchtitan_step(model, optimizer, idx, targets, tp: bool, mode: CountingFakeMode | None = None,
                    hooks=None) -> dict[str, object]:  # fmt: skip
    """torchtitan's train step: zero_grad (set_to_none), forward and loss, backward, optimizer.step; with
    a mode, the peak of each phase (forward from zero_grad on)."""
    peaks: dict[str, object] = {}

    def phase(name: str) -> None:
        if mode is not None:
            if mode.phase:
                peaks[mode.phase] = (mode.peak_bytes, mode.peak_at)
            mode.reset_peak(name)

    phase("forward")
    optimizer.zero_grad(set_to_none=True)
    with loss_parallel() if tp else contextlib.nullcontext():
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = model(idx, targets)
        phase("backward")
        loss.backward()
    del loss
    phase("optimizer")
    optimizer.step()
    phase("")
    return peaks


def measure_fsdp2(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout,
                  mesh) -> dict[str, object]:  # fmt: skip
    """One rank of FSDP2 as torchtitan runs it, on fake tensors: a warm-up step, a step whose forward
    counts what block 1 saves, then the measured step: live bytes at its start and each phase's peak."""
    from .recipes import library_optimizer

    mode = CountingFakeMode()
    model = build(shape, meta_kernels(tricks), seq_len, torch.float32)
    parallelize(model, layout, mesh, "fsdp2", DTYPES[tricks.precision])
    with count_resizes(mode):
        to_fake(model, mode)
        with mode:
            idx, targets = inputs(shape, seq_len, micro_batch, torch.device("cpu"), seed=mesh["dp"].get_local_rank())
            optimizer = library_optimizer(list(model.parameters()), "adamw", "fused")
            tp = layout.tp > 1
            torchtitan_step(model, optimizer, idx, targets, tp)
            saved = BlockSaved(model, 1 if shape.n_layers > 1 else 0)
            torchtitan_step(model, optimizer, idx, targets, tp, hooks=saved.hooks())
            saved.held.clear()
            state = mode.live_bytes
            peaks = torchtitan_step(model, optimizer, idx, targets, tp, mode)
            params = list(model.parameters())
            device = params[0].device
            opt_state = [t for s in optimizer.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor) and local(t).device == device]  # fmt: skip
            out = {"weights": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
                   "optimizer state": storage_bytes(opt_state), "saved by one block": saved.total_bytes,
                   "between steps": state}  # fmt: skip
    for name in ("forward", "backward", "optimizer"):
        out[f"{name} peak"], out[f"{name} peak at"] = peaks[name]
    out["step peak"] = max(out["forward peak"], out["backward peak"], out["optimizer peak"])
    return out
