"""Measuring a training step on the meta device: nothing is allocated, so an 8B model at seq 8192
runs on a laptop in seconds.

Two passes over the same model and recipe:
  1. the step (a warm-up step, then the measured one) under LiveBytes, with SavedBytes hooks on
     its forward: the bytes of every phase, exactly as the dispatcher allocates them; and its FLOPs
     under FlopCounterMode (StepFlops), over the measured step's first forward and backward;
  2. the same at depth 1 and 2: per-layer saved bytes are the difference (and the full depth must
     be linear in them); with ckpt:N at depths N − 1, N and N + 1, for a layer not checkpointed
     (N + 1 less N) and one checkpointed (N less N − 1); with dense blocks before MoE ones, the step
     exact counts outside (memcalc.exact.growth.Growth.first_blocks) and a MoE block of each kind past it;
     every depth built with the trick set as the full depth runs it (memcalc.exact.growth.as_run: ckpt:N
     over fewer than N blocks checkpoints none, so neither do the depths beside it).
Meta runs what CUDA runs because the builder is told to (Kernels): aten.native_dropout and
aten._scaled_dot_product_flash_attention, never the CPU paths stock PyTorch takes on meta.
A stack whose model is "hf" measures Hugging Face Transformers' own model class instead
(verify/hf.py), with the same switches made there.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from memcalc.exact.growth import as_run, growth, layer_blocks
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import DEFAULT_STACK, FUSED_HEAD, Stack
from memcalc.model.tricks import Tricks

from .builder import Kernels, build
from .lora import held_tensors, meta_paths
from .recipes import DTYPES, Recipe, TorchRecipe, recipe_for
from .track import LiveBytes, SavedBytes


def build_model(shape: ModelShape, seq_len: int, tricks: Tricks, stack: Stack = DEFAULT_STACK,
                device: str = "meta") -> torch.nn.Module:  # fmt: skip
    """The model a stack trains (memcalc.model.stacks: Stack.model): memcalc's reference model
    (verify/builder.py), or Transformers' AutoModelForCausalLM (verify/hf.py)."""
    if stack.model == "torchtune":
        from .torchtune import build_torchtune

        return build_torchtune(shape, tricks, stack, device)
    if stack.model == "hf":
        from .hf import build_hf

        return build_hf(shape, tricks, seq_len, device=device, use_cache=stack.use_cache, finetune=stack.finetune,
                        trl=stack.trl, liger=stack.savers.liger is not None, reentrant=stack.reentrant,
                        loss=stack.loss, rl=stack.rl,
                        precompute_ref=stack.precompute_ref, online=stack.online)  # fmt: skip
    return build(shape, meta_kernels(tricks), seq_len, DTYPES[tricks.precision])


@contextlib.contextmanager
def paths_for(stack: Stack, device: str = "meta"):
    """What the stack's model needs held over its forward and backward on meta (verify/hf.py cuda_paths; on meta
    a QLoRA model's 4-bit matmuls as CUDA's, verify/lora.py meta_paths; Liger's Functions, verify/liger.py
    meta_paths; TRL's own kernels, trl_kernels; torchtune's dropout as CUDA's)."""
    from .hf import cuda_dropout, cuda_paths

    if stack.model == "torchtune":  # its LoRALinear's nn.Dropout
        with cuda_dropout():
            yield
        return
    if stack.model != "hf":
        yield
        return

    if stack.savers.liger is not None:
        from .liger import held

        with cuda_paths(), meta_paths() if device == "meta" else contextlib.nullcontext(), \
                held(stack.savers.liger, device), trl_kernels(stack):  # fmt: skip
            yield
        return
    with cuda_paths(), meta_paths() if device == "meta" else contextlib.nullcontext(), trl_kernels(stack):
        yield


def trl_kernels(stack: Stack):
    """TRL's kernels as on CUDA: its fused LM head (verify/trl.py fused_paths), 1.14's entropy kernel (kernel_paths),
    for a stack whose SFTTrainer uses them; under loss_type chunked_nll, 1.4-1.7's boolean index on meta
    (chunked_paths)."""
    if stack.loss == "chunked_nll":  # no logits: 1.14's entropy kernel is not called
        from .trl_chunked import chunked_paths

        return chunked_paths()
    if stack.trl not in FUSED_HEAD + ("1.14",):
        return contextlib.nullcontext()
    from .trl import fused_paths, kernel_paths

    return fused_paths() if stack.trl in FUSED_HEAD else kernel_paths()


def kernels_for(tricks: Tricks, attention: str, dropout: str) -> Kernels:
    """The attention and dropout kernels named, on any device; the blocks checkpointed are the trick set's
    (ckpt:N: every Nth from 1, Kernels.checkpointed), each through torch/utils/checkpoint.py's checkpoint."""
    return Kernels(attention, dropout, tricks.recompute, tricks.ckpt_every, tricks.fp8)


