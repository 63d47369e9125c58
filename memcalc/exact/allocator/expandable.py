"""PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: one segment per stream and pool, its address space
reserved once and backed by pages as the blocks need them, so that freed blocks merge into one another
instead of stranding slivers at the ends of many segments.

Read from pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp @ 001074d25084fdb87a799823e395a50f5ec044d3:
find_expandable_block (the lowest unmapped range of the stream's segments with room, started at the free
block before it), map_block (whole pages, 2 MiB in the small pool and 20 MiB in the large: "we use 2MiB
pages for our small pool and 20MiB pages for our large pool"), try_allocate_expandable_block, and
unmap_block (release_cached_blocks unmaps the whole pages inside free blocks). A segment's address space is
the card's memory and an eighth more (ExpandableSegment's constructor); memcalc places each segment's base
on a 20 MiB boundary, so a page's place is its address divided by the page. Each function's `a` is the
memcalc.exact.allocator.caching.CachingAllocator whose pool it works on.
"""

from __future__ import annotations

from .blocks import LARGE_BUFFER, SMALL_BUFFER, UNLIMITED, CacheBlock, Pool


def page_of(pool: Pool) -> int:
    """The page an expandable segment of this pool maps at a time."""
    return SMALL_BUFFER if pool.small else LARGE_BUFFER


def allocate_expandable(a, pool: Pool, size: int, stream: int) -> CacheBlock | None:
    """try_allocate_expandable_block: pages mapped from the lowest place with room until a free block of
    `size` stands there; taken out of the pool (None where the driver has no room for a page)."""
    candidate = expandable_candidate(a, pool, size, stream)
    if not candidate.mapped:
        candidate = map_block(a, pool, candidate, min(candidate.size, size))
        if candidate is None:
            return None
    while candidate.size < size:
        after = candidate.next
        mapped = map_block(a, pool, after, min(size - candidate.size, after.size))
        if mapped is None:
            return None
        candidate = mapped
    pool.remove(candidate)
    return candidate


def expandable_candidate(a, pool: Pool, size: int, stream: int) -> CacheBlock:
    """find_expandable_block: the lowest unmapped range of the stream's segments that, with the free block
    before it and what follows, has room for `size`; else a new segment's whole address space."""
    for s, addr in list(pool.unmapped):
        if s != stream:
            continue
        c = pool.unmapped_blocks[(s, addr)]
        if c.prev is not None and not c.prev.allocated:
            c = c.prev
        room, b = 0, c
        while room < size and b is not None and not b.allocated:
            room, b = room + b.size, b.next
        if room >= size:
            return c
    space = UNLIMITED if a.capacity == UNLIMITED else a.capacity + a.capacity // 8
    base = -(-a.next_addr // LARGE_BUFFER) * LARGE_BUFFER
    a.next_addr = base + space
    block = CacheBlock(space, base, stream, pool.small, expandable=True)
    block.mapped = False
    pool.insert(block)
    return block


def map_block(a, pool: Pool, block: CacheBlock, size: int) -> CacheBlock | None:
    """map_block: whole pages from the start of an unmapped block, enough for `size`; the mapped part joins
    its free neighbours (the block it became is returned, in the pool)."""
    page = page_of(pool)
    nbytes = -(-size // page) * page
    if not a.reserve(nbytes):
        return None
    pool.remove(block)
    block.mapped = True
    a.note("segment_map", block, nbytes)
    if nbytes < block.size:
        rest = CacheBlock(block.size - nbytes, block.addr + nbytes, block.stream, block.small, expandable=True)
        rest.mapped = False
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = nbytes
        pool.insert(rest)
    for other in (block.prev, block.next):
        a.merge(pool, block, other)
    pool.insert(block)
    return block


def unmap(a, pool: Pool, block: CacheBlock) -> None:
    """unmap_block: the whole pages inside a free block back to the driver; what is left either side of
    them stays a free block."""
    page = page_of(pool)
    begin = -(-block.addr // page) * page
    end = (block.addr + block.size) // page * page
    if begin >= end:
        return
    pool.remove(block)
    if begin > block.addr:
        before = CacheBlock(begin - block.addr, block.addr, block.stream, block.small, expandable=True)
        before.prev, before.next = block.prev, block
        if block.prev is not None:
            block.prev.next = before
        block.prev = before
        pool.insert(before)
    if end < block.addr + block.size:
        after = CacheBlock(block.addr + block.size - end, end, block.stream, block.small, expandable=True)
        after.prev, after.next = block, block.next
        if block.next is not None:
            block.next.prev = after
        block.next = after
        pool.insert(after)
    block.addr, block.size, block.mapped = begin, end - begin, False
    a.note("segment_unmap", block)
    for other in (block.prev, block.next):
        a.merge(pool, block, other)
    pool.insert(block)
    a.reserved_bytes -= end - begin
