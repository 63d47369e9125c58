"""The one error type for bad input: the CLI turns it into one line and exit code 2; and how such a line names
the several things it refuses."""

from collections.abc import Sequence


class InputError(ValueError):
    """A value the user gave (a size, a name, a file) that memcalc cannot use."""


def subject(names: Sequence[str], one: str, many: str) -> str:
    """The names as a sentence's subject with its verb agreeing: '--a describes', '--a and --b describe',
    '--a, --b and --c describe' (one: the verb after a single name, many: after several)."""
    if len(names) == 1:
        return f"{names[0]} {one}"
    return f"{', '.join(names[:-1])} and {names[-1]} {many}"
