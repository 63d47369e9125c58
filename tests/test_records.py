"""memcalc.records: a record behaves as the dataclass it replaces (equality, hash, repr, fields, replace,
pickling), and a frozen record's hash, kept after its first use, never travels with it."""

import copy
import pickle
from dataclasses import FrozenInstanceError, asdict, dataclass, field, fields, replace

import pytest

from memcalc.memory.state import NOT_SHARDED, model_state
from memcalc.model.presets import preset
from memcalc.model.tricks import Tricks
from memcalc.records import HASH, record


@record(frozen=True)
class Point:
    x: int
    y: str = "a"
    note: str = field(default="", compare=False, repr=False)


@dataclass(frozen=True)
class PointDC:
    x: int
    y: str = "a"
    note: str = field(default="", compare=False, repr=False)


@record(slots=True)
class Cell:
    value: int
    items: list = field(default_factory=list)


def test_equality_and_hash_follow_the_compared_fields():
    assert Point(1, "b", "one") == Point(1, "b", "two")
    assert hash(Point(1, "b", "one")) == hash(Point(1, "b", "two"))
    assert Point(1) != Point(2) and Point(1) != PointDC(1)
    assert len({Point(1), Point(1), Point(2)}) == 2
    assert Cell(1) == Cell(1) and Cell(1) != Cell(2)
    with pytest.raises(TypeError):
        hash(Cell(1))  # a mutable record is unhashable, as a dataclass with eq is


def test_repr_and_fields_as_the_dataclass_has_them():
    assert repr(Point(3, "c", "hidden")) == repr(PointDC(3, "c", "hidden")).replace("PointDC", "Point")
    assert [f.name for f in fields(Point)] == ["x", "y", "note"]
    assert replace(Point(1), y="z") == Point(1, "z") and asdict(Cell(2)) == {"value": 2, "items": []}
    with pytest.raises(FrozenInstanceError):
        Point(1).x = 2


def test_the_kept_hash_does_not_travel():
    shape = preset("llama3-70b")
    kept = hash(shape)
    assert shape.__dict__[HASH] == kept
    for twin in (pickle.loads(pickle.dumps(shape)), copy.copy(shape), copy.deepcopy(shape)):
        assert HASH not in twin.__dict__ and twin == shape and hash(twin) == kept
    assert HASH not in replace(shape, vocab=32000).__dict__


def test_engine_inputs_hash_as_their_fields():
    assert hash(Tricks("bf16", flash=True)) == hash(Tricks("bf16", flash=True))
    assert preset("llama3-70b") == preset("llama3-70b") and preset("llama3-70b") != preset("llama3-8b")


def test_defaults_factories_and_frozen_slots():
    assert Cell(1).items == [] and Cell(1).items is not Cell(1).items  # default_factory: one list each
    assert Cell(1, [2]).items == [2] and Point(1).y == "a"
    state = model_state(8_000_000_000, "bf16", "adamw", NOT_SHARDED)  # frozen, with slots
    assert pickle.loads(pickle.dumps(state)) == state and copy.deepcopy(state) == state
    with pytest.raises(FrozenInstanceError):
        state.params = 1
    with pytest.raises(TypeError, match="non-default field"):

        @record
        class Late:
            a: int = 1
            b: int
