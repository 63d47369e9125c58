"""memcalc verify: build the real model in PyTorch, train a few steps, measure, compare.

This package imports torch; memcalc/ never does. The entry points are in verify.run.
"""

import logging
import warnings

# torch warns at import when NumPy is absent; verify never needs NumPy, and the warning reads like a fault
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# torchao (installed for fp8, and imported by Transformers whenever it is present) logs that its CUDA-only
# extensions fail to load on a CPU build, and torch logs a deprecation for each enum torchao registers:
# neither concerns a measurement
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
