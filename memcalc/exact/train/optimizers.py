"""The libraries' optimizer steps in bytes on memcalc.exact.sim.graph: torch.optim's AdamW and SGD (torch 2.13:
torch/optim/adam.py, sgd.py, optimizer.py) and bitsandbytes' AdamW8bit (0.50: bitsandbytes/optim/
optimizer.py, functional.py).

Each function mirrors the library function of the same name line by line, so that Python keeps the
same temporaries alive for the same time (a denominator lives until the next one is assigned; a list
of temporaries dies, last element first, when its function returns). What each keeps:

  AdamW, loop     exp_avg, exp_avg_sq = zeros_like(param): the parameter's dtype (16-bit in the pure
    (foreach=False) recipe). step counters on the CPU (Adam._init_group: "[special device hosting for
                    step]"): no device bytes on CUDA; on CPU tensors (device="cpu") the CPU is the
                    device: 4 bytes per tensor. Per tensor, two temporaries: exp_avg_sq.sqrt() and its
                    quotient by sqrt(bias_correction2), beside the previous tensor's denominator.
  AdamW, foreach  the same state; _foreach_sqrt over every exp_avg_sq of a (device, dtype) group at
                    once: one temporary the size of all the group's parameters. (Its CPU step counters
                    are advanced by torch.tensor(1.0, device="cpu"): 4 bytes on the device on CPU.)
  AdamW, fused    the same state, its step counters fp32 scalars on the device (4 bytes per tensor);
                    one _fused_adamw_ per group, no temporary. Under GradScaler it is handed the scale
                    and found_inf (memcalc.exact.train.amp.GradScaler.step) and reads them.
  SGD (momentum)  momentum_buffer = grad.detach().clone() at the first step; later steps in place
                    (loop and foreach alike): no temporary. fused has no meta kernel in torch 2.13
                    (aten::_fused_sgd_), so it cannot be measured here and is not replayed.
  AdamW8bit       per tensor of at least min_8bit_size (4096) elements: uint8 state1 and state2, one
                    fp32 absmax per 256-element block each, and the two 256-entry fp32 quantile maps
                    (qmap1, qmap2) moved to the device once, shared by every tensor; smaller tensors keep
                    fp32 state1 and state2. One kernel per tensor, in place: no temporary (the CUDA
                    backend calls kOptimizer*Blockwise8bit / kOptimizer32bit2State directly).

Kernels go to g.kernel as the reference recipe's do. A foreach or fused kernel over a group is recorded
one kernel per layer (its share of the group's bytes), so that one traced block scales as the rest of
the step does (memcalc.exact.kernels).
"""

from __future__ import annotations

from memcalc.model.bnb import BLOCK, MIN_8BIT_SIZE, MIN_PAGED_SIZE

from ..base.config import ITEMSIZE
from ..sim.graph import Graph, layer_of
from ..sim.tensors import LiveBytes, Storage, Tensor

QMAP = 256  # bitsandbytes functional.create_dynamic_map: 2**8 fp32 entries
# arithmetic per element of the optimizers' list and fused kernels, counted from torch's formulas
PER_ELEMENT = {"_foreach_mul_": 1, "_foreach_lerp_": 2, "_foreach_addcmul_": 3, "_foreach_sqrt": 1,
               "_foreach_div_": 1, "_foreach_add_": 1, "_foreach_sub_": 1, "_foreach_addcdiv_": 3,
               "_fused_adamw_": 13,  # decay 1, lerp 2, mul + addcmul 4, sqrt, div, add 3, addcdiv 3
               "optimizer_update_8bit_blockwise": 19,  # the 13 of AdamW, dequantise and requantise m, v 6
               "optimizer_update_32bit": 13}  # fmt: skip


def zeros_like(g: Graph, p: Tensor, dtype: str | None = None, op: str = "zeros_like") -> Tensor:
    """torch.zeros_like(p, dtype=dtype): optimizer state, of the parameter's dtype unless told."""
    t = g.empty(p.shape, dtype or p.dtype, op, kind="state")
    g.kernel(op, (), (t,))
    g.mark(t, "state", p.name)
    return t


