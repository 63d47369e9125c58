"""memcalc verify: build the real model in PyTorch, train a few steps, measure, compare.

This package imports torch; memcalc/ never does. The entry points are in verify.run.
"""

import warnings

# torch warns at import when NumPy is absent; verify never needs NumPy, and the warning reads like a fault
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
