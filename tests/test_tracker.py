"""The proof of the tracker (verify/track.py): on real CPU tensors its figures equal the real ones.

The ground truth is the CPU allocator itself, as torch.profiler records it (profile_memory=True):
every allocation and free with its address, size and the allocator's running total. The tracker
records each storage it sees with its data_ptr. Over a whole training step:
  - every storage the tracker counts is a real allocation of that size at that address, made and
    freed in the same order as the allocator made and freed it;
  - at each of those events the allocator's total since profiling began equals the tracker's live
    bytes since then, plus what is no tensor's storage at that moment (a wrapped Python scalar,
    checkpoint's copy of the CPU RNG state: made outside the dispatcher, never on a GPU);
  - the allocations the tracker does not see are those, and kernels' scratch: all freed by the end.
Hence its live bytes and peak are the allocator's, wherever a tensor is made or freed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from memcalc.model.shape import ModelShape  # noqa: E402
from verify.builder import Kernels, build, materialise  # noqa: E402
from verify.recipes import DTYPES, Recipe  # noqa: E402
from verify.track import LiveBytes, SavedBytes  # noqa: E402

LLAMA = ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                   vocab=200, tied_embeddings=False, positions="rope", qk_norm=True)  # fmt: skip
# No dropout here: CPU's dropout kernels allocate scratch and their mask before their output, which
# the strict order below would flag; dropout's saved bytes are proven on meta (test_verify_meta).
GPT = ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                 max_positions=64)  # fmt: skip


def cpu_model(shape: ModelShape, precision: str, recompute: str = "none"):
    torch.manual_seed(0)
    model = materialise(build(shape, Kernels("eager", "native", recompute), 24, DTYPES[precision]), "cpu")
    idx, targets = torch.randint(0, shape.vocab, (2, 24)), torch.randint(0, shape.vocab, (2, 24))
    recipe = Recipe(model, precision)
    step(recipe, idx, targets)  # warm-up: AdamW's m and v exist from here on
    return model, recipe, idx, targets


def step(recipe: Recipe, idx, targets) -> None:
    loss = recipe.forward(idx, targets)
    recipe.backward(loss)
    del loss
    recipe.update()


def allocator_events(prof) -> list[tuple[int, int, int]]:
    """(±bytes, address, allocator total) of every CPU allocation and free, in time order."""
    out = []

    def walk(e):
        if e.tag == _EventType.Allocation:
            x = e.extra_fields
            out.append((e.start_time_ns, x.alloc_size, x.ptr, x.total_allocated))
        for child in e.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return [(size, ptr, total) for _, size, ptr, total in sorted(out, key=lambda x: x[0])]


@pytest.mark.parametrize("shape,precision,recompute", [(LLAMA, "bf16", "none"), (GPT, "fp32", "full"),
                                                        (GPT, "bf16", "selective"), (LLAMA, "fp16", "full"),
                                                        (LLAMA, "fp32", "selective")])  # fmt: skip
def test_tracker_equals_the_cpu_allocator(shape, precision, recompute):
    model, recipe, idx, targets = cpu_model(shape, precision, recompute)
    live = LiveBytes("cpu", addresses=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with live:
            live.track(list(model.parameters()) + list(model.buffers()) + [idx, targets] + recipe.state_tensors())
            assert live.events is not None
            live.events.clear()
            start = live.live_bytes
            live.reset_peak()
            step(recipe, idx, targets)
    real, seen = allocator_events(prof), live.events
    assert seen, "the tracker saw nothing"
    check_same_events(real, seen, live.live_bytes - start, live.peak_bytes - start)


def check_same_events(real, seen, end_bytes: int, peak_bytes: int) -> None:
    """The tracker's events are the allocator's, in order, once the allocations that are no tensor's
    storage are set aside; at each of them the allocator's total, less those, is the tracker's."""
    matched = untracked = peak_real = peak_tracker = tracker_live = 0  # all since profiling began
    for size, ptr, total in real:
        if matched < len(seen) and seen[matched] == (size, ptr):
            matched += 1
            tracker_live += size
            assert total - untracked == tracker_live, (matched, size)
            peak_real, peak_tracker = max(peak_real, total - untracked), max(peak_tracker, tracker_live)
        else:  # a kernel's scratch, a wrapped Python scalar, checkpoint's CPU RNG state
            untracked += size
    assert matched == len(seen), f"tracker event {seen[matched]} is no real allocation"
    assert untracked == 0  # all freed by the end
    assert tracker_live == end_bytes
    assert peak_tracker == peak_real == peak_bytes


def test_saved_bytes_dedupe_by_storage_equals_by_address():
    """SavedBytes tells storages apart by identity (meta has no addresses); on real tensors that
    equals telling them apart by data_ptr."""
    model, recipe, idx, targets = cpu_model(LLAMA, "bf16")
    fixed = list(model.parameters()) + list(model.buffers()) + [idx, targets]
    saved = SavedBytes(fixed)
    with saved.hooks():
        loss = model(idx, targets)
    saved.release()
    del loss

    excluded = {t.untyped_storage().data_ptr() for t in fixed}
    by_address: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in excluded:
            by_address.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)  # noqa: F841 - holds the graph, and so its saved tensors, while counting
    assert saved.total_bytes == sum(by_address.values()) > 0
    assert len(saved.saved) == len(by_address)