def zeros(g: Graph, shape: tuple, dtype: str) -> Tensor:
    """torch.zeros(shape, dtype=dtype, device=the parameters' device)."""
    t = g.empty(shape, dtype, "zeros", kind="state")
    g.kernel("zeros", (), (t,))
    return t


def out_of_place(g: Graph, op: str, *inputs: Tensor) -> Tensor:
    """A new tensor shaped as the first input, of its dtype, made by one elementwise kernel."""
    t = g.empty(inputs[0].shape, inputs[0].dtype, op)
    g.kernel(op, inputs, (t,))
    return t


def in_place(g: Graph, op: str, t: Tensor, *others: Tensor) -> Tensor:
    g.kernel(op, (t, *others), (t,))
    return t


def foreach(g: Graph, op: str, params: list[Tensor], reads: tuple[list, ...], writes: tuple[list, ...],
            shared: tuple[Tensor, ...] = ()) -> None:  # fmt: skip
    """One list kernel over a group (torch's multi_tensor_apply), recorded one kernel per layer; shared
    scalars (GradScaler's) are read by each layer's share."""
    by_layer: dict[int | None, list[int]] = {}
    for i, p in enumerate(params):
        by_layer.setdefault(layer_of(p.name), []).append(i)
    for layer, idx in by_layer.items():
        g.layer = layer
        elements = sum(params[i].numel for i in idx)
        g.kernel(op, tuple(ts[i] for ts in reads for i in idx) + shared, tuple(ts[i] for ts in writes for i in idx),
                 flops=PER_ELEMENT[op] * elements)  # fmt: skip
    g.layer = None


def foreach_sqrt(g: Graph, params: list[Tensor], tensors: list[Tensor]) -> list[Tensor]:
    """torch._foreach_sqrt: a new tensor per input, all allocated before the first is freed."""
    out = [g.empty(t.shape, t.dtype, "_foreach_sqrt") for t in tensors]
    foreach(g, "_foreach_sqrt", params, (tensors,), (out,))
    return out


