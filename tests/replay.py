"""What the tests that hold memcalc.exact's replay against a measured step (on meta, CPU or CUDA) assert."""

from __future__ import annotations

from memcalc.exact.kernels import merged
from memcalc.model.shape import ModelShape

FIELDS = ("weights_bytes", "inputs_bytes", "state_bytes", "retained_bytes", "grads_bytes", "forward_peak_bytes",
          "backward_peak_bytes", "optimizer_peak_bytes")  # fmt: skip
PEAKS_AT = ("forward_peak_at", "backward_peak_at", "optimizer_peak_at")
# the textbook GPT layer at 8B width (MHA, 4h GELU MLP, biases: its linears are aten.addmm), 36 blocks
GPT_8B = ModelShape(n_layers=36, hidden=4096, n_heads=32, vocab=50257, linear_bias=True, positions="learned",
                    max_positions=8192, dropout=0.1, name="gpt-8b-width")  # fmt: skip


def allocations(timeline, phase: str, state: int) -> list:
    """(op, bytes, live bytes above the state between steps) of each allocation in one phase, in order."""
    return [(op, d, live - state) for p, op, d, live in timeline if p == phase and d > 0]


def assert_same_step(phases, g, mem, step, live, label) -> None:
    """The replay (simulate(..., timeline=True): phases, graph, memory) equals the measured step (its phases
    and live-byte timeline): every phase's bytes, the saved bytes, and every allocation of forward, backward
    and the optimizer step in order with the live bytes at each."""
    for f in FIELDS:
        assert getattr(phases, f) == getattr(step, f), (label, f)
    assert sum(x.nbytes for x in g.saved_terms) == step.saved_bytes, label
    for phase in ("forward", "backward", "optimizer"):
        a, b = allocations(mem.timeline, phase, phases.state_bytes), allocations(live.timeline, phase, step.state_bytes)
        assert a == b, (label, phase)


def assert_same_allocations(mem, first_op: str, live) -> None:
    """A replay's allocations from its first op of `first_op` on (its LiveBytes timeline) equal a measurement's after
    the tensors it registered (verify/track.py LiveBytes, its base set): each size, and the live bytes above each
    one's base at it."""
    start = next(i for i, e in enumerate(mem.timeline) if e[1] == first_op)
    base = mem.timeline[start - 1][3]
    ours = [(size, at - base) for _, _, size, at in mem.timeline[start:] if size > 0]
    theirs = [(size, at - live.base) for _, op, size, at in live.timeline if size > 0 and op != "registered"]
    assert ours == theirs


def assert_equal_at_width(shape, seq_len: int, tricks, stack) -> None:
    """memcalc.exact's step at full width equals the libraries' step on meta: every phase, the saved bytes and
    the FLOPs (verify.meta.measure_step; imported here so that only the tests that call it need torch)."""
    from memcalc.exact.step import exact_step
    from verify.meta import measure_step

    step, _ = measure_step(shape, seq_len, 1, tricks, stack=stack)
    e = exact_step(shape, seq_len, 1, tricks, stack=stack)
    for f in FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f
    assert e.activations.total_bytes == step.saved_bytes and step.flops == e.flops.counted


def assert_watched_meta(shape, tricks: str, stack, batch: int = 1, seq: int = 24) -> None:
    """assert_same_step against the stack's step on meta, the replay as the tracker's dispatch mode sees it (StepConfig
    .watched: memcalc.exact.hf.fused_head says what differs from CUDA)."""
    from dataclasses import replace

    from memcalc.exact.replay.meta import simulate
    from memcalc.model.tricks import parse_tricks
    from tests.test_lora import step_config
    from verify.meta import measure_step

    cfg = replace(step_config(shape, seq, batch, tricks, stack), watched=True)
    phases, g, mem = simulate(cfg, timeline=True)
    step, live = measure_step(shape, seq, batch, parse_tricks(tricks), timeline=True, stack=stack, count_flops=False)
    assert_same_step(phases, g, mem, step, live, tricks)