def meta_kernels(tricks: Tricks) -> Kernels:
    """What CUDA runs, called by name: see builder.py's docstring."""
    return kernels_for(tricks, "aten-flash" if tricks.flash else "eager", "native")


@dataclass(frozen=True)
class StepBytes:
    """One measured training step (the second); peaks are absolute live bytes on the device."""

    layers: int
    weights_bytes: int  # parameters and buffers after build
    inputs_bytes: int
    state_bytes: int  # live between steps, less the inputs
    saved_bytes: int  # saved for backward in forward, one count per storage (hooks)
    retained_bytes: int  # live after forward less live before it
    grads_bytes: int  # live after the last backward (loss released) less live before forward
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    forward_peak_at: str
    backward_peak_at: str
    optimizer_peak_at: str
    saved_by_op: tuple[tuple[str, int], ...]  # (creating op, dtype, shape) -> bytes
    flops: int | None = None  # FlopCounterMode's count of the first micro-batch's forward and backward (on meta)
    flops_by_op: tuple[tuple[str, int], ...] = ()  # (op, FLOPs), sorted by op

    @property
    def step_peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)


def inputs_for(shape: ModelShape, seq_len: int, micro_batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    if device == "meta":
        idx = torch.empty(micro_batch, seq_len, dtype=torch.long, device=device)
        return idx, torch.empty_like(idx)
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, shape.vocab, (micro_batch, seq_len + 1), generator=g).to(device)
    return idx[:, :-1].clone(), idx[:, 1:].clone()  # two storages (at micro-batch 1 the slices are contiguous)


def measure_step(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, device: str = "meta",
                 kernels: Kernels | None = None, model: torch.nn.Module | None = None, grad_accum: int = 1,
                 timeline: bool = False, stack: Stack = DEFAULT_STACK, optimizer: str = "adamw",
                 make_recipe=None, count_flops: bool = True) -> tuple[StepBytes, LiveBytes]:  # fmt: skip
    """Build (unless a model is given), one warm-up step, then the measured step: grad_accum
    forward-backward passes and the optimizer update, by the stack's recipe (recipes.recipe_for, or
    make_recipe(model, precision): verify/autocast.py's for the stock torch loop). Phases are of its
    last micro-batch; the saved bytes are of its first forward, the FLOPs of its first forward and backward
    (on meta; count_flops=False leaves them uncounted, None: FlopCounterMode is a third of a small step's time)."""
    kernels = kernels or meta_kernels(tricks)
    if model is None:  # the reference model with the kernels asked for, or the stack's
        if stack.model == "reference":
            model = build(shape, kernels, seq_len, DTYPES[tricks.precision])
        else:
            model = build_model(shape, seq_len, tricks, stack, device)
    idx, targets = inputs_for(shape, seq_len, micro_batch, device)
    fixed = fixed_tensors(model)
    live = LiveBytes(torch.device(device).type, timeline=timeline)
    # the parameters too: a wrapper subclass (torchao's NF4Tensor) saved for backward holds nothing of its own
    saved = SavedBytes(fixed + list(model.parameters()) + [idx, targets], live)
    flops = StepFlops() if device == "meta" and count_flops else None  # on real tensors its decompositions would run
    with paths_for(stack, device), live:
        live.track(fixed, "weights")
        weights = live.live_bytes
        live.track([idx, targets], "input")
        inputs = live.live_bytes - weights
        recipe = recipe_for(model, tricks.precision, stack, optimizer) if make_recipe is None else \
            make_recipe(model, tricks.precision)  # fmt: skip
        train_step(recipe, idx, targets, grad_accum)
        before = live.live_bytes
        for k in range(grad_accum):
            with live.over(flops) if k == 0 and flops else contextlib.nullcontext():  # FLOPs: the first fwd + bwd
                live.phase = "forward"
                live.reset_peak()
                model.sac_observer = saved.keep if k == 0 else None  # what per-op selective AC keeps counts too
                with saved.hooks() if k == 0 else contextlib.nullcontext():
                    loss = recipe.forward(idx, targets)
                model.sac_observer = None
                saved.release()
                if k == 0:
                    retained = live.live_bytes - before
                fwd = (live.peak_bytes, live.peak_at)
                live.phase = "backward"
                live.reset_peak()
                recipe.backward(loss)
                del loss
                bwd = (live.peak_bytes, live.peak_at)
        grads = live.live_bytes - before
        live.phase = "optimizer"
        live.reset_peak()
        recipe.update()
        opt = (live.peak_bytes, live.peak_at)
        live.phase = ""
    by_op = tuple(sorted(saved.by_op().items(), key=lambda kv: -kv[1]))
    counted = flops.counted() if flops else (None, ())
    step = StepBytes(shape.n_layers, weights, inputs, before - inputs, saved.total_bytes, retained, grads,
                     fwd[0], bwd[0], opt[0], fwd[1], bwd[1], opt[1], by_op, *counted)  # fmt: skip
    return step, live


