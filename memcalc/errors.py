"""The one error type for bad input: the CLI turns it into one line and exit code 2."""


class InputError(ValueError):
    """A value the user gave (a size, a name, a file) that memcalc cannot use."""
