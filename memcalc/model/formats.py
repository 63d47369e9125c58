"""Floating-point formats of training, computed from their bit layout, and exact rounding into them.

Every derived value (bias, largest finite value, spacing next to 1, smallest normal and subnormal)
comes from the number of exponent and mantissa bits, never a typed-in constant:
IEEE 754-2008 sec. 3.3-3.4 for fp32/fp16 (and tf32, fp32's exponent with fp16's mantissa);
bfloat16: Google/Intel "BFLOAT16 - Hardware Numerics Definition" (2018), fp32's top 16 bits;
FP8: Micikevicius et al. 2022 (arXiv 2209.05433), E5M2 IEEE-like, E4M3 "fn" (finite, NaN only).
Pure Python: quantize works on the float64 value with frexp/ldexp, which is exact here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from memcalc.errors import InputError

MAX_TERMS = 1 << 20  # accumulation_demo: at ~2 µs a rounding, about 4 s of pure Python at most


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, exp_bits exponent bits, man_bits stored mantissa bits."""

    name: str
    exp_bits: int
    man_bits: int  # stored fraction bits; precision is man_bits + 1 with the implicit leading 1
    finite_only: bool = False  # "fn" (E4M3): no infinities, all-ones exponent and mantissa is the only NaN

    def __post_init__(self) -> None:
        # At most fp32's widths: then add/mul below round correctly through float64 (Figueroa 1995).
        for label, value, low, high in (("exp_bits", self.exp_bits, 2, 8), ("man_bits", self.man_bits, 1, 23)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InputError(f"{label} must be a whole number in [{low}, {high}], got {value!r}")

    @property
    def bits(self) -> int:
        """Total width, sign included (tf32 is 19 bits of a 32-bit register)."""
        return 1 + self.exp_bits + self.man_bits  # IEEE 754-2008 sec. 3.4: sign, exponent, trailing significand

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1  # IEEE 754-2008 sec. 3.4: bias = emax = 2^(w-1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias  # IEEE 754-2008 sec. 3.3: emin = 1 - emax

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top = (1 << self.exp_bits) - 1  # the all-ones exponent field
        # IEEE keeps all-ones for inf/NaN; E4M3 fn uses it for numbers (Micikevicius et al. 2022, Table 1)
        return top - self.bias if self.finite_only else top - 1 - self.bias

    @property
    def max_value(self) -> float:
        """Largest finite value: 65504 (fp16), 448 (E4M3 fn), 57344 (E5M2)."""
        largest = (1 << (self.man_bits + 1)) - 1  # 1.11...1 as an integer significand
        if self.finite_only:
            largest -= 1  # all-ones mantissa at the top exponent is NaN: 1.11...0 (Micikevicius et al. 2022)
        return math.ldexp(largest, self.emax - self.man_bits)  # IEEE 754-2008 sec. 3.3: (2 - 2^-m) x 2^emax

    @property
    def eps(self) -> float:
        """Spacing between 1 and the next larger value."""
        return math.ldexp(1.0, -self.man_bits)  # IEEE 754-2008 sec. 3.3: b^(1-p), p = man_bits + 1

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)  # IEEE 754-2008 sec. 3.3: b^emin

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.man_bits)  # IEEE 754-2008 sec. 3.3: b^(emin+1-p)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits the significand carries: about 7.2 (fp32), 3.3 (fp16), 2.4 (bf16)."""
        return (self.man_bits + 1) * math.log10(2)  # log10(2^p)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("fp32", 8, 23),  # IEEE 754-2008 binary32
        FloatFormat("tf32", 8, 10),  # NVIDIA TensorFloat-32 (A100 whitepaper 2020): fp32 range, fp16 precision
        FloatFormat("fp16", 5, 10),  # IEEE 754-2008 binary16
        FloatFormat("bf16", 8, 7),  # BFLOAT16 Hardware Numerics Definition (2018)
        FloatFormat("fp8-e4m3", 4, 3, finite_only=True),  # Micikevicius et al. 2022, E4M3 (fn)
        FloatFormat("fp8-e5m2", 5, 2),  # Micikevicius et al. 2022, E5M2 (IEEE-like)
    )
}


def float_format(name: str) -> FloatFormat:
    key = name.strip().lower()
    if key not in FORMATS:
        raise InputError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[key]


def overflow(x: float, fmt: FloatFormat) -> float:
    """What a value too large for fmt becomes: ±inf, or NaN where fmt has no infinities."""
    return math.nan if fmt.finite_only else math.copysign(math.inf, x)  # IEEE 754-2008 sec. 7.4; OCP FP8


def quantize(x: float, fmt: FloatFormat) -> float:
    """x rounded to the nearest value of fmt, ties to even, with subnormals and overflow."""
    x = float(x)
    if math.isnan(x) or (math.isinf(x) and fmt.finite_only):
        return math.nan
    if x == 0.0 or math.isinf(x):
        return x  # keeps the sign of zero and of infinity
    exponent = math.frexp(x)[1] - 1  # |x| = 1.f x 2^exponent
    if exponent > fmt.emax:
        return overflow(x, fmt)
    step = max(exponent, fmt.emin) - fmt.man_bits  # spacing 2^step; subnormals share emin's (IEEE 754 sec. 3.3)
    # ldexp by a power of two is exact; round() on a float ties to even exactly (IEEE 754 sec. 4.3.1)
    value = math.ldexp(round(math.ldexp(abs(x), -step)), step)
    if value > fmt.max_value:
        return overflow(x, fmt)
    return math.copysign(value, x)  # underflow to zero keeps the sign, as IEEE does


