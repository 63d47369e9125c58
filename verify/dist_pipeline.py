"""One rank of FSDP2 + pipeline parallel as torchtitan runs it, on the fake process group: one stage's model part,
FSDP2-wrapped as torchtitan wraps it under PP, driven through its 1F1B schedule for m micro-batches.

The stage is driven here in torch's own order, not through torch.distributed.pipelining's PipelineStage: torch
2.13's stage starts with a P2P vote (schedules.py _warmup_p2p) whose received value the fake group never fills.
What the stage and the schedule do to memory is done here in the same order (torch 2.13
torch/distributed/pipelining):
  recv buffers  stage.py _setup_forward_recv_info / _setup_backward_recv_info: one activation buffer per
                micro-batch (every stage but the first) and one output-gradient buffer per micro-batch (every
                stage but the last), made at the first step and kept for the stage's life
  forward       forward_one_chunk: the received buffer made a leaf that requires grad, the output and the
                inputs kept in fwd_cache until that micro-batch's backward; the last stage computes the loss
  backward      backward_maybe_with_nosync: FSDP2 told set_is_last_backward(False),
                set_reshard_after_backward(False), set_requires_gradient_sync(False); _backward.py stage_backward
                (torch.autograd.backward of the output with the received gradient: the input's gradient is
                accumulated into the recv buffer's .grad, kept until the next step's clear_runtime_states)
  1F1B          schedules.py Schedule1F1B._step_microbatches: min(m, p − stage) forwards, then one backward
                and one forward until the forwards run out, then the backwards left
  reduce        stage.py perform_reduce_grad: flags back on, every FSDP2 group's post_backward, then the
                root's final callback
torchtitan's train step around it: zero_grad(set_to_none), the schedule (return_outputs=False: the last stage keeps
no logits for the caller, torchtitan train.py), optimizer.step (fused AdamW).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.model.layout import Layout

from .builder import Transformer, build, rope_tables, sac_contexts
from .dist_measure import CountingFakeMode, count_resizes, local, storage_bytes, to_fake
from .dist_plan import torchtitan_fsdp
from .meta import meta_kernels
from .recipes import DTYPES


class StagePart(nn.Module):
    """One pipeline stage's part of verify/builder.py's Transformer, as torchtitan's pipeline_llm cuts it
    (torchtitan/distributed/pipeline_parallel.py: the first stage keeps the token table, the last the final
    norm and the output layer, each its own run of blocks). The last stage returns the logits; the loss is
    the schedule's loss_fn."""

    def __init__(self, full: Transformer, start: int, count: int, first: bool, last: bool):
        super().__init__()
        self.shape, self.kernels, self.start = full.shape, full.kernels, start
        self.tok_emb = full.tok_emb if first else None
        self.pos_emb = full.pos_emb if first else None
        self.blocks = nn.ModuleList(full.blocks[start : start + count])
        self.norm = full.norm if last else None
        self.lm_head = full.lm_head if last else None
        self.register_buffer("future", full.future, persistent=False)
        self.sac_observer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if self.tok_emb is not None:
            idx = x
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(T, device=idx.device))
        cos = sin = None
        if self.shape.positions == "rope":
            cos, sin = rope_tables(T, self.shape.head_dim, x.dtype, x.device)
        future = self.future[:T, :T] if self.future is not None else None
        for j, block in enumerate(self.blocks):
            i = self.start + j  # torchtitan keeps each block's own layer id
            if self.kernels.recompute == "op":
                context = lambda: sac_contexts(self.sac_observer)
                x = checkpoint(block, x, cos, sin, future, use_reentrant=False, context_fn=context)
            elif self.kernels.checkpointed(i):
                x = checkpoint(block, x, cos, sin, future, use_reentrant=False)
            else:
                x = block(x, cos, sin, future)
        if self.norm is None:
            return x
        return F.linear(self.norm(x), self.lm_head.weight)  # (B, T, V) in the activation dtype


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross_entropy_loss: the logits upcast to fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


class SnapshotMode(CountingFakeMode):
    """CountingFakeMode that numbers its counts, remembers the count that set the peak, and at a chosen count
    splits the live bytes by part (classify): the step is deterministic, so a second step taken the same way
    is split at the first one's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.peak_call = 0
        self.snap_at, self.classify, self.snapshot = -1, None, None

    def count(self, storage, op: str) -> None:
        peak = self.peak_bytes
        super().count(storage, op)
        self.calls += 1
        if self.peak_bytes != peak:
            self.peak_call = self.calls
        if self.calls == self.snap_at:
            self.snapshot = self.classify(self.sizes)

    def reset_peak(self, phase: str) -> None:
        super().reset_peak(phase)
        self.peak_call = self.calls


class Phases:
    """Each phase's peak over the step: a phase may run many times (one per micro-batch)."""

    def __init__(self, mode: SnapshotMode):
        self.mode, self.peaks, self.start = mode, {}, mode.calls

    def enter(self, name: str) -> None:
        m = self.mode
        if m.phase and m.peak_bytes > self.peaks.get(m.phase, (-1, "", 0))[0]:
            self.peaks[m.phase] = (m.peak_bytes, m.peak_at, m.peak_call - self.start)
        m.reset_peak(name)


