"""How much room above the tensors' peak PyTorch's caching allocator needs, across one-GPU runs: the least
capacity (in 2 MiB steps) in which memcalc.exact.allocator's replay of the first two steps does not run out,
against the tensors' peak. memcalc.parallel.verdict replays the allocator where a step's peak comes within
REPLAY_BAND of the room; this is the measurement that band rests on.

    python -m benchmarks.allocator_margin            # every preset up to 8B, both stacks, four trick sets
    python -m benchmarks.allocator_margin --quick    # three runs

Its last full output is benchmarks/allocator_margin.md.
"""

from __future__ import annotations

import sys

from memcalc.exact.allocator.replay import replay
from memcalc.exact.base.config import StepConfig
from memcalc.exact.growth import as_run
from memcalc.exact.replay.meta import simulate
from memcalc.exact.reserved import allocator_events
from memcalc.model.presets import PRESETS
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import parse_tricks
from memcalc.parallel.verdict import REPLAY_BAND

MODELS = ("gpt2", "qwen3-0.6b", "llama3.2-1b", "qwen3-1.7b", "llama3.2-3b", "mistral-7b", "llama3-8b")
STACKS = ("reference", "hf")
TRICKS = ("fp32", "bf16", "bf16,flash", "bf16,flash,ckpt")
SHAPES = ((512, 8), (2048, 1), (4096, 2))  # (seq, micro-batch)
QUICK = (("gpt2", "hf", "bf16,flash", 512, 8), ("llama3.2-1b", "reference", "bf16,flash,ckpt", 2048, 1),
         ("qwen3-0.6b", "hf", "bf16", 2048, 1))  # fmt: skip
STEP = 2 << 20


def least_room(events: list, lo: int, hi: int, expandable: bool = False) -> int:
    """The least capacity, in STEP bytes, at which the events run without the allocator running out (lo runs
    out or is the tensors' peak; hi, the reserve with no limit, does not)."""
    lo, hi = lo // STEP, -(-hi // STEP)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if replay(events, mid * STEP, expandable).out_of_memory else (lo, mid)
    return hi * STEP


def margin(model: str, stack: str, tricks: str, seq: int, batch: int) -> tuple[int, float, float, float] | None:
    """The tensors' peak, and above it (fractions of the peak) the least room, the reserve with no limit, and
    the least room with expandable segments."""
    shape = PRESETS[model]
    if shape.max_positions and seq > shape.max_positions:
        return None
    t = parse_tricks(tricks)
    cfg = StepConfig(shape, seq, batch, as_run(t, shape.n_layers), stack_for(stack))
    _, g, mem = simulate(cfg, timeline=True)
    events, _ = allocator_events(mem.timeline, g.recording)
    free = replay(events)
    room = least_room(events, free.requested_bytes, free.reserved_bytes)
    grown = replay(events, None, True)
    grown_room = least_room(events, grown.requested_bytes, grown.reserved_bytes, True)
    peak = free.requested_bytes
    return peak, room / peak - 1, free.reserved_bytes / peak - 1, grown_room / peak - 1


def runs(quick: bool):
    if quick:
        yield from QUICK
        return
    for model in MODELS:
        for stack in STACKS:
            for tricks in TRICKS:
                for seq, batch in SHAPES:
                    yield model, stack, tricks, seq, batch


def main(argv: list[str]) -> None:
    worst = 0.0
    print("| model | stack | tricks | seq x batch | peak GiB | least room | no limit | least room, expandable |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for model, stack, tricks, seq, batch in runs("--quick" in argv):
        m = margin(model, stack, tricks, seq, batch)
        if m is None:
            continue
        peak, room, free, grown = m
        worst = max(worst, room, grown)
        print(
            f"| {model} | {stack} | {tricks} | {seq}x{batch} | {peak / 2**30:.2f} | {room:+.2%} | {free:+.2%} | {grown:+.2%} |"
        )
    print(f"\nlargest least room above the peak: {worst:+.2%} (the verdict replays within {REPLAY_BAND:.0%})")


if __name__ == "__main__":
    main(sys.argv[1:])
