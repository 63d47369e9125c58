"""Activation offloading, as a torch.autograd.graph.saved_tensors_hooks context runs it, in bytes: what a saved
tensor's pack hook sends to pinned host memory leaves the GPU once nothing else holds it, and the unpack hook
brings it back in backward (memcalc.model.savers names whose code):

  trl   OffloadActivations (trl 1.16.0 trl/models/activation_offloading.py, adapted from torchtune 0.6.1
        torchtune/training/_activation_offloading.py), with use_streams=True, its default. pack_tensor numbers every
        tensor it is given; one of min_offload_size (1,024) bytes or more that is not a parameter is copied to the
        host on a side stream and kept in fwd_stash until max_fwd_stash_size (5) numbers later, when a later offload
        drops the older ones (a storage in the stash is not offloaded again: storage_to_tensor_id). lm_head's
        forward runs under NoOpManager (get_act_offloading_ctx_manager), so its saves stay. In backward,
        unpack_tensor_with_streams takes a tensor still in fwd_stash as it is, else copies it back into a new GPU
        tensor held in bwd_tensor_stash; the hook on the node that unpacked it empties fwd_stash and drops what the
        previous such node brought back; the rest go at the end of backward (wait_and_del_remaining_references).
  ckpt  torch.autograd.graph.save_on_cpu(pin_memory=True) around each checkpointed layer (Transformers 5.25
        modeling_utils.py _activation_checkpointing_enable, offload=True): it packs what is saved outside the
        checkpoint's own hooks, the layer's input (torch/utils/checkpoint.py _NoopSaveInputs), with a blocking
        copy_ on the compute stream, and unpacks it with .to(device) for the recompute, held only by what uses it.

A Host is the placeholder a node keeps in place of the storage: the tensor's bytes in pinned host memory.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from .tensors import Storage, Tensor

if TYPE_CHECKING:
    from .graph import Graph

OFFLOADED_KINDS = ("activation", "input", "cached")  # not parameters, buffers or optimizer state


class Host:
    """A saved tensor in pinned host memory: its number (pack_tensor's tensor_id) and its bytes."""

    __slots__ = ("id", "nbytes")

    def __init__(self, number: int, nbytes: int):
        self.id, self.nbytes = number, nbytes


class Held:
    """A saved tensor the hooks keep on the GPU (tracker's (activation, False)): unpacked, it is apply()'s local and
    goes as apply returns, before validate_outputs, where a SavedVariable's goes at release_variables after it."""

    __slots__ = ("storage",)

    def __init__(self, storage: Storage):
        self.storage = storage


class HostInput:
    """A checkpointed layer's input offloaded: the tensor's metadata, so that the recompute gets it back as itself
    (its grad_fn and output_nr: the recompute's nodes point where the layer's did)."""

    __slots__ = ("host", "shape", "dtype", "grad_fn", "output_nr", "copies")

    def __init__(self, host: Host, t: Tensor):
        self.host, self.shape, self.dtype = host, t.shape, t.dtype
        self.grad_fn, self.output_nr, self.copies = t.grad_fn, t.output_nr, t.copies


class Offloader:
    """One offloading context over one micro-batch's forward and backward (TRL enters it around training_step)."""

    def __init__(self, g: Graph, mode: str, min_bytes: int, stash: int):
        self.g, self.mode, self.min_bytes, self.stash = g, mode, min_bytes, stash
        self.paused = False  # NoOpManager's hooks in force (lm_head's forward)
        self.number = 0  # pack_tensor's tensor_id
        self.fwd_stash: dict[int, Storage] = {}  # offloaded, kept on the GPU until their copy is done
        self.stashed: dict[int, int] = {}  # id of a stashed storage -> its number (storage_to_tensor_id)
        self.bwd_stash: dict[int, Storage] = {}  # brought back, kept until the next such node's hook
        self.pending: dict[int, list[int]] = {}  # id of a node -> the numbers its hook drops (prev_node_ids)
        self.node = None  # the last node that brought a tensor back (curr_autograd_node)
        self.offloaded_bytes = 0  # copied to pinned host memory in forward: what the host holds at its end
        self.reloaded_bytes = 0  # copied back to the GPU in backward

    def pack(self, t: Tensor, checkpoint_input: bool = False) -> Storage | Held | Host:
        """pack_tensor (trl) or save_on_cpu's pack_to_cpu (ckpt, the checkpoint's input alone): the storage itself
        where no hook of this context packs it, Held where it packs it and keeps it on the GPU, else a Host."""
        if self.paused or (self.mode == "ckpt" and not checkpoint_input):
            return t.storage  # another hooks context in force: not this one's to number
        self.number += 1
        s = t.storage
        if self.mode == "ckpt":  # every tensor, copied before the op goes on: nothing stashed
            return self.to_host(t)
        if id(s) in self.stashed or s.kind not in OFFLOADED_KINDS or t.nbytes < self.min_bytes:
            return Held(s)  # tracker keeps the GPU tensor: a storage being offloaded, a parameter, a small tensor
        for number in [k for k in self.fwd_stash if k <= self.number - self.stash]:  # copies long done: let go
            self.stashed.pop(id(self.fwd_stash.pop(number)), None)
        self.fwd_stash[self.number], self.stashed[id(s)] = s, self.number
        return self.to_host(t)

    def to_host(self, t: Tensor) -> Host:
        """torch.empty_like(activation, pin_memory=True, device="cpu").copy_(activation): its elements' bytes (an
        expanded view's storage, as trl copies it)."""
        self.offloaded_bytes += t.nbytes * t.copies
        return Host(self.number, t.nbytes * t.copies)

    def pack_input(self, t: Tensor) -> Tensor | HostInput:
        """A checkpointed layer's input, saved by _NoopSaveInputs under this context (kept: the frame holds it)."""
        packed = self.pack(t, checkpoint_input=True)
        return HostInput(packed, t) if isinstance(packed, Host) else t

    def unpacked(self, node, saved: list) -> tuple[list, list]:
        """A node's saved entries at its run: those no hook packed (kept by the node until release_variables), and
        the hooks' unpacked storages (apply()'s locals)."""
        plain = [s for s in saved if not isinstance(s, (Host, Held))]
        hooked = [self.unpack(node, s) if isinstance(s, Host) else s.storage for s in saved
                  if isinstance(s, (Host, Held))]  # fmt: skip
        return plain, hooked

    def unpack(self, node, host: Host) -> Storage:
        """unpack_tensor_with_streams (trl) or unpack_from_cpu (ckpt), inside `node`'s run: the GPU storage."""
        if self.mode == "ckpt":
            self.reloaded_bytes += host.nbytes
            return self.g.storage(host.nbytes, "_to_copy", "activation", 1)  # .to(device, non_blocking=True)
        if node is not self.node:  # a new node: the previous node's tensors go once this one has run
            self.node = node
            self.pending.setdefault(id(node), []).extend(self.bwd_stash)
        self.pending.setdefault(id(node), [])
        if host.id in self.fwd_stash:  # its copy is in the stash still: that very tensor
            return self.fwd_stash[host.id]
        self.reloaded_bytes += host.nbytes
        # maybe_gpu_tensor.to(device, non_blocking=True) on the side stream
        storage = self.bwd_stash[host.id] = self.g.storage(host.nbytes, "_to_copy", "activation", 1)
        return storage

    def unpack_input(self, node, x: HostInput) -> Tensor:
        """The checkpointed input back as the tensor it was, for the recompute."""
        t = Tensor(self.unpack(node, x.host), x.shape, x.dtype, copies=x.copies)
        t.grad_fn, t.output_nr = x.grad_fn, x.output_nr
        return t

    def after(self, node) -> None:
        """The hook on a node that brought tensors back, after it ran: fwd_stash emptied, the previous node's go."""
        dropped = self.pending.pop(id(node), None)
        if dropped is None:
            return
        self.fwd_stash.clear()
        self.stashed.clear()
        for number in dropped:
            self.bwd_stash.pop(number, None)

    def finish(self) -> None:
        """wait_and_del_remaining_references, queued to the end of backward."""
        self.bwd_stash.clear()
        self.fwd_stash.clear()
        self.stashed.clear()


def offloader(g: Graph, mode: str, min_bytes: int, stash: int) -> Offloader:
    """The context entered for a step: made once (SFTTrainer.__init__), each entry clearing its bookkeeping but
    the last node that brought a tensor back (OffloadActivations.__enter__ leaves curr_autograd_node, which holds
    that node and what its edges reach until the next backward replaces it)."""
    last = g.offload.node if g.offload is not None else None
    g.offload = Offloader(g, mode, min_bytes, stash)
    g.offload.node = last
    return g.offload


@contextlib.contextmanager
def kept_on_gpu(g: Graph):
    """lm_head's forward under get_act_offloading_ctx_manager's NoOpManager: its saves stay on the GPU."""
    if g.offload is None:
        yield
        return
    outer, g.offload.paused = g.offload.paused, True
    try:
        yield
    finally:
        g.offload.paused = outer