def assert_watched_cpu(shape, stack, tricks: str) -> None:
    """assert_same_step against the stack's step on real CPU tensors at micro-batch 2 under the Trainer's autocast,
    the replay for device cpu as the tracker sees it (watched)."""
    from dataclasses import replace

    from memcalc.exact.replay.meta import simulate
    from memcalc.model.tricks import parse_tricks
    from tests.test_lora import step_config
    from verify.autocast import measure_cpu

    cfg = replace(step_config(shape, 24, 2, tricks, stack, device="cpu"), watched=True)
    phases, g, mem = simulate(cfg, timeline=True)
    step, live, recipe = measure_cpu(shape, 24, 2, parse_tricks(tricks), 1, True, stack)
    assert recipe.skipped == 0
    assert_same_step(phases, g, mem, step, live, tricks)


def launches(kernels) -> list[tuple]:
    """Each distinct kernel, layer aside, in the order first launched, with how many times it is launched
    (memcalc.exact.kernels.merged): what two blocks, or a trace and its collapsed form, compare by."""
    return [(tuple(row[:-2]), row[-1]) for row in merged(kernels)]


def assert_same_ppo(shape, tricks: str, grad_accum: int, finetune=None, critic=None, chunk: int = 64, line: str = "",
                    seq: int = 12, completion: int = 5) -> None:  # fmt: skip
    """memcalc.exact.hf.ppo's PPO epoch against trl's PPOTrainer.train() itself on CPU tensors (verify/trl_ppo.py:
    two updates of two epochs, micro-batch 2; critic: the value and reward models' shape; chunk:
    local_rollout_forward_batch_size; line: the stack's TRL line, the installed release's): every allocation of the
    first update's second epoch (its optimizer state made), in order, with the live bytes above the epoch's start at
    each, and what the trainer holds at that start (the replay's state; the replay's two (B, T) int64 inputs, which
    PPO's loop does not have, aside); with flash, the same of the second update's rollout."""
    from dataclasses import replace

    from memcalc.exact.base.config import StepConfig
    from memcalc.exact.replay.meta import simulate
    from memcalc.model.finetune import FULL
    from memcalc.model.rl import PPO_LINE, Ppo
    from memcalc.model.stacks import STACKS
    from memcalc.model.tricks import parse_tricks
    from verify.trl_ppo import run_ppo

    finetune = replace(finetune or FULL, lora_dropout=0.0)  # PPOTrainer disables every dropout
    stack = replace(STACKS[f"trl:{line or PPO_LINE}"], rl="ppo", loss="full", use_cache=True, recipe="pure",
                    ppo=Ppo(completion, chunk, epochs=2, critic=critic), finetune=finetune)  # fmt: skip
    cfg = StepConfig(shape, seq, 2, parse_tricks(tricks), stack, "adamw", grad_accum, device="cpu", watched=True)
    phases, _, mem = simulate(cfg, timeline=True)
    run = run_ppo(shape, seq, completion, 2, grad_accum, parse_tricks(tricks), finetune, critic, chunk, updates=2)
    first, last, base = run.region("epoch", 1, "emptied")
    assert phases.state_bytes == base, (tricks, grad_accum, phases.state_bytes, base)
    assert allocated(mem.timeline, "forward") == allocated(run.live.timeline[first:last]), (tricks, grad_accum)
    if cfg.flash:  # the second update's rollout (memcalc.exact.replay.ppo), beside what the first left
        from memcalc.exact.replay.ppo import simulate_rollout

        rollout, mem = simulate_rollout(cfg, timeline=True)
        first, last, base = run.region("rollout", 1, "epoch")
        assert rollout.start_bytes == base, (tricks, grad_accum, rollout.start_bytes, base)
        assert allocated(mem.timeline, "rollout") == allocated(run.live.timeline[first:last]), (tricks, grad_accum)


def allocated(timeline, phase: str | None = None) -> list[tuple[int, int]]:
    """Each allocation from the first of `phase` on (the whole timeline: None), with the live bytes above those
    before it."""
    start = 0 if phase is None else next(i for i, e in enumerate(timeline) if e[0] == phase)
    base = timeline[start - 1][3] if start else timeline[0][3] - timeline[0][2]
    return [(size, live - base) for _, _, size, live in timeline[start:] if size > 0]