def fixed_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What the model holds on its device before the step: parameters, buffers and quantisation state (torchtune's
    NF4 weights by their inner tensors, verify/torchtune.py device_tensors)."""
    if getattr(model, "torchtune", False):
        from .torchtune import device_tensors

        return device_tensors(model)
    trainer = getattr(model, "dpo", None) or getattr(model, "grpo", None)  # its ref_model beside the trained one
    reference = trainer.reference if trainer is not None else None  # (verify/trl_dpo.py, verify/trl_grpo.py)
    held = [] if reference is None else list(reference.parameters()) + list(reference.buffers())
    return list(model.parameters()) + list(model.buffers()) + held_tensors(model) + held


def train_step(recipe: Recipe | TorchRecipe, idx: torch.Tensor, targets: torch.Tensor, grad_accum: int = 1) -> bool:
    """grad_accum forward-backward passes (grads add up in place), then the optimizer update
    (False: fp16's loss scaler skipped it)."""
    for _ in range(grad_accum):
        loss = recipe.forward(idx, targets)
        recipe.backward(loss)
        del loss
    return recipe.update()


def saved_at_depth(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layers: int,
                   stack: Stack = DEFAULT_STACK) -> int:  # fmt: skip
    """Bytes saved for backward by one forward of the model built `layers` deep."""
    model = build_model(replace(shape, n_layers=layers), seq_len, tricks, stack)
    idx, targets = inputs_for(shape, seq_len, micro_batch, "meta")
    forward = model
    if stack.model == "torchtune":  # torchtune's model returns logits: its recipe's _loss_step makes the loss
        from .torchtune import TorchtuneRecipe

        forward = TorchtuneRecipe(model, "adamw", stack).forward
    held = fixed_tensors(model) if stack.model == "torchtune" else []  # NF4 weights' inner tensors
    saved = SavedBytes(list(model.parameters()) + list(model.buffers()) + held + [idx, targets])
    model.sac_observer = saved.keep
    with paths_for(stack), saved.hooks():
        loss = forward(idx, targets)
    saved.release()
    del loss
    return saved.total_bytes


# -- FLOPs ----------------------------------------------------------------------------------------


def flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """QKᵀ and PV as two bmm's over the query heads (GQA key/value heads broadcast); the same count
    torch >= 2.12's own formula gives, which older versions refuse for GQA."""
    b, h, sq, d = query_shape
    sk, dv = key_shape[2], value_shape[3]
    return 2 * b * h * sq * sk * d + 2 * b * h * sq * sk * dv


def flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Five bmm's: QKᵀ recomputed, dP = dO Vᵀ, dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q (FlopCounterMode's)."""
    b, h, sq, d = query_shape
    sk, dv = key_shape[2], value_shape[3]
    return 2 * b * h * (sq * d * sk + sq * dv * sk + sk * sq * dv + sq * sk * d + d * sq * sk)


def addmm_flops(self_shape, mat1_shape, mat2_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's addmm formula (2·m·k·n), for every overload: its own takes addmm.dtype_out's positional out_dtype
    (TRL's fused head accumulates by torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)) for out_shape."""
    m, k = mat1_shape
    return 2 * m * k * mat2_shape[1]


FLASH_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention: flash_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_backward: flash_backward_flops,
    torch.ops.aten.addmm: addmm_flops,
}


class StepFlops(FlopCounterMode):
    """FlopCounterMode with FLASH_FORMULAS and addmm_flops (its conventions: matmuls only, causal masking not
    discounted, recompute counted), every count Global's: its ModuleTracker is left out, whose multi-grad hooks on each
    module's inputs and outputs would hold gradients until a module's last one arrives and tie autograd
    nodes into reference cycles (gc is off under LiveBytes: checkpoint's recomputed tensors would live on),
    so the bytes measured beside it would not be the step's."""

    def __init__(self):
        super().__init__(display=False, custom_mapping=FLASH_FORMULAS)
        assert isinstance(self.mod_tracker, ModuleTracker)  # the attribute this replaces (torch >= 2.4)
        self.mod_tracker = GlobalOnly()

    def counted(self) -> tuple[int, tuple[tuple[str, int], ...]]:
        """The FLOPs counted, and per op (sorted by op)."""
        counts = self.get_flop_counts().get("Global", {})
        return self.get_total_flops(), tuple(sorted((str(k).removeprefix("aten."), v) for k, v in counts.items()))


