"""The sizes and counts a user gives, and their limits: MAX_SIZE for layers, heads, widths and vocabularies,
MAX_SEQ for sequences, MAX_BATCH for batches; check_size holds a size to them, and parse_count / parse_seq
read '70B', '1.5M', '8k' from the command line (decimal suffixes for counts, binary ones for sequences).
"""

from __future__ import annotations

import math

from memcalc.errors import InputError
from memcalc.model.jsonfile import MAX_DIGITS, brief

MAX_SIZE = 1 << 24  # no real layer, head count, width or vocabulary comes near 16.7 million
MAX_SEQ = 1 << 27  # 134M tokens: beyond any context trained
MAX_BATCH = 1 << 20
MAX_GPUS = 1 << 20  # GPUs in one job, and in each of its parallel groups


def check_size(name: str, value: int, allow_zero: bool = False, limit: int = MAX_SIZE) -> None:
    """Reject sizes that are not whole numbers in (0, limit]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{name} must be positive, got {value}")
    if value > limit:
        raise InputError(f"{name} = {value} is absurdly large (limit {limit:,})")


DECIMAL = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}  # parameters, tokens, GPUs: 70B, 15T
BINARY = {"k": 1 << 10, "m": 1 << 20}  # sequence lengths: an 8k context is 8,192 tokens, 32K is 32,768
BINARY_BYTES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}  # 22.5GiB


def parse_count(text: str, name: str, limit: float = float(MAX_SIZE), suffixes: dict[str, int] = DECIMAL,
                given: str | None = None) -> int:  # fmt: skip
    """Parse '8e9', '8B', '70b', '1.5M', '8192', '8k' into a positive int, or raise InputError naming what
    the user typed (given: the whole of it, where a caller took a unit off text)."""
    raw = text.strip().replace("_", "").replace(",", "")
    text = text if given is None else given
    scale = 1
    if raw and raw[-1].lower() in suffixes:
        scale, raw = suffixes[raw[-1].lower()], raw[:-1]
    too_large = InputError(f"{name} = {brief(text.strip())} is absurdly large (limit {limit:.3g})")
    if raw.isdigit() and len(raw) > MAX_DIGITS:  # int() refuses 4,300 digits; no float holds 309
        raise too_large
    try:
        value = int(raw) * scale if raw.isdigit() else float(raw) * scale
    except ValueError:
        raise InputError(f"{name} must be a number, got {brief(text)}") from None
    if isinstance(value, float) and not math.isfinite(value):  # an int is never converted to float
        raise InputError(f"{name} must be a finite number, got {brief(text)}")
    if value <= 0:
        raise InputError(f"{name} must be positive, got {brief(text)}")
    if value > limit:  # Python compares an int with a float exactly
        raise too_large
    if value != int(value):
        raise InputError(f"{name} must be a whole number, got {brief(text)}")
    return int(value)


def parse_seq(text: str, name: str = "seq") -> int:
    """A sequence length: '8192', '8k' (8,192), '32K' (32,768), '1m' (1,048,576): binary suffixes."""
    return parse_count(text, name, MAX_SEQ, BINARY)


def parse_bytes(text: str, name: str, limit: float) -> int:
    """A size in bytes as parse_count reads one (24G, 24e9, 2T: decimal), with its unit spelt out too:
    '24GB' (decimal, as datasheets count) or '22.5GiB' (binary)."""
    raw = text.strip()
    if raw.lower().endswith("ib"):
        return parse_count(raw[:-2], name, limit, BINARY_BYTES, given=text)
    if raw.lower().endswith("b") and raw[-2:-1].isalpha():  # '24GB', not '24B' (parse_count's billions)
        raw = raw[:-1]
    return parse_count(raw, name, limit, given=text)


def parse_positive(text: str, name: str, most: float = math.inf) -> float:
    """A finite number in (0, most]: --mfu and --tol are fractions (most 1), times and rates are not."""
    try:
        value = float(text)  # a number past a double's range is inf (refused below), below it 0.0
    except ValueError:
        raise InputError(f"{name} must be a number, got {brief(text)}") from None
    if not (0 < value <= most and math.isfinite(value)):  # also rejects nan
        kind = "a fraction in (0, 1]" if most == 1 else "a positive number"
        raise InputError(f"{name} must be {kind}, got {brief(text)}")
    return value


def parse_fraction(text: str, name: str) -> float:
    return parse_positive(text, name, most=1)
