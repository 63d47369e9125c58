"""record: a dataclass that costs less to create and, frozen, to hash.

dataclasses.dataclass writes each method of a class as source and compiles it: __init__, __repr__,
__eq__, and for a frozen class __hash__, __setattr__ and __delattr__, each wrapped in a function that
receives its names (some 0.1 ms a method). Creating memcalc's classes was the largest part of its import
and a third of the instructions `memcalc estimate` adds to a bare typer import (valgrind, benchmarks/speed.py).
record lets dataclasses find the fields (fields(), replace() and asdict() work: it is a dataclass) and
compiles one short __init__; every class shares the rest, read through one attrgetter of the fields, as the
dataclass's own would behave: equal when the class and the compared fields are, the repr dataclasses prints,
a frozen class's FrozenInstanceError on assignment. A frozen class's hash is computed on its first use and
kept (shapes, setups and trick sets key the engine's lru_caches, and a 40-field shape was hashed anew at
every lookup), never pickled with it (str hashes differ between processes).
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, FrozenInstanceError, dataclass, fields
from operator import attrgetter
from reprlib import recursive_repr

HASH = "_record_hash"  # where a frozen record keeps its hash, beside its fields in __dict__


def record(cls=None, /, *, frozen: bool = False, slots: bool = False):
    """@record, @record(frozen=True), @record(slots=True): as @dataclass with the same options."""

    def wrap(cls):
        if not cls.__doc__:  # else dataclasses writes one from inspect.signature, a tenth of a millisecond
            cls.__doc__ = f"{cls.__name__}({', '.join(inspect.get_annotations(cls))})"
        made = dataclass(cls, init=False, repr=False, eq=False, slots=slots)  # the fields; no method compiled
        return with_methods(made, frozen)

    return wrap if cls is None else wrap(cls)


def with_methods(cls, frozen: bool):
    """The class given __init__, __eq__, __repr__, __hash__ (and, frozen, the guards) over its fields."""
    every = fields(cls)
    key = fields_of([f.name for f in every if f.compare])
    shown = [f.name for f in every if f.repr]

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return key(self) == key(other)
        return NotImplemented

    @recursive_repr()
    def __repr__(self):
        return f"{self.__class__.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    cls.__init__ = init_of(cls, every, frozen)
    cls.__eq__, cls.__repr__ = __eq__, __repr__
    cls.__hash__ = None if not frozen else hash_of(key) if slots_only(cls) else hash_once(key)
    if frozen:
        cls.__setattr__, cls.__delattr__ = guards(cls, frozenset(f.name for f in every))
        cls.__getstate__, cls.__setstate__ = pickled(cls, [f.name for f in every])
    return cls


def init_of(cls, every, frozen: bool):
    """__init__(self, <the fields in order>): each stored (past the guards when frozen: into __dict__ at
    once, which compiles in half the time of a line a field, or slot by slot), a default_factory called when
    its field is not given, then __post_init__ if the class has one."""
    params, lines, names = [], [], {"_set": object.__setattr__, "_MISSING": MISSING}
    at_once = frozen and not slots_only(cls)
    for f in every:
        if f.default is not MISSING:
            names[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
            value = f.name
        elif f.default_factory is not MISSING:
            names[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            value = f"_factory_{f.name}() if {f.name} is _MISSING else {f.name}"
        else:
            if params and "=" in params[-1]:
                raise TypeError(f"{cls.__name__}: non-default field {f.name!r} follows a default one")
            params.append(f.name)
            value = f.name
        lines.append(f"{f.name!r}: {value}" if at_once else f"_set(self, {f.name!r}, {value})" if frozen
                     else f"self.{f.name} = {value}")  # fmt: skip
    if at_once:
        lines = [f"self.__dict__.update({{{', '.join(lines)}}})"]
    if hasattr(cls, "__post_init__"):
        lines.append("self.__post_init__()")
    source = f"def __init__(self, {', '.join(params)}):\n    " + "\n    ".join(lines or ["pass"])
    exec(source, names)  # noqa: S102  (as dataclasses makes __init__: from the field names, never from input)
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


def guards(cls, names: frozenset):
    """A frozen dataclass's __setattr__ and __delattr__: its fields cannot be assigned nor deleted."""

    def __setattr__(self, name, value):
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self, name):
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    return __setattr__, __delattr__


def pickled(cls, names: list[str]):
    """What pickle and copy keep of a frozen record and how they restore it past the guards: its fields,
    not its hash (another process hashes strings differently)."""
    if slots_only(cls):

        def __getstate__(self):
            return [getattr(self, n) for n in names]

        def __setstate__(self, state):
            for n, value in zip(names, state):
                object.__setattr__(self, n, value)

        return __getstate__, __setstate__

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop(HASH, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    return __getstate__, __setstate__


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
