"""The backward engine, as torch.autograd's runs on one thread, in bytes: of the nodes that are ready, the
highest sequence number runs first (torch's ReadyQueue; AccumulateGrad before all); gradients reaching one
input twice are summed out of place, as torch's InputBuffer does unless it owns the first gradient alone
(never the case in these models: measured on meta and on CPU); each node's saved tensors are released
once it has run. Backward holds the methods memcalc.exact.sim.graph.Graph runs it with.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .checkpoint import Slot
from .tensors import Tensor

if TYPE_CHECKING:
    from .graph import Node


class Backward:
    """memcalc.exact.sim.graph.Graph's backward(): the engine's loop, a node's run, and autograd's validate_outputs
    (a base of Graph: it runs on the graph's memory, empty() and kernel())."""

    def backward(self, root: Tensor) -> None:
        """root.backward() for a scalar root: torch.autograd's engine on one thread, in bytes."""
        ones = self.empty(root.shape, root.dtype, "ones_like")  # torch.autograd.backward holds it to the end
        self.grad_enabled, self.in_backward = False, True
        outer = self.layer, self.scope
        self.kernel("ones_like", (), (ones,))
        self.run_engine(root.grad_fn, ones)
        if self.offload is not None:
            self.offload.finish()
        # the flags first, then the block: a graph whose layer setter fires hooks (memcalc.exact.replay.fsdp2) sees
        # forward's state again
        self.grad_enabled, self.in_backward = True, False
        self.layer, self.scope = outer

    def nested_backward(self, root: Tensor, grad: Tensor) -> None:
        """torch.autograd.backward(root, grad) called from a node's backward (reentrant checkpointing): the engine
        runs the root's graph to the end, on the same thread, before the node that called it goes on."""
        outer = self.grad_enabled, self.in_backward, self.layer, self.scope
        self.grad_enabled, self.in_backward = False, True
        self.run_engine(root.grad_fn, grad)
        self.grad_enabled, self.in_backward = outer[:2]
        self.layer, self.scope = outer[2:]

    def run_engine(self, root: Node, grad: Tensor) -> None:
        """The engine's loop from root, given its gradient (the caller puts the block and scope back after it)."""
        deps = dependencies(root)
        buffers: dict[Node, list] = {root: [grad]}
        ready = [root]
        del grad
        while ready:
            node = heapq.heappop(ready)
            if node.group != self.region:  # equal copies' nodes run in turn, one copy's simulated (Region)
                self.leave_region()
            self.layer, self.scope = node.layer, node.scope  # its kernels belong where its forward ran
            if node.group is not None and self.region is None:
                self.enter_region(node.group)
            outs, grad, buf = self.run(node, buffers.pop(node)), None, None
            for edge, grad in zip(node.edges, outs):
                if edge is None or grad is None:
                    continue
                nxt, slot = edge
                buf = buffers.setdefault(nxt, [None] * nxt.n_inputs)
                if buf[slot] is None:
                    buf[slot] = grad
                else:  # InputBuffer: summed out of place
                    total = self.empty(grad.shape, grad.dtype, "add")
                    self.kernel("add", (buf[slot], grad), (total,))
                    buf[slot] = total
                    del total
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, nxt)
            del outs, grad, buf  # no lingering references: torch's engine holds none
        self.leave_region()

    def run(self, node: Node, grads: list) -> list:
        if node.leaf is not None:  # AccumulateGrad: the first gradient is stolen, not copied
            if node.leaf.grad is None:
                node.leaf.grad = grads[0]
                self.mark(grads[0], "gradient", node.leaf.name)
            else:
                self.accumulate(node.leaf)
            if self.post_accumulate is not None and node.leaf.storage.kind == "param":
                grads.clear()  # the engine moved the gradient into .grad: the hook's zero_grad frees it
                self.post_accumulate(node.leaf)  # register_post_accumulate_grad_hook's hook
            if node.leaf.storage.kind == "activation":  # a tensor made a leaf (memcalc.exact.hf.lora.require_grad)
                node.leaf.grad_fn = None  # holds its AccumulateGrad weakly: it dies with the graph, and its .grad
            return []
        rebuilt = any(isinstance(s, Slot) for s in node.saved)
        if rebuilt:  # a checkpointed node: rebuild its region at the first unpack
            frame = next(s.frame for s in node.saved if isinstance(s, Slot))
            if frame.recomputed is None:
                self.rebuild(frame, node)
            node.saved = [frame.recomputed.pop(s.index) if isinstance(s, Slot) else s for s in node.saved]
        hooked = None
        if self.offload is not None:  # what offloading's hooks packed comes back (from the host) as apply()'s locals
            node.saved, hooked = self.offload.unpacked(node, node.saved)
        outs = node.rule(grads)
        del hooked  # apply()'s locals die as it returns
        if rebuilt:  # unpacked rebuilt tensors were locals of apply(): they die as it returns
            node.saved = None
        self.validate(outs, node.dtypes)
        grads.clear()  # the incoming gradients die with call_function
        release(node)
        if self.offload is not None:
            self.offload.after(node)
        return outs

    def accumulate(self, leaf: Tensor) -> None:
        """AccumulateGrad when the leaf already has a gradient: grad += new, in place (no bytes),
        one kernel that reads both and writes the sum."""
        self.kernel("add_", (leaf.grad, leaf.grad), (leaf.grad,))

    def validate(self, outs: list, dtypes: list) -> None:
        """autograd's validate_outputs (torch/csrc/autograd/engine.cpp), slot by slot, each replaced
        gradient freed at once: a (gradient, input shape) pair is summed to that shape, then a gradient
        of another dtype than its input (an autocast cast's, a promoted op's) is cast to it."""
        for i in range(len(outs)):
            out, outs[i] = outs[i], None
            if isinstance(out, tuple):
                grad, shape = out
                del out
                out = grad if grad.shape == tuple(shape) else self.summed(grad, shape)
                del grad
            if out is not None and dtypes[i] is not None and out.dtype != dtypes[i]:
                out = self.cast(out, dtypes[i])
            outs[i] = out
            del out

    def summed(self, grad: Tensor, shape) -> Tensor:
        """at::sum_to(grad, shape): a new tensor."""
        out = self.empty(shape, grad.dtype, "sum")
        self.kernel("sum", (grad,), (out,))
        return out

    def cast(self, grad: Tensor, dtype: str) -> Tensor:
        """grad.to(dtype): a new tensor."""
        out = self.empty(grad.shape, dtype, "_to_copy")
        self.kernel("_to_copy", (grad,), (out,))
        return out


def release(node: Node) -> None:
    """release_variables(): the saved tensors go, an autograd.Function's first to last (PyNode:
    saved_variables.clear()), another node's as its list falls."""
    saved, node.saved = node.saved, None
    if node.function and saved:
        for i in range(len(saved)):
            saved[i] = None


def dependencies(root: Node) -> dict[Node, int]:
    """How many gradients each node waits for (torch's compute_dependencies)."""
    deps: dict[Node, int] = {}
    seen, stack = {id(root)}, [root]
    while stack:
        node = stack.pop()
        for edge in node.edges:
            if edge is None:
                continue
            nxt = edge[0]
            deps[nxt] = deps.get(nxt, 0) + 1
            if id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return deps
