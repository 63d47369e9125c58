"""memcalc.exact.allocator against the rules of PyTorch's CUDA caching allocator, each case worked by hand
from pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp @ 001074d25084fdb87a799823e395a50f5ec044d3 (the
function each case follows is named in its docstring)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memcalc.exact.allocator.blocks import round_size
from memcalc.exact.allocator.caching import CachingAllocator, OutOfMemory, allocation_size
from memcalc.exact.allocator.replay import replay

MiB = 1 << 20


def test_round_size():
    """round_size: at least kMinBlockSize (512), in multiples of it."""
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]


def test_allocation_size():
    """get_allocation_size: 2 MiB for the small pool, 20 MiB below kMinLargeAlloc (10 MiB), else 2 MiB steps."""
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(12 * MiB + 512) == 14 * MiB


def test_small_requests_share_a_2_mib_segment():
    """get_pool, get_allocation_size, should_split (small pool: split while 512 bytes remain)."""
    a = CachingAllocator()
    blocks = [a.malloc(1000) for _ in range(8)]
    assert a.reserved_bytes == 2 * MiB and a.allocated_bytes == 8 * 1024
    assert [b.addr - blocks[0].addr for b in blocks] == [k * 1024 for k in range(8)]


def test_a_mid_size_request_takes_a_20_mib_segment_and_the_next_its_remainder():
    """Requests between 1 and 10 MiB allocate and split a 20 MiB block (the comment above kMinBlockSize)."""
    a = CachingAllocator()
    first = a.malloc(6 * MiB)
    second = a.malloc(6 * MiB)
    third = a.malloc(6 * MiB)
    assert a.reserved_bytes == 20 * MiB and a.segments == 1
    assert second.addr == first.addr + 6 * MiB and third.addr == second.addr + 6 * MiB
    fourth = a.malloc(2 * MiB)  # 2 MiB remain: exactly this; what would remain (0) is not split off
    assert a.reserved_bytes == 20 * MiB and fourth.size == 2 * MiB


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    """should_split (large pool): only where more than kSmallSize (1 MiB) would remain; the block handed out
    whole counts as allocated whole (alloc_found_block adds block->size)."""
    a = CachingAllocator()
    a.free(a.malloc(20 * MiB))
    b = a.malloc(19 * MiB + 1)
    assert b.size == 20 * MiB and a.allocated_bytes == 20 * MiB and a.reserved_bytes == 20 * MiB


def test_best_fit_then_lowest_address():
    """get_free_block: the smallest cached block of the stream at least the size (BlockComparatorSize)."""
    a = CachingAllocator()
    big, mid, keep = a.malloc(50 * MiB), a.malloc(30 * MiB), a.malloc(40 * MiB)
    where = mid.addr
    a.free(big)
    a.free(mid)
    got = a.malloc(25 * MiB)  # the 30 MiB block, split: the rest (5 MiB, more than 1 MiB) stays cached
    assert got.addr == where and a.reserved_bytes == 120 * MiB
    assert keep.allocated


def test_freed_neighbours_merge():
    """free_block, try_merge_blocks: a freed block joins its free neighbours in the segment."""
    a = CachingAllocator()
    x, y, z = a.malloc(6 * MiB), a.malloc(6 * MiB), a.malloc(6 * MiB)
    a.free(x)
    a.free(z)  # merges with the 2 MiB left after it
    a.free(y)  # joins both: the whole segment, one free block again
    whole = a.malloc(20 * MiB)
    assert whole.addr == x.addr and whole.size == 20 * MiB and a.segments == 1


def test_a_block_serves_only_its_stream():
    """Blocks are found by (stream, size, address): a block freed on one stream is not reused on another."""
    a = CachingAllocator()
    a.free(a.malloc(30 * MiB, stream=1))
    a.malloc(30 * MiB, stream=0)
    assert a.reserved_bytes == 60 * MiB


def test_the_cache_is_released_and_the_request_retried_before_out_of_memory():
    """malloc: alloc_block fails, release_cached_blocks frees every unsplit cached block, alloc_block again."""
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    b = a.malloc(36 * MiB)
    assert a.reserved_bytes == 36 * MiB and b.size == 36 * MiB


def test_a_split_block_stays_reserved_and_out_of_memory_is_raised():
    """release_cached_blocks frees only blocks that are whole segments: a free part of a segment in use stays."""
    a = CachingAllocator(capacity=40 * MiB)
    keep = a.malloc(6 * MiB)  # a 20 MiB segment, 14 MiB of it cached
    with pytest.raises(OutOfMemory):
        a.malloc(22 * MiB)  # 20 + 22 > 40, and the segment cannot be released
    assert keep.allocated and a.reserved_bytes == 20 * MiB


def test_expandable_segments_grow_one_segment_by_pages():
    """try_allocate_expandable_block, map_block: 20 MiB pages in the large pool, mapped where the free block at
    the end of the segment continues into unmapped space; unmap_block returns whole free pages."""
    a = CachingAllocator(expandable=True)
    x = a.malloc(30 * MiB)
    assert a.reserved_bytes == 40 * MiB
    y = a.malloc(30 * MiB)
    assert a.reserved_bytes == 60 * MiB and y.addr == x.addr + 30 * MiB
    a.free(x)
    a.free(y)
    a.release_cached()
    assert a.reserved_bytes == 0


def test_expandable_segments_split_small_remainders():
    """should_split with expandable segments: any remainder of 512 bytes or more is split off."""
    a = CachingAllocator(expandable=True)
    a.free(a.malloc(20 * MiB))
    b = a.malloc(19 * MiB + 512)
    assert b.size == 19 * MiB + 512


def test_replay_counts_each_storage_once():
    events = [(0, 6 * MiB, 0), (1, 6 * MiB, 0), (0, -6 * MiB, 0), (2, 0, 0), (3, 5 * MiB, 0)]
    r = replay(events)
    assert (r.reserved_bytes, r.allocated_bytes, r.requested_bytes) == (20 * MiB, 12 * MiB, 12 * MiB)
    assert r.out_of_memory == ""


def test_replay_names_where_memory_ran_out():
    r = replay([(0, 30 * MiB, 0), (1, 30 * MiB, 0)], capacity=50 * MiB, names=["mm", "addmm"])
    assert r.out_of_memory.startswith("addmm: 31,457,280 bytes asked")


SIZES = st.lists(st.tuples(st.integers(1, 64 * MiB), st.booleans()), min_size=1, max_size=60)


def planned(plan: list[tuple[int, bool]]) -> list[tuple]:
    """Allocator events from (size, free one) pairs: each size allocated, then, where asked, the middle one of
    those still live freed."""
    events, live = [], []
    for i, (size, free_one) in enumerate(plan):
        events.append((i, size, 0))
        live.append((i, size))
        if free_one and live:
            key, n = live.pop(len(live) // 2)
            events.append((key, -n, 0))
    return events


@given(SIZES, st.booleans())
def test_reserved_covers_allocated_covers_requested(plan, expandable):
    """At every point: reserved >= allocated >= requested, each block's range inside one segment."""
    events = planned(plan)
    r = replay(events, expandable=expandable)
    assert r.reserved_bytes >= r.allocated_bytes >= r.requested_bytes > 0
    assert 0 <= r.idle_bytes <= r.reserved_bytes


