"""The cyclic garbage collector held off while memcalc makes many short-lived objects that are in no cycle."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Set by the command line, a process that runs one command and exits: what survives a block is frozen into
# the generation the collector never scans (gc.freeze) before it is switched back on. Left on, the first
# allocations after a plan's search pay a full collection over every cached layout and trace (0.17 s of a
# warm 256-GPU DeepSeek-V3 plan, more than the search's own collections saved); frozen, they live until the
# process ends, as they would anyway. A library caller keeps the collector as it was (False).
FREEZE = False


@contextmanager
def no_collection() -> Iterator[None]:
    """The cyclic garbage collector off inside: what is made there is freed by reference counts (a simulated
    step's storages, as torch's are: none is in a cycle, the replays equal meta's allocation by allocation;
    the planner's layouts and their memory), and a collection would only scan the tens of thousands of
    objects the caches hold (~15% of a simulated step, ~15% of a mixture of experts' plan)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if FREEZE:
                gc.freeze()
            gc.enable()
