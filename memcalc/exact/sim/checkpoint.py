"""Non-reentrant activation checkpointing, as torch.utils.checkpoint runs it (use_reentrant=False): saved
tensors become placeholders (Slot) of their region (Frame) in forward; the region is re-run at the first
unpack in backward and stops once its last saved tensor is rebuilt (StopRecompute). With a
selective-checkpoint policy (create_selective_checkpoint_contexts), forward keeps the outputs of the ops
the policy saves, and the recompute takes them instead of rerunning them. Checkpointing holds the
methods memcalc.exact.sim.graph.Graph runs them with.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

from .offload import HostInput
from .tensors import Storage, Tensor


class Slot:
    """A saved tensor inside a checkpointed region: an index into its Frame, no bytes; it dies with the node that
    saved it (torch's _Holder, which the frame holds weakly)."""

    __slots__ = ("frame", "index", "__weakref__")

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
        self.holders: list[weakref.ref] = []  # each placeholder, weakly (torch's frame.weak_holders)
        self.repacked = 0  # tensors the recompute has saved so far (frame.recomp_counter)
        self.recomputed: dict[int, Storage] | None = None
        self.autocast = None  # the autocast region its forward ran in: recompute runs in it again
        self.policy = policy
        self.counts: dict[str, int] = {}  # op -> calls so far in this pass (the dispatch modes' func_counter)
        self.cache: dict[tuple[str, int], tuple[Tensor, ...]] = {}  # (op, index) -> its outputs, kept

    @property
    def n_saved(self) -> int:
        """The tensors its forward saved (placeholders made)."""
        return len(self.holders)


class StopRecompute(Exception):
    pass


TENSOR = object()  # where a reentrant checkpoint's tensor input goes back among its other arguments


def saved_of(node) -> Callable[[], list]:
    """What a rule reads its node's saved storages through at backward (a Function whose backward uses what it
    saved: reentrant checkpointing, Liger's kernels): a weak reference, so that a node recomputed but never run
    does not keep them in a cycle with its rule."""
    ref = weakref.ref(node) if node is not None else None
    return lambda: ref().saved


class Checkpointing:
    """memcalc.exact.sim.graph.Graph's checkpoint regions: checkpoint() in forward, outputs() for the ops a policy
    keeps, rebuild() at the first unpack in backward (a base of Graph: it runs on the graph's frame and
    rebuilding, scoped() and note_saved())."""

    def checkpoint(self, fn: Callable, *args, policy: Callable[[str, int], bool] | None = None):
        """torch.utils.checkpoint(fn, *args, use_reentrant=False): its inputs are kept, the rest rebuilt;
        with a policy, context_fn=create_selective_checkpoint_contexts(policy) (see Frame)."""
        with self.scoped("checkpoint"):
            for t in args:
                if isinstance(t, Tensor):
                    self.note_saved(t, "checkpoint", "input")
        frame = Frame(fn, args if self.offload is None else tuple(self.offload.pack_input(t) if isinstance(t, Tensor)
                                                                  else t for t in args), policy)  # fmt: skip
        frame.autocast = self.autocast  # torch/utils/checkpoint.py: _get_autocast_kwargs at forward
        outer, self.frame = self.frame, frame
        try:
            return fn(*args)
        finally:
            self.frame = outer

    def checkpoint_reentrant(self, fn: Callable, *args):
        """torch.utils.checkpoint(fn, *args, use_reentrant=True): CheckpointFunction saves its tensor inputs and runs fn
        under no_grad (nothing saved, every temporary gone as it goes). Its backward runs fn again with grad on over
        detached inputs (leaves where the inputs required grad), whole, in the autocast it ran in, then
        torch.autograd.backward from its output with the incoming gradient, a nested run of the engine over the
        rebuilt graph; the leaves' .grad are its gradients, and the rebuilt output and inputs go as it returns."""
        tensors = [t for t in args if isinstance(t, Tensor)]
        kinds = [(t.shape, t.dtype, t.requires_grad) for t in tensors]
        template = tuple(TENSOR if isinstance(t, Tensor) else t for t in args)  # no tensor held past the node
        autocast = self.autocast

        def rule(gs):
            detached = [Tensor(s, shape, dtype, copies=s.copies) for s, (shape, dtype, _) in zip(saved_now(), kinds)]
            for d, (_, _, needs) in zip(detached, kinds):
                if needs:  # detach_variable: x.detach(), requires_grad as the input's: a leaf
                    self.leaf(d)
            it = iter(detached)
            call = tuple(next(it) if a is TENSOR else a for a in template)
            outer, self.grad_enabled, self.in_backward, self.recomputing = self.in_backward, True, False, True
            try:
                with contextlib.nullcontext() if autocast is None else autocast.region(self):
                    out = fn(*call)
            finally:
                self.grad_enabled, self.in_backward, self.recomputing = False, outer, False
            self.nested_backward(out, gs[0])
            grads = [d.grad for d in detached]
            for d in detached:
                d.grad, d.grad_fn = None, None
            del out, call, it, detached
            return grads

        node = self.begin("CheckpointFunctionBackward", tensors, rule, [(t, "input") for t in tensors], function=True)
        saved_now = saved_of(node)
        outer, self.grad_enabled = self.grad_enabled, False
        try:
            out = fn(*args)
        finally:
            self.grad_enabled = outer
        self.end(node, [out])
        return out

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

    def rebuild(self, frame: Frame, node=None) -> None:
        """The first unpack in backward (inside node's run): run the region again with grad on (and under the
        autocast it ran in: checkpoint.py's recompute_fn), keep what it saves. Offloaded inputs come back first."""
        frame.recomputed, frame.counts, frame.repacked = {}, {}, 0  # the recompute's mode counts afresh
        args = tuple(self.offload.unpack_input(node, t) if isinstance(t, HostInput) else t for t in frame.args)
        self.rebuilding, self.grad_enabled = frame, True
        region = contextlib.nullcontext() if frame.autocast is None else frame.autocast.region(self)
        try:
            with region:
                frame.fn(*args)
        except StopRecompute:
            pass
        finally:
            self.rebuilding, self.grad_enabled = None, False
        kept = {id(t.storage) for t in args if isinstance(t, Tensor)}
        unique = {id(s): s for s in frame.recomputed.values() if s.kind == "activation" and id(s) not in kept}
        self.rebuilt_bytes = max(self.rebuilt_bytes, sum(s.nbytes for s in unique.values()))
        del unique, args
