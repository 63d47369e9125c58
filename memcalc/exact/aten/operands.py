"""What every aten op's operands decide, for memcalc.exact.aten's ops: the bytes of a contiguous tensor
(size), the shape of a broadcast (broadcast), the dtype of a result (promote), and what torch.autocast's
wrapper of an op passes on (autocast); and made, a tensor one kernel writes from its operands.
"""

from __future__ import annotations

import math

from ..base.config import ITEMSIZE
from ..sim.graph import Graph
from ..sim.tensors import Tensor


def size(shape, dtype: str) -> int:
    """Bytes of a contiguous tensor of that shape and dtype."""
    return math.prod(shape) * ITEMSIZE[dtype]


def broadcast(a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(y if y > x or (y == x and type(x) is int) else x for x, y in zip(a, b))  # a named size kept


INTEGRAL = ("bool", "uint8", "int8", "int32", "int64", "uint64")  # what a floating operand promotes over


def promote(a: tuple[str, tuple], b: tuple[str, tuple]) -> str:
    """torch.result_type of two (dtype, shape) operands (c10/core/ScalarType.h promoteTypes): a floating one over
    a bool or integer one (a higher category wins, whatever its dims); of two floating, the wider (bf16 with fp16 is
    fp32), a 0-dim tensor giving way to a dimensioned one."""
    (da, sa), (db, sb) = a, b
    if da == db:
        return da
    if (da in INTEGRAL) != (db in INTEGRAL):
        return db if da in INTEGRAL else da
    if not sa and sb:
        return db
    if not sb and sa:
        return da
    return "fp32"


def autocast(g: Graph, op: str, *tensors):
    """op's inputs as torch.autocast's wrapper of op passes them on: unchanged outside an autocast
    region, or when op is on none of its lists (memcalc.exact.aten.cast_policy.Autocast.inputs)."""
    return tensors if g.autocast is None else g.autocast.inputs(g, op, tensors)


def made(g: Graph, shape, op: str, *inputs: Tensor | int, dtype: str = "fp32") -> Tensor:
    """A tensor no gradient flows through, made by one kernel from inputs (tensors, or byte counts): an op's
    output before its node takes it, a backward's gradient, or what the model computes outside autograd."""
    t = g.empty(shape, dtype, op)
    g.kernel(op, inputs, (t,))
    return t
