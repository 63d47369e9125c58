"""PyTorch's CUDA caching allocator, in bytes: the segments it takes from the driver, and how it rounds,
pools, splits, caches and merges the blocks it hands out of them. What a GPU runs out of is these reserved
bytes, not the tensors' own.

Read from pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp @ 001074d25084fdb87a799823e395a50f5ec044d3
(DeviceCachingAllocator): malloc, round_size, get_pool, get_allocation_size, get_free_block, should_split,
alloc_found_block, free_block, try_merge_blocks, release_cached_blocks, and with expandable_segments:True
find_expandable_block, map_block, try_allocate_expandable_block, unmap_block.

Followed as the source has them: sizes rounded up to 512 bytes; requests of 1 MiB or less from the small pool
(2 MiB segments), larger ones from the large pool (a 20 MiB segment for requests under 10 MiB, else the
request rounded up to 2 MiB); the smallest cached block of the stream that fits (best fit, then the lowest
address); a block split where more than 1 MiB would be left (large pool) or 512 bytes (small pool, and every
expandable segment); a freed block merged with its free neighbours; where the driver has no room, every
cached block that is not split released and the request tried again, then out of memory. Expandable
segments: one segment per stream and pool, mapped in 2 MiB (small) or 20 MiB (large) pages at its lowest
free address. Not modelled (each off by default): max_split_size_mb, roundup_power2_divisions,
garbage_collection_threshold, CUDA graphs' private pools; a block used on another stream (record_stream)
is taken to be free when it is freed.
"""

from __future__ import annotations

from bisect import bisect_left

from .blocks import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    UNLIMITED,
    CacheBlock,
    Pool,
    round_size,
)
from .expandable import allocate_expandable, unmap


class OutOfMemory(Exception):
    """The driver has no room for a segment even after every cached block that could be was released."""

    def __init__(self, size: int, reserved: int, allocated: int):
        super().__init__(f"out of memory: {size} bytes asked with {reserved} reserved, {allocated} allocated")
        self.size, self.reserved, self.allocated = size, reserved, allocated


