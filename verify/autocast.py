"""The stock PyTorch loop: fp32 weights trained under torch.autocast, measured on real CPU tensors.

    with torch.autocast(device_type, dtype=torch.bfloat16):   # or float16
        loss = model(idx, targets)
    scaler.scale(loss).backward()                             # fp16 (torch.amp.GradScaler); bf16: loss.backward()
    scaler.step(optimizer)
    scaler.update()

Autocast does nothing on the meta device: its dispatch keys (AutocastCPU, AutocastCUDA) are per
device. So this loop is measured on CPU tensors at reduced size, with LiveBytes watching CPU storages
(tests/test_tracker.py proves its figures are the CPU allocator's), and memcalc.exact is held against
it with CPU's autocast lists (StepConfig(device="cpu")). The CUDA prediction differs from the CPU run
only where the lists and kernels differ: tests/test_stack_autocast.py names and tests each difference.

On CPU, SDPA's flash backend is aten._scaled_dot_product_flash_attention_for_cpu (cpu_kernels): it
takes no dropout and saves no RNG state; aten._scaled_dot_product_flash_attention has no CPU kernel.

The optimizer is verify/recipes.py's per-tensor AdamW as a torch.optim.Optimizer (ReferenceAdamW),
so that GradScaler drives it as it drives torch.optim's; torch.optim's implementations slot in as the
optimizer argument.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from memcalc.exact.base.config import StepConfig
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import Stack, stack_for
from memcalc.model.tricks import Tricks

from .builder import Kernels, build, materialise
from .meta import StepBytes, kernels_for, measure_step, meta_kernels
from .recipes import DTYPES, AdamW, adamw_, bitsandbytes, library_optimizer, trained, trainer_clip
from .track import LiveBytes


REFERENCE_STEP = stack_for("torch", impl="reference")  # the stock loop with the reference AdamW step


class ReferenceAdamW(torch.optim.Optimizer):
    """recipes.Recipe's update on fp32 parameters (no master copy): per tensor, the gradient taken off
    .grad, AdamW with one temporary, the gradient released; m and v made at the first step."""

    def __init__(self, params, hp: AdamW = AdamW()):
        super().__init__(params, {})
        self.hp = hp
        self.steps = 0
        self.m: list[torch.Tensor | None] = [None] * len(self.tensors())
        self.v: list[torch.Tensor | None] = [None] * len(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.steps += 1
        for i, p in enumerate(self.tensors()):
            g, p.grad = p.grad, None
            if self.m[i] is None:
                self.m[i], self.v[i] = torch.zeros_like(p), torch.zeros_like(p)
            adamw_(p, g, self.m[i], self.v[i], self.steps, self.hp)
            del g


class AutocastRecipe:
    """The model (fp32), its forward under torch.autocast, GradScaler for fp16, and the optimizer:
    ReferenceAdamW, or the stack's torch.optim / bitsandbytes optimizer (verify/recipes.py
    library_optimizer) over the fp32 parameters, its gradients set to None after each step."""

    def __init__(self, model: torch.nn.Module, precision: str, device_type: str, optimizer=None, clip: bool = False):
        self.model, self.precision, self.device_type = model, precision, device_type
        self.optimizer = optimizer if optimizer is not None else ReferenceAdamW(trained(model))
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
        self.skipped = 0
        self.clip = clip  # the Trainer's clipping (verify/recipes.py trainer_clip)
        self.grad_norm = None  # the Trainer loop's grad_norm: the last step's total norm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model under torch.autocast; Transformers' (verify/hf.py TrainerModel with autocast) runs
        its own, as Accelerate prepared it."""
        if getattr(self.model, "autocast", None) is not None:
            return self.model(idx, targets)
        with torch.autocast(self.device_type, dtype=DTYPES[self.precision]):
            return self.model(idx, targets)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def update(self) -> bool:
        """clip: the Trainer's clipping (verify/recipes.py trainer_clip; under fp16 after scaler.unscale_, as
        accelerate's clip_grad_norm_ runs it); the optimizer step, then optimizer.zero_grad(set_to_none=True); False
        when GradScaler skipped the step (a gradient was inf or nan)."""
        stepped = True
        if self.clip:
            self.grad_norm = None
            if self.scaler is not None:  # accelerate's clip_grad_norm_: unscale_gradients() first
                self.scaler.unscale_(self.optimizer)
            self.grad_norm = trainer_clip(self.model)
        if self.scaler is None:
            self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # update() backs the scale off after a skipped step
            self.skipped += not stepped
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything kept between steps besides the parameters: the optimizer's state (m and v;
        torch.optim's step counters; AdamW8bit's absmax and quantile maps), the scale and growth tracker."""
        if isinstance(self.optimizer, ReferenceAdamW):
            out = [t for t in self.optimizer.m + self.optimizer.v if t is not None]
        else:
            out = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        if self.scaler is not None and self.scaler._scale is not None:
            out += [self.scaler._scale, self.scaler._growth_tracker]
        return out


def cpu_kernels(tricks: Tricks) -> Kernels:
    """What runs on CPU: stock SDPA held to its flash backend, and aten.native_dropout (bool mask); the
    trick set's blocks checkpointed, ckpt:N's every Nth among them, as on meta (kernels_for)."""
    return kernels_for(tricks, "sdpa-flash" if tricks.flash else "eager", "native")


def measure_cpu(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                timeline: bool = False, stack: Stack = REFERENCE_STEP,
                optimizer: str = "adamw") -> tuple[StepBytes, LiveBytes, AutocastRecipe]:  # fmt: skip
    """verify/meta.py's measured step (a warm-up step, then the measured one) of the fp32 model on
    CPU tensors, trained by the stock loop under torch.autocast("cpu", tricks' 16-bit dtype): the
    stack's model (memcalc's reference, or Transformers' as its Trainer runs it: verify/hf.py) and its
    optimizer (stack.impl: reference, loop, foreach, fused; optimizer: adamw, sgd, adam8bit)."""
    return measure_autocast(shape, seq_len, micro_batch, tricks, grad_accum, timeline, stack, optimizer, "cpu")


def measure_autocast(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, grad_accum: int = 1,
                     timeline: bool = False, stack: Stack = REFERENCE_STEP, optimizer: str = "adamw",
                     device: str = "cpu") -> tuple[StepBytes, LiveBytes, AutocastRecipe]:  # fmt: skip
    """measure_cpu on a device: cpu, or cuda (a GPU's tensors tracked at the dispatcher as on meta,
    with the kernels meta calls by name: the flash op, aten.native_dropout)."""
    if optimizer == "adam8bit":
        bitsandbytes()  # imported before the tracker watches
    kernels = cpu_kernels(tricks) if device == "cpu" else meta_kernels(tricks)
    torch.manual_seed(0)
    if stack.model == "hf":
        from .hf import build_hf

        model = build_hf(shape, tricks, seq_len, device=device, autocast=device, use_cache=stack.use_cache,
                         finetune=stack.finetune, trl=stack.trl, liger=stack.savers.liger is not None,
                         reentrant=stack.reentrant, loss=stack.loss, rl=stack.rl,
                         precompute_ref=stack.precompute_ref, online=stack.online)  # fmt: skip
    else:
        model = materialise(build(shape, kernels, seq_len, torch.float32), device)
    made = []

    def recipe_for(m, precision):
        params = trained(m)
        opt = None if stack.impl == "reference" else library_optimizer(params, optimizer, stack.impl)
        clip = stack.model == "hf" and stack.impl != "reference"  # the Trainer clips; the lesson's loop does not
        made.append(AutocastRecipe(m, precision, device, opt, clip=clip))
        return made[0]

    step, live = measure_step(shape, seq_len, micro_batch, tricks, device, kernels, model, grad_accum, timeline,
                              stack=stack, make_recipe=recipe_for)  # fmt: skip
    return step, live, made[0]


# -- memcalc verify for an autocast stack: real CPU tensors at reduced size ------------------------------

CPU_BUDGET = 2**30  # bytes the reduced step may peak at on the CPU (the replay says, before anything is built)
MAX_CPU_SEQ, MAX_CPU_BATCH, MAX_CPU_VOCAB = 64, 2, 1024


def autocasts(stack: Stack, tricks: Tricks) -> bool:
    """The step runs under torch.autocast: the autocast recipe with a 16-bit trick set (fp32 trains alike
    in every recipe)."""
    return stack.recipe == "autocast" and tricks.precision != "fp32"


@dataclass(frozen=True)
class Reduced:
    """What verify measures on the CPU for a shape and setup it cannot run there at full size."""

    shape: ModelShape
    seq_len: int
    micro_batch: int
    changes: tuple[str, ...]  # what was reduced, e.g. "2 of 36 layers"
    stack: Stack  # the job's, GRPO's completion scaled with the sequence

    @property
    def note(self) -> str:
        return ("measured on real CPU tensors at reduced size (autocast does nothing on the meta device): "
                + (", ".join(self.changes) if self.changes else "nothing reduced"))  # fmt: skip


def reduce(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, stack: Stack, optimizer: str,
           budget: int = CPU_BUDGET) -> Reduced:  # fmt: skip
    """The reduced step: at most 2 layers (ckpt:N: N + 1, one checkpointed and one not; frozen blocks: those
    that run otherwise and one more), seq at most 64,
    micro-batch at most 2, vocabulary at most 1024 (a learned position table as long as the sequence),
    dropout 0 with flash (CPU's flash kernel has none); then heads halved (hidden, KV heads while more
    than one, and the MLP with them; head_dim kept) until the CPU replay's step peak is within budget."""
    from memcalc.exact.replay.meta import simulate

    layers = min(shape.n_layers, max(tricks.ckpt_every + 1 if tricks.mixed else 2, stack.finetune.lead_blocks + 1))
    seq, batch = min(seq_len, MAX_CPU_SEQ), min(micro_batch, MAX_CPU_BATCH)
    online = stack.online  # its completion the same share of the shorter sequence, a prompt of one token at least
    completion = online and max(1, min(seq - 1, online.completion_len * seq // seq_len))
    stack = replace(stack, online=replace(online, completion_len=completion)) if online else stack
    small = replace(shape, n_layers=layers, vocab=min(shape.vocab, MAX_CPU_VOCAB))
    if small.positions == "learned":
        small = replace(small, max_positions=min(small.max_positions, seq))
    if tricks.flash and small.dropout:
        small = replace(small, dropout=0.0)

    def peak(s: ModelShape) -> int:
        cfg = StepConfig(s, seq, batch, tricks, stack, optimizer, device="cpu")
        return simulate(cfg, warm_up=False)[0].step_peak_bytes

    while peak(small) > budget and small.n_heads > 1 and small.hidden % 2 == 0 and small.ffn % 2 == 0:
        kv = small.n_kv_heads // 2 if small.n_kv_heads > 1 else 1
        small = replace(small, hidden=small.hidden // 2, n_heads=small.n_heads // 2, n_kv_heads=kv,
                        ffn=small.ffn // 2, head_dim=small.head_dim)  # fmt: skip
    changes = [f"{new} of {old} {what}" for what, old, new in (
        ("layers", shape.n_layers, small.n_layers), ("tokens per sequence", seq_len, seq),
        ("sequences per micro-batch", micro_batch, batch), ("vocabulary", shape.vocab, small.vocab),
        ("hidden", shape.hidden, small.hidden), ("heads", shape.n_heads, small.n_heads),
        ("KV heads", shape.n_kv_heads, small.n_kv_heads), ("MLP width", shape.ffn, small.ffn),
        ("learned positions", shape.max_positions, small.max_positions),
        ("completion tokens", online and online.completion_len, completion)) if old != new]  # fmt: skip
    if small.dropout != shape.dropout:
        changes.append("dropout 0 (CPU's flash kernel takes none)")
    return Reduced(replace(small, name=shape.name), seq, batch, tuple(changes), stack)


def cpu_cuda_differences(cpu: StepConfig) -> tuple[str, ...]:
    """What the CUDA prediction of the same reduced step adds to the CPU one, term by term: the
    replay with CUDA's lists and kernels less the replay with CPU's (tests/test_stack_autocast.py and
    tests/test_stack_amp.py name and test each: CUDA's fp32 softmax and pow, the flash kernel's RNG
    state, torch.optim's loop and foreach step counters, hosted on the CPU)."""
    from memcalc.exact.replay.meta import simulate

    (on_cpu, g_cpu, _), (on_cuda, g_cuda, _) = simulate(cpu), simulate(replace(cpu, device="cuda"))
    saved: dict[str, int] = {}
    for sign, g in ((1, g_cuda), (-1, g_cpu)):
        for t in g.saved_terms:
            key = f"{t.scope}: {t.op.removesuffix('_for_cpu')} saves {t.what} ({t.dtype})"
            saved[key] = saved.get(key, 0) + sign * t.nbytes * t.copies
    terms = [f"{k} {v:+,} B" for k, v in saved.items() if v]
    state = on_cuda.state_bytes - on_cpu.state_bytes
    if state:
        terms.append(f"state {state:+,} B (torch.optim's step counters live on the host, which on CPU is the device)")
    if not terms:
        return ("the CUDA prediction for this reduced step saves and keeps what the CPU one does",)
    peaks = ", ".join(f"{p} peak {getattr(on_cuda, p + '_peak_bytes') - getattr(on_cpu, p + '_peak_bytes'):+,} B"
                      for p in ("forward", "backward", "optimizer"))  # fmt: skip
    return (f"the CUDA prediction for this reduced step differs from the CPU one by: {'; '.join(terms)} ({peaks})",)


def cpu_rows(shape: ModelShape, setup, tricks: Tricks, tol: float, progress, textbook,
             timeline: bool = False) -> tuple[list, tuple, Reduced, object]:  # fmt: skip
    """verify's rows for an autocast stack: the stock loop measured on CPU tensors at reduced size
    (measure_cpu) beside the exact prediction for that same reduced step on the CPU policy, judged as
    verify judges them; notes say what was reduced and how the CUDA prediction differs. timeline: the
    measured step laid over that replay, allocation by allocation (memcalc.verification.timeline.Overlay),
    else None."""
    from memcalc.exact.replay.meta import simulate
    from memcalc.exact.train.recipes import recipe_note
    from memcalc.exact.timeline import timeline_of
    from memcalc.verification.results import Row
    from memcalc.verification.timeline import Overlay, measured

    red = reduce(shape, setup.seq_len, setup.micro_batch, tricks, setup.stack, setup.optimizer)
    stack, small = red.stack, replace(setup, seq_len=red.seq_len, micro_batch=red.micro_batch, stack=red.stack)
    cfg = StepConfig(red.shape, red.seq_len, red.micro_batch, tricks, stack, setup.optimizer, device="cpu")
    progress(f"cpu: the step at reduced size ({red.shape.n_layers} layers, seq {red.seq_len})")
    ph, g, mem = simulate(cfg, timeline=timeline)
    step, live, recipe = measure_cpu(red.shape, red.seq_len, red.micro_batch, tricks, stack=stack,
                                     optimizer=setup.optimizer, timeline=timeline)  # fmt: skip
    overlay = Overlay(timeline_of(g, mem, tricks, stack.label), measured(live.timeline, "cpu")) if timeline else None
    progress("cpu: the CUDA prediction beside it")
    tb, L = textbook(red.shape, small, tricks), red.shape.n_layers
    at = {p: (getattr(step, p + "_peak_at"), getattr(ph, p + "_peak_at")) for p in ("forward", "backward", "optimizer")}
    rows = [
        Row("weights and buffers", "bytes", tb["weights"], ph.weights_bytes, step.weights_bytes, tol),
        Row("model state between steps (fp32 weights, optimizer state, scaler)", "bytes", tb["state"],
            ph.state_bytes, step.state_bytes, tol),
        Row("gradients after backward", "bytes", tb["grads"], ph.grads_bytes, step.grads_bytes, tol),
        Row(f"saved for backward, all {L} layers", "bytes", tb["saved"], sum(t.nbytes * t.copies for t in g.saved_terms),
            step.saved_bytes, tol),
        Row("kept after forward (saved, checkpoint inputs, loss)", "bytes", None, ph.retained_bytes,
            step.retained_bytes, tol),
    ] + [Row(f"{p} peak", "bytes", None, getattr(ph, p + "_peak_bytes"), getattr(step, p + "_peak_bytes"), tol,
             f"measured at {at[p][0]}; exact at {at[p][1]}") for p in ("forward", "backward", "optimizer")] + [
        Row("whole-step peak", "bytes", tb["peak"], ph.step_peak_bytes, step.step_peak_bytes, tol,
            "textbook: model state + activations + logits"),
    ]  # fmt: skip
    rows += generate_rows(red, cfg, tricks, tol) + scoring_rows(red, cfg, tricks, tol)
    skipped = ("GradScaler skipped the measured step (an inf or nan gradient)",) if recipe.skipped else ()
    notes = (red.note, recipe_note(cfg) + "; the exact column is the replay of this reduced step with CPU's "
             "autocast lists") + cpu_cuda_differences(cfg) + skipped  # fmt: skip
    return rows, notes, red, overlay


def generate_rows(red: Reduced, cfg: StepConfig, tricks: Tricks, tol: float) -> list:
    """--rl grpo|rloo without --vllm: the policy's own model.generate over the reduced micro-batch's rows (verify
    measures one micro-batch per step: steps_per_generation 1), measured (verify/trl_generate.py) beside its replay
    (memcalc.exact.hf.generate); none where there is no such phase or it is not replayed."""
    from memcalc.exact.hf.generate import generation, not_replayed
    from memcalc.report.units import plural
    from memcalc.verification.results import Row

    online = cfg.stack.online
    if online is None or online.vllm or not_replayed(cfg):
        return []
    from .trl_generate import measure_generate

    rows, C = cfg.micro_batch, online.completion_len
    predicted = generation(cfg, rows)
    live = measure_generate(red.shape, tricks, rows, cfg.seq_len - C, C, cfg.stack.finetune,
                            cfg.stack.recipe == "autocast")  # fmt: skip
    return [Row("the policy's own generate: peak above the model (prompts, cache, loop)", "bytes", None,
                predicted.peak_bytes, live.peak_bytes - live.base, tol,
                f"{plural(rows, 'row')} of {cfg.seq_len - C} + {C} tokens; exact: its peak in the "
                f"{predicted.peak_at}")]  # fmt: skip


def scoring_rows(red: Reduced, cfg: StepConfig, tricks: Tricks, tol: float) -> list:
    """--rl grpo|rloo where the trainer scores the generation batch before training (RLOO; GRPO with vLLM or a
    beta): its passes over the reduced micro-batch's rows, measured (verify/trl_scoring.py) beside their replay
    (memcalc.exact.hf.scoring)."""
    from memcalc.exact.hf.scoring import passes, scoring
    from memcalc.verification.results import Row

    if cfg.stack.online is None or not passes(cfg):
        return []
    from .trl_scoring import measure_scoring

    rows = cfg.micro_batch
    predicted = scoring(cfg, rows)
    live = measure_scoring(red.shape, tricks, rows, rows, cfg.seq_len, cfg.stack.online, cfg.stack.rl,
                           cfg.stack.finetune, cfg.stack.recipe == "autocast")  # fmt: skip
    return [Row("the scoring passes before the steps: peak above the model (batch, log-probs, forward)", "bytes",
                None, predicted.peak_bytes, live.peak_bytes - live.base, tol, " then ".join(predicted.passes))]