class GlobalOnly:
    """What FlopCounterMode asks of its module tracker, tracking no module: one parent, Global."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@dataclass(frozen=True)
class MetaMeasurement:
    """Everything measured on meta for one model, setup and trick set."""

    step: StepBytes  # at full depth
    saved_one_layer_bytes: int  # saved at depth 2 less depth 1 (ckpt:N: a layer not checkpointed)
    saved_outside_bytes: int  # saved at depth 1 less one layer: embedding, final norm, logits, loss
    flops: int
    flops_by_op: tuple[tuple[str, int], ...]
    seconds: float
    saved_checkpointed_layer_bytes: int | None = None  # ckpt:N: one checkpointed layer (depth N less N − 1)
    n_checkpointed: int = 0  # ckpt:N: the layers checkpointed at full depth (past first_blocks)
    first_blocks: int = 0  # blocks counted in outside: dense blocks first, then MoE ones (memcalc.exact.growth.Growth)
    plain_depth: int = 1  # saved_one_layer_bytes is the step at this depth + 1 less this depth
    checkpointed_depth: int = 0  # saved_checkpointed_layer_bytes likewise
    timeline: list | None = None  # timeline=True: the full-depth step's events (phase, op, ±bytes, live)

    @property
    def saved_from_depths(self) -> int:
        """What the depths say the full depth saves: outside + each layer's."""
        plain = self.step.layers - self.first_blocks - self.n_checkpointed
        return (self.saved_outside_bytes + plain * self.saved_one_layer_bytes
                + self.n_checkpointed * (self.saved_checkpointed_layer_bytes or 0))  # fmt: skip

    @property
    def linear_in_depth(self) -> bool:
        """The full-depth saved bytes equal outside + L × one layer (ckpt:N: each kind of layer's; with dense
        blocks first, the MoE layers past first_blocks)."""
        return self.step.saved_bytes == self.saved_from_depths


def measure_meta(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, progress=None,
                 stack: Stack = DEFAULT_STACK, optimizer: str = "adamw",
                 timeline: bool = False) -> MetaMeasurement:  # fmt: skip
    """The two passes, trained by the stack's recipe; progress(what) is called before each. timeline: keep
    the full-depth step's every allocation and free (LiveBytes.timeline)."""
    progress = progress or (lambda what: None)
    start = time.perf_counter()
    progress(f"meta: the step at {shape.n_layers} layers")
    step, live = measure_step(shape, seq_len, micro_batch, tricks, timeline=timeline, stack=stack, optimizer=optimizer)
    L, grown = shape.n_layers, growth(tricks, shape, first=stack.finetune.lead_blocks)
    run = as_run(tricks, L)  # ckpt:N over fewer than N blocks checkpoints none: nor do the builds beside it
    n_ckpt = run.n_checkpointed(L) if run.mixed else 0

    def saved(depth: int) -> int:
        return saved_at_depth(shape, seq_len, micro_batch, run, depth, stack)

    first, plain_depth, ckpt_depth = 0, 1, 0
    if grown is None:  # dense and MoE blocks in another pattern: measured whole only
        progress("meta: saved bytes per layer: not linear in depth (blocks of two kinds interleaved)")
        plain, checkpointed, outside, first, n_ckpt = 0, None, step.saved_bytes, L, 0
    elif grown.dense:  # dense blocks first: the step of first_blocks blocks outside, MoE blocks past it (exact's)
        first = grown.first_blocks
        plain_depth, ckpt_depth = layer_blocks(grown, run)
        n_ckpt = run.n_checkpointed(L) - run.n_checkpointed(first) if run.mixed else 0
        depths = sorted({first} | {d + i for d in (plain_depth, ckpt_depth) if d is not None for i in (0, 1)})
        progress(f"meta: saved bytes at depths {', '.join(map(str, depths))}")
        outside = step.saved_bytes if first == L else saved(first)
        plain = saved(plain_depth + 1) - saved(plain_depth) if plain_depth is not None else 0
        checkpointed = saved(ckpt_depth + 1) - saved(ckpt_depth) if ckpt_depth is not None else None
        plain_depth, ckpt_depth = plain_depth or 0, ckpt_depth or 0
    elif n_ckpt:  # ckpt:N: blocks N and N + 1 (from 1) are checkpointed and plain
        n = run.ckpt_every
        progress(f"meta: saved bytes at depths {n - 1}, {n} and {n + 1}")
        before, at, after = (saved(d) for d in (n - 1, n, n + 1))
        plain, checkpointed, outside = after - at, at - before, before - (n - 1) * (after - at)
        plain_depth, ckpt_depth = n, n - 1
    else:
        progress("meta: saved bytes at depths 1 and 2")
        one, two = saved(1), saved(2)
        plain, checkpointed, outside = two - one, None, 2 * one - two
    return MetaMeasurement(step, plain, outside, step.flops, step.flops_by_op, time.perf_counter() - start,
                           checkpointed, n_ckpt, first, plain_depth, ckpt_depth, live.timeline)  # fmt: skip