def add(a: float, b: float, fmt: FloatFormat) -> float:
    """a + b in fmt, for a and b values of fmt: the exact sum rounded once."""
    # float64 then fmt is innocuous double rounding since 53 >= 2p + 2 (Figueroa 1995, SIGNUM 30(3))
    return quantize(a + b, fmt)


def mul(a: float, b: float, fmt: FloatFormat) -> float:
    """a x b in fmt, for a and b values of fmt: the exact product rounded once."""
    return quantize(a * b, fmt)  # Figueroa 1995, as for add


def rel_error(approx: float, exact: float) -> float:
    return abs(approx - exact) / abs(exact)  # |x̂ - x| / |x|


@dataclass(frozen=True)
class RoundingDemo:
    """1 + small: BF16 has too few mantissa bits to see it, FP32 keeps it."""

    one: float
    small: float  # 1e-4, below half of bf16's spacing next to 1
    bf16_sum: float  # exactly 1.0
    fp32_sum: float  # 1.0001000165...
    bf16_eps: float  # 2^-7: spacing next to 1
    fp32_eps: float  # 2^-23


def rounding_demo() -> RoundingDemo:
    bf16, fp32 = FORMATS["bf16"], FORMATS["fp32"]
    one, small = 1.0, 1e-4
    bf16_sum = add(quantize(one, bf16), quantize(small, bf16), bf16)
    fp32_sum = add(quantize(one, fp32), quantize(small, fp32), fp32)
    return RoundingDemo(one, small, bf16_sum, fp32_sum, bf16.eps, fp32.eps)


@dataclass(frozen=True)
class UnderflowDemo:
    """A tiny gradient: lost in FP16, kept by a loss scale (Micikevicius et al. 2018, sec. 3.2)."""

    grad: float  # the true gradient, 1e-8
    scale: float  # loss scale, 2^16
    fp16_grad: float  # grad stored in fp16: 0.0, below half the smallest subnormal
    fp16_min_subnormal: float  # 2^-24, about 5.96e-8
    fp16_scaled: float  # grad x scale stored in fp16: about 6.55e-4, a normal fp16 number
    fp32_unscaled: float  # fp16_scaled / scale in fp32: about 1e-8 again
    rel_error: float  # of fp32_unscaled against grad: under fp16's 2^-11


def underflow_demo() -> UnderflowDemo:
    fp16, fp32 = FORMATS["fp16"], FORMATS["fp32"]
    grad, scale = 1e-8, 2.0**16  # a power-of-two scale: scaling and unscaling add no rounding
    scaled = quantize(grad * scale, fp16)  # backward of the scaled loss yields scaled gradients
    unscaled = quantize(scaled / scale, fp32)  # the optimizer unscales in the fp32 master copy
    return UnderflowDemo(
        grad, scale, quantize(grad, fp16), fp16.min_subnormal, scaled, unscaled, rel_error(unscaled, grad)
    )


@dataclass(frozen=True)
class AccumulationDemo:
    """A dot product summed term by term in BF16 and in FP32, against the exact sum."""

    n: int
    seed: int
    exact: float  # math.fsum of the products (exact: bf16 x bf16 fits in float64)
    bf16_sum: float  # stagnates: once half the spacing exceeds a term, adding it changes nothing
    fp32_sum: float
    bf16_rel_error: float
    fp32_rel_error: float


def random_terms(n: int, seed: int) -> tuple[list[float], list[float]]:
    """Two vectors of n values in [0, 1) that bf16 holds exactly, so both formats get the same inputs."""
    rng = random.Random(seed)
    values = [quantize(rng.random(), FORMATS["bf16"]) for _ in range(2 * n)]
    return values[:n], values[n:]


def dot(xs: list[float], ys: list[float], fmt: FloatFormat) -> float:
    """sum x*y with each product and each running sum rounded to fmt, in order."""
    total = 0.0
    for x, y in zip(xs, ys, strict=True):
        total = add(total, mul(x, y, fmt), fmt)  # naive sequential accumulation (Higham 2002, sec. 4.2)
    return total


def accumulation_demo(n: int = 4096, seed: int = 0) -> AccumulationDemo:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TERMS:
        raise InputError(f"n must be a whole number in [1, {MAX_TERMS}], got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed must be a whole number, got {seed!r}")
    xs, ys = random_terms(n, seed)
    exact = math.fsum(x * y for x, y in zip(xs, ys))  # 8-bit x 8-bit significands: every product exact
    bf16_sum, fp32_sum = dot(xs, ys, FORMATS["bf16"]), dot(xs, ys, FORMATS["fp32"])
    return AccumulationDemo(
        n, seed, exact, bf16_sum, fp32_sum, rel_error(bf16_sum, exact), rel_error(fp32_sum, exact)
    )
