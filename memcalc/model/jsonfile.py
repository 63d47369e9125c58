"""Read a small JSON file the user names (a config.json, a calibration) into a dict, with a bounded read.

Every way such a file can be wrong is one InputError line: missing or unreadable, not a regular file
(a named pipe, `/dev/zero`, a folder: refused before a byte is read), larger than MAX_BYTES (never
read whole: a mistyped weights file reads 1 MiB at most), not UTF-8 (a byte-order mark is allowed),
not JSON, nested deeper than the decoder recurses, an integer no float can hold, a float that
overflows to infinity, the NaN and Infinity literals Python's json accepts, or not a JSON object.
Wrong types inside the object are the reader's to refuse (memcalc.model.hfconfig, memcalc.time.calibration).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from memcalc.errors import InputError

MAX_BYTES = 1 << 20  # 1 MiB: a config.json is a few KB, a calibration file about one
MAX_DIGITS = 300  # longer integers are refused, so float() of any integer read stays finite (1e300 < 1.8e308)
BRIEF = 40  # characters of an offending value quoted in an error line


class BadNumber(ValueError):
    """A number in the file that memcalc refuses to hold (raised inside json.loads, reported with the path)."""


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in the file at path; `what` names the file in messages ("config", "calibration")."""
    p = Path(path)
    text = read_text(p, what)
    try:
        data = json.loads(text, parse_int=whole, parse_float=finite, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise InputError(f"{what} {p} is nested too deeply to be a {what} file") from None
    except BadNumber as e:
        raise InputError(f"{what} {p}: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {p} must hold a JSON object, not {json_type(data)}")
    return data


def read_text(p: Path, what: str) -> str:
    """The text of a regular file, reading at most MAX_BYTES + 1 bytes (enough to know it is too large).

    Opened without blocking and checked before any read: open() of a named pipe waits for a writer
    forever, and a device (/dev/zero) or a folder is no file of settings either."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(f"{what} {p} is not a regular file (a folder, pipe or device): give a {what} file")
            raw = read_up_to(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise InputError(f"cannot read {what} {p}: {what} file not found") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {p}: {e.strerror or e.__class__.__name__}") from None
    if len(raw) > MAX_BYTES:
        raise InputError(f"{what} {p} is larger than {MAX_BYTES >> 20} MiB: not a {what} file (one is a few KB)")
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark, as some Windows editors write, is skipped
    except UnicodeDecodeError:
        raise InputError(f"{what} {p} is not UTF-8 text: not a {what} file") from None


def read_up_to(fd: int, n: int) -> bytes:
    """At most n bytes from fd, fewer only at its end (os.read may return less than asked)."""
    chunks, left = [], n
    while left and (chunk := os.read(fd, left)):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def whole(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise BadNumber(f"an integer of {len(digits.lstrip('-')):,} digits is no size memcalc reads")
    return int(digits)


def finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadNumber(f"{brief(text)} overflows to infinity")
    return value


def no_constant(name: str) -> float:
    raise BadNumber(f"{name} is not a number memcalc accepts (JSON has no NaN or Infinity)")


def json_type(value: object) -> str:
    """A decoded JSON value's type as JSON names it: 'an array', 'a string', ..."""
    names = {list: "an array", dict: "an object", str: "a string", bool: "a boolean", int: "a number"}
    return names.get(type(value), "a number" if isinstance(value, float) else "null")


def brief(value: object) -> str:
    """repr(value) cut to BRIEF characters, so that an error about a huge value stays one short line."""
    if isinstance(value, (list, dict)):
        return json_type(value)  # its repr could recurse as deep as the file nests
    text = repr(value)
    return text if len(text) <= BRIEF else text[: BRIEF - 3] + "..."
