"""The caching allocator's blocks and pools (c10/cuda/CUDACachingAllocator.cpp @
001074d25084fdb87a799823e395a50f5ec044d3: Block, BlockPool, BlockComparatorSize) and its size constants."""

from __future__ import annotations

from bisect import bisect_left, insort

MIN_BLOCK = 512  # kMinBlockSize: every size rounded up to a multiple
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request served from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment (and an expandable small segment's page)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request under MIN_LARGE_ALLOC (an expandable page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests' segments rounded up to this
UNLIMITED = 1 << 62  # the driver's room when no capacity is given


class CacheBlock:
    """A range of one segment: handed out (allocated), or cached in its pool; prev and next are its
    neighbours in the segment. Unmapped blocks are an expandable segment's address space with no pages.
    requested: the bytes asked for when it was last handed out, before rounding (Block.requested_size)."""

    __slots__ = ("addr", "allocated", "expandable", "mapped", "next", "prev", "requested", "size", "small", "stream")

    def __init__(self, size: int, addr: int, stream: int, small: bool, expandable: bool = False):
        self.size, self.addr, self.stream, self.small = size, addr, stream, small
        self.requested = 0  # Block's constructor: requested_size(0)
        self.prev: CacheBlock | None = None
        self.next: CacheBlock | None = None
        self.allocated, self.mapped, self.expandable = False, True, expandable

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)  # BlockComparatorSize: stream, then size, then address


class Pool:
    """A pool's cached blocks, ordered as BlockComparatorSize orders them; and its unmapped address space
    (expandable segments), ordered by address."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], CacheBlock] = {}
        self.unmapped: list[tuple[int, int]] = []  # (stream, address)
        self.unmapped_blocks: dict[tuple[int, int], CacheBlock] = {}

    def insert(self, b: CacheBlock) -> None:
        if b.mapped:
            insort(self.keys, b.key)
            self.blocks[b.key] = b
        else:
            insort(self.unmapped, (b.stream, b.addr))
            self.unmapped_blocks[(b.stream, b.addr)] = b

    def remove(self, b: CacheBlock) -> None:
        if b.mapped:
            key = b.key
            del self.keys[bisect_left(self.keys, key)], self.blocks[key]
        else:
            key = (b.stream, b.addr)
            del self.unmapped[bisect_left(self.unmapped, key)], self.unmapped_blocks[key]


def round_size(size: int) -> int:
    """round_size: at least 512 bytes, in multiples of 512."""
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)
