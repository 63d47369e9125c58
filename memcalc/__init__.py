"""memcalc: memory and compute of training a transformer, each number with the formula behind it.

The engine is pure functions over frozen dataclasses; it never imports torch (see verify/ for that).
"""

__version__ = "0.1.0"
