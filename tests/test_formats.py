"""Float formats: spec values, rounding against struct and bit-pattern rules, and the three demos."""

from __future__ import annotations

import ast
import math
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.errors import InputError
from memcalc.model.formats import (
    FORMATS,
    AccumulationDemo,
    FloatFormat,
    accumulation_demo,
    float_format,
    quantize,
    rounding_demo,
    underflow_demo,
)

FP32, TF32, FP16, BF16 = FORMATS["fp32"], FORMATS["tf32"], FORMATS["fp16"], FORMATS["bf16"]
E4M3, E5M2 = FORMATS["fp8-e4m3"], FORMATS["fp8-e5m2"]
FP32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
any_float = st.floats(allow_nan=False)
fp32_float = st.floats(allow_nan=False, width=32)


def same(a: float, b: float) -> bool:
    """Equal as float64 bit patterns (tells -0.0 from 0.0), or both NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


def via_struct(x: float, code: str) -> float:
    """x through C's conversion to half ('e') or single ('f'); overflow raises there, is ±inf here."""
    try:
        return struct.unpack("<" + code, struct.pack("<" + code, x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def fp32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_fp32_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def round_fp32_bits(x: float, man_bits: int) -> float:
    """bf16/tf32 rule: keep the top 1+8+man_bits bits of fp32 x, ties to even (BFLOAT16 spec 2018)."""
    drop = 23 - man_bits
    bits = fp32_bits(x)
    half = (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)  # 0x7FFF + lsb for bf16
    return from_fp32_bits(((bits + half) >> drop) << drop)


def decode(bits: int, fmt: FloatFormat) -> float:
    """Value of a bit pattern, read straight from the spec's layout (an independent check)."""
    sign = -1.0 if bits >> (fmt.exp_bits + fmt.man_bits) else 1.0
    exp = (bits >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    man = bits & ((1 << fmt.man_bits) - 1)
    bias = (1 << (fmt.exp_bits - 1)) - 1
    if exp == (1 << fmt.exp_bits) - 1:
        if not fmt.finite_only:
            return sign * math.inf if man == 0 else math.nan
        if man == (1 << fmt.man_bits) - 1:
            return math.nan
    if exp == 0:
        return sign * math.ldexp(man, 1 - bias - fmt.man_bits)
    return sign * math.ldexp((1 << fmt.man_bits) + man, exp - bias - fmt.man_bits)


# --- spec values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, bits, max_value, eps, min_normal, min_subnormal",
    [
        (FP32, 32, 3.4028234663852886e38, 2.0**-23, 2.0**-126, 2.0**-149),
        (TF32, 19, (2 - 2.0**-10) * 2.0**127, 2.0**-10, 2.0**-126, 2.0**-136),
        (FP16, 16, 65504.0, 2.0**-10, 2.0**-14, 2.0**-24),
        (BF16, 16, 3.3895313892515355e38, 0.0078125, 2.0**-126, 2.0**-133),
        (E4M3, 8, 448.0, 0.125, 2.0**-6, 2.0**-9),
        (E5M2, 8, 57344.0, 0.25, 2.0**-14, 2.0**-16),
    ],
)
def test_spec_values(fmt, bits, max_value, eps, min_normal, min_subnormal):
    assert (fmt.bits, fmt.max_value, fmt.eps) == (bits, max_value, eps)
    assert (fmt.min_normal, fmt.min_subnormal) == (min_normal, min_subnormal)


def test_values_agree_with_other_sources():
    assert FP32.max_value == FP32_MAX
    assert FP16.min_subnormal == pytest.approx(5.96e-8, rel=1e-3)
    assert BF16.max_value == from_fp32_bits(0x7F7F0000)  # fp32 max with the low 16 bits cleared
    assert BF16.min_normal == FP32.min_normal  # same 8-bit exponent
    assert (FP32.bias, FP16.bias, BF16.bias, E4M3.bias, E5M2.bias) == (127, 15, 127, 7, 15)


def test_decimal_digits():
    assert FP32.decimal_digits == pytest.approx(7.22, abs=0.01)
    assert FP16.decimal_digits == pytest.approx(3.31, abs=0.01)
    assert BF16.decimal_digits == pytest.approx(2.41, abs=0.01)


def test_lookup_and_bad_input():
    assert float_format(" BF16 ") is BF16
    with pytest.raises(InputError, match="unknown format"):
        float_format("fp64")
    with pytest.raises(InputError, match="man_bits"):
        FloatFormat("wide", 8, 52)
    with pytest.raises(InputError, match="exp_bits"):
        FloatFormat("bool", True, 3)


# --- every bit pattern of the small formats --------------------------------------------------


@pytest.mark.parametrize("fmt", [FP16, BF16, E4M3, E5M2], ids=lambda f: f.name)
def test_every_pattern_is_kept_and_every_midpoint_ties_to_even(fmt):
    top = 1 << (fmt.bits - 1)  # positive patterns 0 .. top-1; negatives mirror them
    values = [decode(bits, fmt) for bits in range(top)]
    finite = [v for v in values if math.isfinite(v)]
    assert max(finite) == fmt.max_value
    assert min(v for v in finite if v > 0) == fmt.min_subnormal
    for bits, value in enumerate(finite):
        assert same(quantize(value, fmt), value) and same(quantize(-value, fmt), -value)
        upper = finite[bits + 1] if bits + 1 < len(finite) else 2 * value - finite[bits - 1]  # one ulp on
        midpoint = (value + upper) / 2  # exact in float64
        even = value if bits % 2 == 0 else upper
        expected = even if even <= fmt.max_value else (math.nan if fmt.finite_only else math.inf)
        assert same(quantize(midpoint, fmt), expected), (fmt.name, value, midpoint)


def test_decoder_matches_struct_half():
    for bits in range(1 << 16):
        assert same(decode(bits, FP16), struct.unpack("<e", struct.pack("<H", bits))[0])


# --- specials and overflow -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_specials(fmt):
    assert math.isnan(quantize(math.nan, fmt))
    assert same(quantize(0.0, fmt), 0.0) and same(quantize(-0.0, fmt), -0.0)
    assert same(quantize(-fmt.min_subnormal / 4, fmt), -0.0)  # underflow keeps the sign
    overflowed = quantize(fmt.max_value * 2, fmt)
    if fmt.finite_only:
        assert math.isnan(quantize(math.inf, fmt)) and math.isnan(overflowed)
    else:
        assert quantize(-math.inf, fmt) == -math.inf and overflowed == math.inf


def test_fp8_overflow_rules():
    assert quantize(464.0, E4M3) == 448.0  # midpoint 448|480: 448 is the even pattern (0x7E)
    assert math.isnan(quantize(464.1, E4M3))  # nearer the NaN pattern 0x7F than 448
    assert quantize(61439.0, E5M2) == 57344.0
    assert quantize(61440.0, E5M2) == math.inf  # midpoint 57344|65536 ties to the even 65536: inf


# --- against struct and the fp32 bit rule ----------------------------------------------------


@settings(max_examples=600)
@given(any_float)
def test_fp16_matches_struct(x):
    assert same(quantize(x, FP16), via_struct(x, "e"))


@settings(max_examples=600)
@given(any_float)
def test_fp32_matches_struct(x):
    assert same(quantize(x, FP32), via_struct(x, "f"))


@settings(max_examples=300)
@given(st.integers(0, 0x7F7FFFFF))
def test_fp32_midpoints_tie_to_even(bits):
    low, high = from_fp32_bits(bits), from_fp32_bits(bits + 1)  # bits + 1 = 0x7F800000 is inf
    midpoint = (low + high) / 2 if bits < 0x7F7FFFFF else FP32_MAX + 2.0**103  # half an ulp above max
    expected = low if bits % 2 == 0 else high
    assert same(quantize(midpoint, FP32), expected)
    assert same(quantize(midpoint, FP32), via_struct(midpoint, "f"))


@pytest.mark.parametrize("x", [1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-26, 65520.0, 65519.99, 2.0**-24])
def test_fp16_halfway_and_edge_cases(x):
    assert same(quantize(x, FP16), via_struct(x, "e"))
    assert same(quantize(-x, FP16), via_struct(-x, "e"))


@settings(max_examples=600)
@given(fp32_float)
def test_bf16_is_rounded_fp32_bits(x):
    assert same(quantize(x, BF16), round_fp32_bits(x, 7))


@settings(max_examples=300)
@given(fp32_float)
def test_tf32_is_rounded_fp32_bits(x):
    assert same(quantize(x, TF32), round_fp32_bits(x, 10))


# --- properties, every format ----------------------------------------------------------------

format_st = st.sampled_from(list(FORMATS.values()))


@given(format_st, any_float)
def test_idempotent_and_odd(fmt, x):
    once = quantize(x, fmt)
    assert same(quantize(once, fmt), once)
    assert same(quantize(-x, fmt), -once)


@given(format_st, any_float, any_float)
def test_monotonic(fmt, x, y):
    x, y = min(x, y), max(x, y)
    if fmt.finite_only:  # overflow is NaN, which has no order: stay within range
        x, y = (max(-fmt.max_value, min(v, fmt.max_value)) for v in (x, y))
    assert quantize(x, fmt) <= quantize(y, fmt)


@given(format_st, st.floats(0.0, 1.0), st.booleans())
def test_relative_error_bound_in_normal_range(fmt, t, negative):
    magnitude = fmt.min_normal * (fmt.max_value / fmt.min_normal) ** t  # log-uniform over the normal range
    x = max(fmt.min_normal, min(magnitude, fmt.max_value)) * (-1 if negative else 1)
    assert abs(quantize(x, fmt) - x) <= fmt.eps / 2 * abs(x)


@given(format_st, st.floats(0.0, 1.0))
def test_absolute_error_bound_in_subnormal_range(fmt, t):
    x = t * fmt.min_normal
    assert abs(quantize(x, fmt) - x) <= fmt.min_subnormal / 2


# --- the demos -------------------------------------------------------------------------------


def test_rounding_demo():
    demo = rounding_demo()
    assert (demo.one, demo.small) == (1.0, 1e-4)
    assert demo.bf16_sum == 1.0  # 1e-4 < bf16_eps / 2: lost
    assert demo.fp32_sum != 1.0 and abs(demo.fp32_sum - 1.0001) <= demo.fp32_eps
    assert (demo.bf16_eps, demo.fp32_eps) == (2.0**-7, 2.0**-23)
    assert demo.small < demo.bf16_eps / 2 and demo.small > demo.fp32_eps / 2


def test_underflow_demo():
    demo = underflow_demo()
    assert (demo.grad, demo.scale) == (1e-8, 65536.0)
    assert demo.fp16_grad == 0.0 and demo.grad < demo.fp16_min_subnormal / 2
    assert demo.fp16_scaled >= FP16.min_normal  # a normal fp16 number after scaling
    assert demo.fp16_scaled == via_struct(1e-8 * 65536, "e")
    assert demo.fp32_unscaled == pytest.approx(1e-8, rel=FP16.eps / 2)
    assert demo.rel_error == abs(demo.fp32_unscaled - 1e-8) / 1e-8 and 0 < demo.rel_error <= FP16.eps / 2


def test_accumulation_demo():
    demo = accumulation_demo()
    assert (demo.n, demo.seed) == (4096, 0)
    assert demo.exact == pytest.approx(4096 / 4, rel=0.05)  # E[x y] = 1/4 for x, y uniform on [0, 1)
    assert demo.bf16_rel_error > 0.5  # stagnates near 256: half of bf16's spacing there (1) exceeds every term
    assert demo.fp32_rel_error < 1e-5
    assert demo.bf16_rel_error > 1e4 * demo.fp32_rel_error
    assert demo.bf16_sum == quantize(demo.bf16_sum, BF16) and demo.fp32_sum == quantize(demo.fp32_sum, FP32)


def test_accumulation_demo_is_deterministic_and_checks_input():
    assert accumulation_demo(256, 7) == accumulation_demo(256, 7)
    assert isinstance(accumulation_demo(1, 1), AccumulationDemo)
    for bad in (0, -1, 2.5, True, 1 << 30):
        with pytest.raises(InputError, match="n must be"):
            accumulation_demo(bad)
    with pytest.raises(InputError, match="seed"):
        accumulation_demo(16, "x")


def test_formats_imports_only_the_standard_library():
    tree = ast.parse(Path(__file__).parents[1].joinpath("memcalc", "model", "formats.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    modules -= {"memcalc.errors"}  # its own error type, which imports nothing
    assert modules <= {"__future__", "math", "random", "dataclasses"}
