"""Every number memcalc prints is formatted here, and only here."""

from __future__ import annotations

from memcalc.errors import InputError

UNITS = {"gb": (1e9, "GB"), "gib": (float(1 << 30), "GiB")}  # decimal GB is what vendors and the lesson use


def check_units(units: str) -> str:
    key = units.strip().lower()
    if key not in UNITS:
        raise InputError(f"unknown units {units!r}; choose gb or gib")
    return key


def size(n: int | float, units: str = "gb", more: int = 0) -> str:
    """427617681408 -> '427.6 GB'; three or four significant digits, and `more` decimals after them."""
    scale, label = UNITS[units]
    x = n / scale
    digits = (1 if abs(x) >= 100 else 2 if abs(x) >= 10 else 3) + more
    return f"{x:,.{digits}f} {label}"


def size_pair(a: int | float, b: int | float, units: str = "gb") -> tuple[str, str]:
    """Two sizes one sentence or row compares (needed and usable): as size() prints them, with as many
    more decimals as it takes to read differently when they differ (150.2 GB against 150.2 GB is
    150.212 GB against 150.210 GB); 12 more reach below a byte at 1 TB."""
    for more in range(13):
        x, y = size(a, units, more), size(b, units, more)
        if x != y or a == b:
            break
    return x, y


def exact_bytes(n: int) -> str:
    return f"{n:,} B"


def count(n: int | float) -> str:
    """48000000000 -> '48.0 G'; for FLOPs and parameters."""
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{n:.0f}"


def params(n: int) -> str:
    """8000000000 -> '8.00B', 124439808 -> '124.4M', 5000 -> '5.0k', 12 -> '12'."""
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "k", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{suffix}"
    return f"{n:,}"


def plural(n: int, word: str) -> str:
    """'1 layer', '36 layers', '1,024 GPUs'."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def seconds(t: float) -> str:
    """0.0123 -> '12.3 ms', 11.17 -> '11.17 s', 2165.9 -> '36.1 min', then hours and days."""
    for scale, unit in ((86400, "days"), (3600, "h"), (60, "min")):
        if t >= scale:
            return f"{t / scale:.1f} {unit}"
    if t >= 1:
        return f"{t:.2f} s"
    return f"{t * 1e3:.1f} ms"


def rate(x: float) -> str:
    """Tokens per second."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def percent(x: float, digits: int = 1) -> str:
    return f"{x * 100:.{digits}f}%"


def signed_percent(x: float) -> str:
    return f"{x * 100:+.1f}%"


def batch(s) -> str:
    """The micro-batch as --micro-batch counts it (s: a Setup or a verify result): '1', or DPO's '1 pair (2
    sequences)'."""
    if s.per_sample == 1:
        return f"{s.micro_batch}"
    return f"{plural(s.micro_batch // s.per_sample, 'pair')} ({s.micro_batch} sequences)"