class Stage:
    """One stage's runtime state and its schedule (see the module doc)."""

    def __init__(self, part: StagePart, stage: int, pp: int, m: int, in_shape, out_shape, dtype):
        self.part, self.stage, self.pp, self.m = part, stage, pp, m
        self.first, self.last = stage == 0, stage == pp - 1
        self.in_shape, self.out_shape, self.dtype = in_shape, out_shape, dtype
        self.recv: list[torch.Tensor] = []
        self.grad_recv: list[torch.Tensor] = []
        self.fwd_cache: dict[int, tuple] = {}
        self.losses: list[torch.Tensor] = []

    def init_buffers(self) -> None:
        """stage.py _setup_forward_recv_info / _setup_backward_recv_info (_make_tensor_from_meta: torch.empty)."""
        if not self.first and not self.recv:
            self.recv = [torch.empty(self.in_shape, dtype=self.dtype) for _ in range(self.m)]
        if not self.last and not self.grad_recv:
            self.grad_recv = [torch.empty(self.out_shape, dtype=self.dtype) for _ in range(self.m)]

    def clear_runtime_states(self) -> None:
        """stage.py clear_runtime_states: the caches, and the recv buffers' accumulated .grad."""
        self.fwd_cache.clear()
        for b in self.recv:
            b.grad = None

    def forward(self, k: int, idx, targets) -> None:
        x = idx[k] if self.first else self.recv[k].requires_grad_(True)
        out = self.part(x)
        self.fwd_cache[k] = (out, x)
        if self.last:
            self.losses.append(loss_fn(out, targets[k]))

    def backward(self, k: int) -> None:
        out, x = self.fwd_cache.pop(k)
        self.part.set_is_last_backward(False)
        self.part.set_reshard_after_backward(False)
        self.part.set_requires_gradient_sync(False)
        if self.last:
            loss = self.losses[k]
            torch.autograd.backward([loss], grad_tensors=[None])
        else:
            torch.autograd.backward([out], grad_tensors=[self.grad_recv[k]])
        del out, x

    def reduce_grad(self) -> None:
        """stage.py perform_reduce_grad."""
        part = self.part
        part.set_is_last_backward(True)
        part.set_reshard_after_backward(True)
        part.set_requires_gradient_sync(True)
        state = fully_shard.state(part)
        for s in state._state_ctx.all_states:
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def step(self, idx, targets, phases: Phases | None = None) -> None:
        """Schedule1F1B._step_microbatches for this stage."""
        enter = phases.enter if phases is not None else (lambda name: None)
        self.clear_runtime_states()
        self.init_buffers()
        self.losses = []
        warmup = min(self.m, self.pp - self.stage)
        f = b = 0
        for _ in range(warmup):
            enter("forward")
            self.forward(f, idx, targets)
            f += 1
        while True:
            enter("backward")
            self.backward(b)
            b += 1
            if f == self.m:
                break
            enter("forward")
            self.forward(f, idx, targets)
            f += 1
        while b < self.m:
            self.backward(b)
            b += 1
        enter("reduce")
        self.reduce_grad()
        self.losses = []  # _update_losses: copied out, then cleared


def stage_part(shape: ModelShape, seq_len: int, tricks: Tricks, layers: tuple[int, ...], stage: int) -> StagePart:
    full = build(shape, meta_kernels(tricks), seq_len, torch.float32)
    start = sum(layers[:stage])
    return StagePart(full, start, layers[stage], stage == 0, stage == len(layers) - 1)