def group_by_device_and_dtype(params: list[Tensor]) -> dict[str, list[int]]:
    """torch/utils/_foreach_utils.py _group_tensors_by_device_and_dtype: indices by the parameter's dtype
    (one device here), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(i)
    return groups


# -- torch.optim.AdamW ---------------------------------------------------------------------------


def single_tensor_adam(g: Graph, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                       exp_avg_sqs: list[Tensor]) -> None:  # fmt: skip
    """torch/optim/adam.py _single_tensor_adam, decoupled weight decay, capturable off."""
    for i, param in enumerate(params):
        grad, exp_avg, exp_avg_sq = grads[i], exp_avgs[i], exp_avg_sqs[i]
        g.layer = layer_of(param.name)
        in_place(g, "mul_", param)  # param.mul_(1 - lr * weight_decay); step_t += 1 runs on the CPU
        in_place(g, "lerp_", exp_avg, grad)  # exp_avg.lerp_(grad, 1 - beta1)
        in_place(g, "addcmul_", in_place(g, "mul_", exp_avg_sq), grad)  # .mul_(beta2).addcmul_(grad, grad)
        # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): the sqrt dies once the quotient
        # exists; the previous tensor's denom only when this one is assigned
        denom = in_place(g, "add_", out_of_place(g, "div", out_of_place(g, "sqrt", exp_avg_sq)))
        in_place(g, "addcdiv_", param, exp_avg, denom)  # param.addcdiv_(exp_avg, denom, value=-step_size)
    g.layer = None


def multi_tensor_adam(g: Graph, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                      exp_avg_sqs: list[Tensor], host_is_device: bool = False) -> None:  # fmt: skip
    """torch/optim/adam.py _multi_tensor_adam, decoupled weight decay, capturable off; its step counters
    are on the CPU: torch._foreach_add_(device_state_steps, torch.tensor(1.0, device="cpu")) there, a
    4-byte tensor on the device only when the CPU is the device (host_is_device)."""
    for idx in group_by_device_and_dtype(params).values():
        device_params = [params[i] for i in idx]
        device_grads = [grads[i] for i in idx]
        device_exp_avgs, device_exp_avg_sqs = [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx]
        ps = device_params
        if host_is_device:  # the argument lives for the call only
            one = g.empty((), "fp32", "lift_fresh")
            del one
        foreach(g, "_foreach_mul_", ps, (device_params,), (device_params,))
        foreach(g, "_foreach_lerp_", ps, (device_exp_avgs, device_grads), (device_exp_avgs,))
        foreach(g, "_foreach_mul_", ps, (device_exp_avg_sqs,), (device_exp_avg_sqs,))
        foreach(g, "_foreach_addcmul_", ps, (device_exp_avg_sqs, device_grads), (device_exp_avg_sqs,))
        del device_grads
        exp_avg_sq_sqrt = foreach_sqrt(g, ps, device_exp_avg_sqs)
        foreach(g, "_foreach_div_", ps, (exp_avg_sq_sqrt,), (exp_avg_sq_sqrt,))
        foreach(g, "_foreach_add_", ps, (exp_avg_sq_sqrt,), (exp_avg_sq_sqrt,))
        foreach(g, "_foreach_addcdiv_", ps, (device_params, device_exp_avgs, exp_avg_sq_sqrt), (device_params,))


def fused_adam(g: Graph, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], state_steps: list[Tensor], grad_scale: Tensor | None = None,
               found_inf: Tensor | None = None) -> None:  # fmt: skip
    """torch/optim/adam.py _fused_adam: per group, the step counters (on the device) + 1, then one
    torch._fused_adamw_ reading and writing each tensor once. Under GradScaler (grad_scale, found_inf:
    on the device already, .to(device) copies nothing) the kernel reads both, and the counters are
    taken back by found_inf in place (torch._foreach_sub_)."""
    scalars = tuple(t for t in (grad_scale, found_inf) if t is not None)
    for idx in group_by_device_and_dtype(params).values():
        ps, steps = [params[i] for i in idx], [state_steps[i] for i in idx]
        gs, ms, vs = [grads[i] for i in idx], [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx]
        foreach(g, "_foreach_add_", ps, (steps,), (steps,))
        foreach(g, "_fused_adamw_", ps, (ps, gs, ms, vs, steps), (ps, ms, vs), scalars)
        if found_inf is not None:
            foreach(g, "_foreach_sub_", ps, (steps,), (steps,), (found_inf,))


class AdamW:
    """torch.optim.AdamW (torch/optim/adam.py Adam): step() = _init_group, then the implementation.
    device: the parameters' device; on "cpu" the loop and foreach step counters, hosted on the CPU,
    are on it too. Fused has _step_supports_amp_scaling (Adam.__init__): GradScaler hands it the scale."""

    def __init__(self, g: Graph, params: list[Tensor], impl: str, device: str = "cuda"):
        self.g, self.params, self.impl = g, params, impl
        self.host_is_device = device == "cpu"
        self.supports_amp_scaling = impl == "fused"
        self.state: list[dict[str, Tensor]] = [{} for _ in params]

    def init_group(self) -> tuple[list, ...]:
        """Adam._init_group: the state of each parameter with a gradient, made at its first step:
        step (on the device when fused; else torch.tensor(0.0) on the CPU, which on CPU tensors is the
        device: aten.lift_fresh), exp_avg, exp_avg_sq."""
        params, grads, exp_avgs, exp_avg_sqs, state_steps = [], [], [], [], []
        for p, state in zip(self.params, self.state):
            if p.grad is None:
                continue
            params.append(p)
            grads.append(p.grad)
            if not state:
                self.g.layer = layer_of(p.name)
                if self.impl == "fused":  # torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device)
                    state["step"] = zeros(self.g, (), "fp32")
                elif self.host_is_device:  # torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
                    state["step"] = self.g.empty((), "fp32", "lift_fresh", kind="state")
                state["exp_avg"] = zeros_like(self.g, p)
                state["exp_avg_sq"] = zeros_like(self.g, p)
                self.g.layer = None
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            state_steps.append(state.get("step"))
        return params, grads, exp_avgs, exp_avg_sqs, state_steps

    def step(self, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
        """Adam.step: getattr(self, "grad_scale", None) and found_inf reach the fused implementation
        only (the others assert they are None)."""
        params, grads, exp_avgs, exp_avg_sqs, state_steps = self.init_group()
        if self.impl == "loop":
            single_tensor_adam(self.g, params, grads, exp_avgs, exp_avg_sqs)
        elif self.impl == "foreach":
            multi_tensor_adam(self.g, params, grads, exp_avgs, exp_avg_sqs, self.host_is_device)
        else:
            fused_adam(self.g, params, grads, exp_avgs, exp_avg_sqs, state_steps, grad_scale, found_inf)


# -- torch.optim.SGD -----------------------------------------------------------------------------


def single_tensor_sgd(g: Graph, params: list[Tensor], grads: list[Tensor], momentum_buffer_list: list) -> None:
    """torch/optim/sgd.py _single_tensor_sgd with momentum, no weight decay, dampening or Nesterov."""
    for i, param in enumerate(params):
        grad = grads[i]
        g.layer = layer_of(param.name)
        buf = momentum_buffer_list[i]
        if buf is None:  # the first step: buf = grad.detach().clone()
            buf = g.empty(grad.shape, grad.dtype, "clone", kind="state")
            g.kernel("clone", (grad,), (buf,))
            momentum_buffer_list[i] = buf
        else:  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            in_place(g, "add_", in_place(g, "mul_", buf), grad)
        grad = buf
        in_place(g, "add_", param, grad)  # param.add_(grad, alpha=-lr)
    g.layer = None


def multi_tensor_sgd(g: Graph, params: list[Tensor], grads: list[Tensor], momentum_buffer_list: list) -> None:
    """torch/optim/sgd.py _multi_tensor_sgd with momentum, no weight decay, dampening or Nesterov."""
    for idx in group_by_device_and_dtype(params).values():
        device_params, device_grads = [params[i] for i in idx], [grads[i] for i in idx]
        device_momentum_buffer_list = [momentum_buffer_list[i] for i in idx]
        ps = device_params
        if all(b is not None for b in device_momentum_buffer_list):
            bufs = device_momentum_buffer_list
            foreach(g, "_foreach_mul_", ps, (bufs,), (bufs,))
            foreach(g, "_foreach_add_", ps, (bufs, device_grads), (bufs,))
        else:  # the first step: each missing buffer is device_grads[i].detach().clone()
            bufs = []
            for k, i in enumerate(idx):
                buf = device_momentum_buffer_list[k]
                g.layer = layer_of(params[i].name)
                if buf is None:
                    buf = g.empty(device_grads[k].shape, device_grads[k].dtype, "clone", kind="state")
                    g.kernel("clone", (device_grads[k],), (buf,))
                    device_momentum_buffer_list[k] = momentum_buffer_list[i] = buf
                else:
                    in_place(g, "add_", in_place(g, "mul_", buf), device_grads[k])
                bufs.append(buf)
            g.layer = None
        device_grads = bufs
        foreach(g, "_foreach_add_", ps, (device_params, device_grads), (device_params,))


class SGD:
    """torch.optim.SGD with momentum (torch/optim/sgd.py): step() = _init_group, the implementation,
    then each momentum_buffer stored in the state."""

    def __init__(self, g: Graph, params: list[Tensor], impl: str):
        self.g, self.params, self.impl = g, params, impl
        self.state: list[dict[str, Tensor]] = [{} for _ in params]

    def step(self) -> None:
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in with_grad]
        grads = [p.grad for p in params]
        momentum_buffer_list = [self.state[i].get("momentum_buffer") for i in with_grad]
        run = single_tensor_sgd if self.impl == "loop" else multi_tensor_sgd
        run(self.g, params, grads, momentum_buffer_list)
        for i, buf in zip(with_grad, momentum_buffer_list):  # SGD.step: state["momentum_buffer"] = ...
            self.state[i]["momentum_buffer"] = buf


# -- bitsandbytes.optim.AdamW8bit ----------------------------------------------------------------


class AdamW8bit:
    """bitsandbytes/optim/optimizer.py Optimizer8bit.step over Optimizer2State("adam", optim_bits=8): per
    parameter with a gradient, its state made at its first step (init_state), then one update kernel
    (update_step). The quantile maps are made on the CPU when the optimizer is (fill_qmap) and moved to
    the device by the first 8-bit tensor's init_state. bits=32 is PagedAdamW's Optimizer2State(optim_bits=32):
    fp32 state1 and state2 for every tensor. paged (PagedAdamW8bit, PagedAdamW: is_paged=True): get_state_buffer
    puts the state of a tensor of at least 1e5 elements in unified memory (functional.get_paged: cudaMallocManaged
    through bitsandbytes' C library, outside PyTorch's caching allocator), counted in self.unified, not on the
    graph's memory; the absmax buffers and the qmaps stay torch tensors."""

    def __init__(self, g: Graph, params: list[Tensor], bits: int = 8, paged: bool = False):
        self.g, self.params, self.bits, self.paged = g, params, bits, paged
        self.state: list[dict[str, Tensor]] = [{} for _ in params]
        self.qmaps: tuple[Tensor, Tensor] | None = None  # name2qmap["dynamic"], ["udynamic"] on the device
        self.unified = LiveBytes()  # the paged state: unified memory the driver may evict to the host

    @property
    def unified_bytes(self) -> int:
        return self.unified.live_bytes

    def state_buffer(self, p: Tensor, dtype: str) -> Tensor:
        """Optimizer8bit.get_state_buffer(p, dtype): zeros_like on the device, or a zero-filled paged buffer."""
        if not self.paged or p.numel < MIN_PAGED_SIZE:
            return zeros_like(self.g, p, dtype)
        t = Tensor(Storage(self.unified, p.numel * ITEMSIZE[dtype], "get_paged", "state"), p.shape, dtype)
        self.g.kernel("fill", (), (t,))  # F.fill(buff, 0)
        return t

    def init_state(self, i: int, p: Tensor) -> None:
        """Optimizer2State.init_state: 8-bit state at or above min_8bit_size elements, else fp32."""
        g, state = self.g, self.state[i]
        if self.bits == 32 or p.numel < MIN_8BIT_SIZE:  # get_state_buffer(p, dtype=torch.float32)
            state["state1"], state["state2"] = self.state_buffer(p, "fp32"), self.state_buffer(p, "fp32")
            return
        if self.qmaps is None:  # self.name2qmap["dynamic"].to(p.device), then "udynamic"
            self.qmaps = tuple(g.empty((QMAP,), "fp32", "_to_copy", kind="state") for _ in range(2))
            for q in self.qmaps:
                g.kernel("_to_copy", (), (q,))
        state["state1"], state["qmap1"] = self.state_buffer(p, "uint8"), self.qmaps[0]
        state["state2"], state["qmap2"] = self.state_buffer(p, "uint8"), self.qmaps[1]
        blocks = -(-p.numel // BLOCK)  # (n // blocksize) + bool(n % blocksize)
        state["absmax1"], state["absmax2"] = zeros(g, (blocks,), "fp32"), zeros(g, (blocks,), "fp32")

    def update_step(self, i: int, p: Tensor) -> None:
        """F.optimizer_update_8bit_blockwise or F.optimizer_update_32bit: one kernel, in place."""
        s = self.state[i]
        if "absmax1" in s:
            reads = (p.grad, p, s["state1"], s["state2"], s["qmap1"], s["qmap2"], s["absmax1"], s["absmax2"])
            writes = (p, s["state1"], s["state2"], s["absmax1"], s["absmax2"])
            op = "optimizer_update_8bit_blockwise"
        else:
            reads, writes, op = (p.grad, p, s["state1"], s["state2"]), (p, s["state1"], s["state2"]), \
                "optimizer_update_32bit"
        self.g.kernel(op, reads, writes, flops=PER_ELEMENT[op] * p.numel)

    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            self.g.layer = layer_of(p.name)
            if not self.state[i]:
                self.init_state(i, p)
            self.update_step(i, p)
        self.g.layer = None


def library_optimizer(g: Graph, params: list[Tensor], optimizer: str, impl: str,
                      device: str = "cuda") -> AdamW | SGD | AdamW8bit:  # fmt: skip
    """verify/recipes.py library_optimizer: torch.optim.AdamW or SGD as impl picks, or bitsandbytes'
    AdamW8bit (its own per-tensor step, whatever the impl), for parameters on the device."""
    if optimizer == "adamw":
        return AdamW(g, params, impl, device)
    if optimizer == "sgd":
        return SGD(g, params, impl)
    return AdamW8bit(g, params, 32 if optimizer == "paged-adamw" else 8, optimizer.startswith("paged-"))
