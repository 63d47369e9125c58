"""The cyclic garbage collector held off while memcalc makes many short-lived objects that are in no cycle."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
            gc.enable()
