"""Activation offloading on the meta device (issue 40): the pack and unpack hooks of TRL's OffloadActivations (trl
1.16.0 trl/models/activation_offloading.py, with use_streams=True) and of Transformers' checkpoint offload
(torch.autograd.graph.save_on_cpu around each checkpointed layer), as torch.autograd.graph.saved_tensors_hooks over
the real model's autograd, so that verify's tracker measures what stays on the device.

What a meta tensor cannot do is changed, and only that: the copy to pinned host memory keeps the tensor's size,
dtype and strides (no data to copy), the copy back is .to("meta") of that CPU tensor, and the streams' events, which
order copies that the meta device does not run, are left out: a tensor is let go where its event is recorded.
The rest is the library's bookkeeping line by line: tensor ids, the size threshold, parameters skipped, the forward
stash of max_fwd_stash_size, the storage dedup while stashed, the backward stash dropped by the next unpacking
node's hook (torch._C._current_autograd_node, Node.register_hook), and what is left at the end of backward.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

MIN_BYTES, STASH = 1024, 5  # OffloadActivations(min_offload_size=1024, max_fwd_stash_size=5)


class HostCopy:
    """torch.empty_like(activation, pin_memory=True, device="cpu"), its copy_ left out (a meta tensor has no data;
    pinning needs CUDA): its bytes on the host."""

    def __init__(self, t: torch.Tensor):
        self.tensor = torch.empty_like(t, device="cpu")
        self.nbytes = t.element_size() * t.nelement()

    def to_device(self) -> torch.Tensor:
        return self.tensor.to("meta", non_blocking=True)  # aten._to_copy, as .to(accelerator) runs it


class OffloadOnMeta(saved_tensors_hooks):
    """OffloadActivations' pack_tensor and unpack_tensor_with_streams (trl 1.16.0), on meta."""

    def __init__(self, model: torch.nn.Module):
        self.curr_node = None  # kept from one step to the next, as the trainer keeps its context
        # update_model_params: the parameters' storages, whose views (a weight's .t()) are not Parameters
        self.param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        """OffloadActivations.__enter__: the step's bookkeeping cleared (curr_autograd_node is not)."""
        self.tracker, self.tensor_id = {}, 0
        self.fwd_stash, self.storage_to_tensor_id = {}, {}
        self.bwd_tensor_stash, self.first_backward = {}, True
        self.offloaded = self.reloaded = 0
        return super().__enter__()

    def pack(self, activation: torch.Tensor) -> int:
        self.tensor_id += 1
        tensor_id, key = self.tensor_id, activation.untyped_storage()._cdata  # data_ptr() is 0 on meta
        if key in self.storage_to_tensor_id or activation.element_size() * activation.nelement() < MIN_BYTES or \
                isinstance(activation, torch.nn.Parameter) or key in self.param_storages:  # fmt: skip
            self.tracker[tensor_id] = (activation, False)
            return tensor_id
        for old in [k for k in self.fwd_stash if k <= tensor_id - STASH]:
            del self.storage_to_tensor_id[self.fwd_stash.pop(old).untyped_storage()._cdata]
        copy = HostCopy(activation)
        self.offloaded += copy.nbytes
        self.tracker[tensor_id] = (copy, True)
        self.fwd_stash[tensor_id] = activation
        self.storage_to_tensor_id[key] = tensor_id
        return tensor_id

    def unpack(self, tensor_id: int) -> torch.Tensor:
        if self.first_backward:
            self.first_backward = False
            torch.autograd.variable.Variable._execution_engine.queue_callback(self.bwd_tensor_stash.clear)
        kept, modified = self.tracker.pop(tensor_id)
        if not modified:
            return kept
        node, prev = torch._C._current_autograd_node(), []
        if node is not self.curr_node:
            self.curr_node, prev = node, list(self.bwd_tensor_stash)
        if tensor_id in self.fwd_stash:
            tensor = self.fwd_stash[tensor_id]
        else:
            tensor = self.bwd_tensor_stash[tensor_id] = kept.to_device()
            self.reloaded += kept.nbytes

        def hook(outputs, inputs):
            self.fwd_stash.clear()
            self.storage_to_tensor_id.clear()
            for k in prev:
                self.bwd_tensor_stash.pop(k, None)

        node.register_hook(hook)
        return tensor


class NoOp(saved_tensors_hooks):
    """NoOpManager: lm_head's forward keeps its saves (get_act_offloading_ctx_manager)."""

    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)


def exclude_head(model: torch.nn.Module) -> None:
    """get_act_offloading_ctx_manager's hooks on lm_head (through PEFT's base_model: LoraModel's __getattr__)."""
    noop = NoOp()
    head = model.get_output_embeddings()
    head.register_forward_pre_hook(lambda *args: noop.__enter__())
    head.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)


class SaveOnMeta(saved_tensors_hooks):
    """torch.autograd.graph.save_on_cpu(pin_memory=True): every tensor packed to the host, unpacked with .to(device)."""

    def __init__(self, counts: list[int]):
        def pack(t: torch.Tensor) -> HostCopy:
            copy = HostCopy(t)
            counts[0] += copy.nbytes
            return copy

        def unpack(copy: HostCopy) -> torch.Tensor:
            counts[1] += copy.nbytes
            return copy.to_device()

        super().__init__(pack, unpack)


def offload_checkpoints(model: torch.nn.Module, counts: list[int]) -> None:
    """Transformers' activation_checkpointing_kwargs={"offload": True}: each checkpointed layer's checkpoint call
    under save_on_cpu (modeling_utils.py _activation_checkpointing_enable's checkpoint_func)."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None:
            def offloaded(*args, func=func, **kwargs):
                with SaveOnMeta(counts):
                    return func(*args, **kwargs)

            module._gradient_checkpointing_func = offloaded


class OffloadedRecipe:
    """A recipe whose forward runs under a fresh OffloadActivations, as SFTTrainer.training_step enters it."""

    def __init__(self, recipe, model: torch.nn.Module):
        self.recipe, self.context = recipe, OffloadOnMeta(model)  # made once, in SFTTrainer.__init__

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.context:
            return self.recipe.forward(idx, targets)

    def backward(self, loss: torch.Tensor) -> None:
        self.recipe.backward(loss)

    def update(self) -> bool:
        return self.recipe.update()