def allocation_size(size: int) -> int:
    """get_allocation_size: the segment a request the pools cannot serve asks the driver for."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class CachingAllocator:
    """One device's allocator. capacity: what the driver can give it (the card less what PyTorch holds
    outside it), None for no limit. reserved_bytes: its segments' (mapped pages'); allocated_bytes: the
    blocks handed out (rounded, as torch.cuda.memory_allocated counts them); each with its peak."""

    def __init__(self, capacity: int | None = None, expandable: bool = False, trace: list | None = None):
        self.trace = trace  # where given, each action as the snapshot's trace entries name it (note)
        self.capacity = UNLIMITED if capacity is None else capacity
        self.expandable = expandable
        self.pools = {True: Pool(True), False: Pool(False)}
        self.reserved_bytes = self.allocated_bytes = 0
        self.peak_reserved_bytes = self.peak_allocated_bytes = 0
        self.reserved_at_allocated_peak = 0  # reserved when the allocated bytes peaked
        self.segments = 0  # cudaMallocs, or expandable segments' page mappings, so far
        self.refusals = 0  # times the driver had no room for a segment (each followed by release_cached)
        self.next_addr = 1 << 32

    def malloc(self, size: int, stream: int = 0) -> CacheBlock:
        """malloc: a cached block if one fits, else a new segment (or pages), else the cache released and
        tried again; the block split where should_split says so."""
        asked, size = size, round_size(size)
        pool = self.pools[size <= SMALL_SIZE]
        block = self.free_block_for(pool, size, stream)
        if block is None:
            block = self.new_block(pool, size, stream)
            if block is None:
                self.release_cached()
                block = self.new_block(pool, size, stream)
            if block is None:
                raise OutOfMemory(size, self.reserved_bytes, self.allocated_bytes)
        else:
            pool.remove(block)
        if self.should_split(block, size):
            block = self.split(pool, block, size)
        block.allocated, block.requested = True, asked  # alloc_found_block: requested_size = orig_size
        self.allocated_bytes += block.size
        self.note("alloc", block, asked)  # alloc_found_block's record_trace(ALLOC, ptr, orig_size)
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes, self.reserved_at_allocated_peak = self.allocated_bytes, self.reserved_bytes
        return block

    def free(self, block: CacheBlock) -> None:
        """free, then free_block: back to its pool, merged with free neighbours (no other stream uses it: the
        free completes at once)."""
        block.allocated = False
        self.allocated_bytes -= block.size
        self.note("free_requested", block, block.requested)  # free's record_trace(FREE_REQUESTED, requested_size)
        self.note("free_completed", block, block.requested)  # free_block's record_trace(FREE_COMPLETED, ...)
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            self.merge(pool, block, other)
        pool.insert(block)

    def free_block_for(self, pool: Pool, size: int, stream: int) -> CacheBlock | None:
        """get_free_block: the first cached block of the stream at least this size (an expandable segment's
        counted with the pages it can still map after it, the smallest of those in a row)."""
        i = bisect_left(pool.keys, (stream, size, -1))
        if i == len(pool.keys) or pool.keys[i][0] != stream:
            return None
        block = pool.blocks[pool.keys[i]]
        while block.expandable and i + 1 < len(pool.keys) and pool.keys[i + 1][0] == stream:
            after = pool.blocks[pool.keys[i + 1]]
            if expandable_size(after) >= expandable_size(block):
                break
            i, block = i + 1, after
        return block

    def should_split(self, block: CacheBlock, size: int) -> bool:
        """should_split: what remains is worth a block of its own."""
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def split(self, pool: Pool, block: CacheBlock, size: int) -> CacheBlock:
        """alloc_found_block's split: a new block of `size` at the front, the rest stays cached."""
        front = CacheBlock(size, block.addr, block.stream, block.small, block.expandable)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.addr += size
        block.size -= size
        pool.insert(block)
        return front

    def merge(self, pool: Pool, dst: CacheBlock, src: CacheBlock | None) -> None:
        """try_merge_blocks: a free neighbour (both mapped, or both not) joins dst."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool.remove(src)
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def new_block(self, pool: Pool, size: int, stream: int) -> CacheBlock | None:
        """alloc_block: a new segment from the driver (None where it has no room)."""
        if self.expandable:
            return allocate_expandable(self, pool, size, stream)
        nbytes = allocation_size(size)
        if not self.reserve(nbytes):
            return None
        block = CacheBlock(nbytes, self.next_addr, stream, pool.small)
        self.next_addr += nbytes
        self.note("segment_alloc", block)
        return block

    def reserve(self, nbytes: int) -> bool:
        """The driver gives nbytes more if the capacity allows."""
        if self.reserved_bytes + nbytes > self.capacity:
            self.refusals += 1
            return False
        self.reserved_bytes += nbytes
        self.segments += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return True

    def note(self, action: str, block: CacheBlock, size: int | None = None) -> None:
        """One action on the trace (torch.cuda.memory._snapshot's device_traces name them so): alloc,
        free_requested, free_completed (their bytes the request's, unrounded), segment_alloc, segment_free,
        segment_map, segment_unmap (the segment's or the pages' bytes); at the block's address."""
        if self.trace is not None:
            self.trace.append((action, block.addr, block.size if size is None else size, block.stream))

    def release_cached(self) -> None:
        """release_cached_blocks: every cached block that is a whole segment back to the driver (an
        expandable segment's free pages unmapped)."""
        for pool in self.pools.values():
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None:
                    continue
                if block.expandable:
                    unmap(self, pool, block)
                elif not block.is_split:
                    pool.remove(block)
                    self.reserved_bytes -= block.size
                    self.note("segment_free", block)


def expandable_size(b: CacheBlock) -> int:
    """A cached block of an expandable segment, with the unmapped space after it that it can grow into."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