def measure_fsdp2_pp(shape: ModelShape, seq_len: int, micro_batch: int, micro_batches: int, tricks: Tricks,
                     layout: Layout, layers: tuple[int, ...], stage: int, mesh) -> dict[str, object]:  # fmt: skip
    """One rank of stage `stage`: a warm-up step, then the measured one (live bytes at its start, each phase's
    peak over all its micro-batches) and the state it leaves, then a third split by part at the second's peak."""
    from .recipes import library_optimizer

    mode = SnapshotMode()
    part = stage_part(shape, seq_len, tricks, layers, stage)
    dtype = DTYPES[tricks.precision]
    torchtitan_fsdp(part, mesh["dp"], layout.reshard_after_forward, pipelined=True, param_dtype=dtype)
    b, s, h = micro_batch, seq_len, shape.hidden
    runner = Stage(part, stage, layout.pp, micro_batches, (b, s, h), (b, s, h), dtype)
    with count_resizes(mode):
        to_fake(part, mode)
        with mode:
            idx, targets = stage_inputs(shape, b, s, micro_batches, runner.first, runner.last)
            optimizer = library_optimizer(list(part.parameters()), "adamw", "fused")

            def train_step(phases=None):
                optimizer.zero_grad(set_to_none=True)
                runner.step(idx, targets, phases)
                if phases is not None:
                    phases.enter("optimizer")
                optimizer.step()
                if phases is not None:
                    phases.enter("")
                return phases

            train_step()  # FSDP2's lazy init, the recv buffers, AdamW's state: what every later step starts from
            between = mode.live_bytes
            peaks = train_step(Phases(mode)).peaks
            params = list(part.parameters())
            opt_state = [t for st in optimizer.state.values() for t in st.values()
                         if isinstance(t, torch.Tensor) and local(t).device == params[0].device]  # fmt: skip
            out = {"weights": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
                   "optimizer state": storage_bytes(opt_state), "between steps": between,
                   "recv buffers": storage_bytes(runner.recv + runner.grad_recv),
                   "input grads": storage_bytes(x.grad for x in runner.recv),
                   "token ids": storage_bytes((idx or []) + (targets or []))}  # fmt: skip
            for name in PHASES:
                out[f"{name} peak"], out[f"{name} peak at"], _ = peaks[name]
            name = max(PHASES, key=lambda n: peaks[n][0])
            out["step peak"], out["step peak at"] = peaks[name][:2]
            # a third step, split by part at the count where the second peaked
            mode.classify = lambda sizes: split(sizes, part, opt_state, runner, idx, targets)
            again = Phases(mode)
            mode.snap_at = again.start + peaks[name][2]
            train_step(again)
            out["peak parts"] = mode.snapshot
            out["repeated step peak"] = max(p[0] for p in again.peaks.values())
    return out


PHASES = ("forward", "backward", "reduce", "optimizer")  # reduce: perform_reduce_grad, after the last backward


def stage_inputs(shape: ModelShape, b: int, s: int, m: int, first: bool, last: bool):
    """Each micro-batch's token ids (the first stage) and targets (the last): one (m, b, s + 1) draw, sliced
    and copied out per micro-batch (the draw itself freed), m·b·s int64 per end."""
    if not (first or last):
        return None, None
    g = torch.Generator(device="cpu").manual_seed(0)
    draw = torch.randint(0, shape.vocab, (m, b, s + 1), generator=g)
    idx = [draw[k, :, :-1].clone() for k in range(m)] if first else None
    targets = [draw[k, :, 1:].clone() for k in range(m)] if last else None
    return idx, targets


PARTS = ("sharded state", "sharded gradients", "FSDP2 unsharded parameters", "FSDP2 accumulated gradients",
         "FSDP2 micro-batch gradients",
         "pipeline recv buffers", "stage input gradients", "token ids and buffers", "activations and temporaries")  # fmt: skip


def split(sizes: dict[int, int], part: StagePart, opt_state, runner: Stage, idx, targets) -> dict[str, int]:
    """The live storages (key → bytes) by part."""
    fsdp_params = [fp for st in fully_shard.state(part)._state_ctx.all_states for gr in st._fsdp_param_groups
                   for fp in gr.fsdp_params]  # fmt: skip
    groups = {  # the sharded parameters (FSDPParam.sharded_param), not the module's: those may be unsharded now
        "sharded state": [local(fp.sharded_param) for fp in fsdp_params] + list(opt_state),
        "sharded gradients": [fp.sharded_param.grad for fp in fsdp_params],
        "FSDP2 unsharded parameters": [t for fp in fsdp_params for t in fp.all_gather_outputs],
        "FSDP2 accumulated gradients": [fp.unsharded_accumulated_grad for fp in fsdp_params],  # reduce_dtype
        "FSDP2 micro-batch gradients": [
            fp._unsharded_param.grad for fp in fsdp_params if hasattr(fp, "_unsharded_param")
        ],  # param_dtype, before they are added in
        "pipeline recv buffers": runner.recv + runner.grad_recv,
        "stage input gradients": [x.grad for x in runner.recv],
        "token ids and buffers": (idx or []) + (targets or []) + list(part.buffers()),  # eager attention's mask
    }
    out, seen = dict.fromkeys(PARTS, 0), set()
    for name, tensors in groups.items():
        for t in tensors:
            if t is None:
                continue
            key = local(t).untyped_storage()._cdata
            if key in sizes and key not in seen:
                seen.add(key)
                out[name] += sizes[key]
    out["activations and temporaries"] = sum(v for k, v in sizes.items() if k not in seen)
    return out
