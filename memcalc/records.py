"""record: a dataclass that costs less to create and, frozen, to hash.

dataclasses.dataclass writes each method of a class as source and compiles it (__init__, __repr__,
__eq__, and for a frozen class __hash__, __setattr__ and __delattr__): some 0.1 ms a method, which made
creating memcalc's classes the largest part of its import (python -X importtime; benchmarks/speed.py).
record lets dataclasses write __init__ (and a frozen class's guards) and gives every class the same
__eq__ and __repr__, which read the fields through one attrgetter, as the dataclass's own would: equal
when the class and the compared fields are; the repr dataclasses prints. A frozen class's hash is
computed on its first use and kept (shapes, setups and trick sets key the engine's lru_caches, and a
40-field shape was hashed anew at every lookup), never pickled with it (str hashes differ between
processes). fields(), replace() and asdict() work as on any dataclass: it is one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from reprlib import recursive_repr

HASH = "_record_hash"  # where a frozen record keeps its hash, beside its fields in __dict__


def record(cls=None, /, *, frozen: bool = False, slots: bool = False):
    """@record, @record(frozen=True), @record(slots=True): as @dataclass with the same options."""

    def wrap(cls):
        return with_methods(dataclass(cls, frozen=frozen, slots=slots, eq=False, repr=False), frozen)

    return wrap if cls is None else wrap(cls)


def with_methods(cls, frozen: bool):
    """The class given the dataclass's __eq__ and __repr__ (and, frozen, __hash__) over its fields."""
    compared = [f.name for f in fields(cls) if f.compare]
    shown = [f.name for f in fields(cls) if f.repr]
    key = fields_of(compared)

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return key(self) == key(other)
        return NotImplemented

    @recursive_repr()
    def __repr__(self):
        return f"{self.__class__.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    cls.__eq__, cls.__repr__ = __eq__, __repr__
    cls.__hash__ = None if not frozen else hash_of(key) if slots_only(cls) else hash_once(key)
    if frozen and not slots_only(cls):
        cls.__getstate__ = state_without_hash
    return cls


def fields_of(names: list[str]):
    """self -> the tuple of those fields (a tuple for one field too, as the dataclass compares them)."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda self: (one(self),)
    return attrgetter(*names) if names else lambda self: ()


def slots_only(cls) -> bool:
    """Whether instances have no __dict__ to keep a hash in (slots=True)."""
    return "__slots__" in cls.__dict__


def hash_of(key):
    def __hash__(self):
        return hash(key(self))

    return __hash__


def hash_once(key):
    def __hash__(self):
        kept = self.__dict__
        h = kept.get(HASH)
        if h is None:
            h = kept[HASH] = hash(key(self))
        return h

    return __hash__


def state_without_hash(self) -> dict:
    """What pickle and copy keep: the fields, not the hash (another process hashes strings differently)."""
    state = dict(self.__dict__)
    state.pop(HASH, None)
    return state