def test_the_trace_pairs_every_block_and_segment():
    """The trace (the snapshot's device_traces actions): each event's alloc, or free_requested and
    free_completed, at its block's address with the bytes asked for (not rounded), and the segments taken
    from the driver adding up to what is reserved."""
    trace: list = []
    r = replay([("a", 3 * MiB, 0), ("b", 1000, 0), ("a", -3 * MiB, 0), ("c", 30 * MiB, 0)], trace=trace)
    actions = [t[0] for t in trace]
    assert actions == ["event", "segment_alloc", "alloc", "event", "segment_alloc", "alloc",
                       "event", "free_requested", "free_completed", "event", "segment_alloc", "alloc"]  # fmt: skip
    assert sum(t[2] for t in trace if t[0] == "segment_alloc") == r.reserved_bytes == 52 * MiB
    assert trace[2][1:3] == trace[7][1:3] == trace[8][1:3] == (trace[1][1], 3 * MiB)
    assert trace[5][2] == 1000 and r.allocated_bytes == 30 * MiB + 1024  # b's block holds 1,024 (round_size)


def test_the_trace_maps_and_unmaps_expandable_pages():
    trace: list = []
    replay([("a", 30 * MiB, 0), ("a", -30 * MiB, 0), ("b", 100 * MiB, 0)], capacity=110 * MiB, expandable=True,
           trace=trace)  # fmt: skip
    mapped = sum(t[2] for t in trace if t[0] == "segment_map") - sum(t[2] for t in trace if t[0] == "segment_unmap")
    assert mapped == 100 * MiB


@given(SIZES, st.integers(1, 400))
def test_the_run_at_capacity_first_is_the_run_with_no_limit_where_it_met_none(plan, capacity_mib):
    """memcalc.exact.reserved.within replays at the capacity first (one replay where the driver never refuses a
    segment): the same Reserved as the run with no limit first, to the byte, fitting, released or out of memory."""
    from dataclasses import replace

    from memcalc.exact.reserved import within

    events = planned(plan)
    names, capacity = [f"op{i}" for i in range(len(events))], capacity_mib * MiB
    free = replay(events, None, False, names)  # the order within took before
    if free.reserved_bytes <= capacity:
        expected = replace(free, capacity_bytes=capacity)
    else:
        tight = replay(events, capacity, False, names)
        expected = tight if not tight.out_of_memory else replace(
            free, capacity_bytes=capacity, out_of_memory=tight.out_of_memory, short_bytes=tight.short_bytes)
    assert within(events, names, capacity, False) == expected
