"""torchao's float8 training on verify/builder.py's model, as torchtitan's float8 converter applies it.

convert_to_float8_training swaps each nn.Linear for torchao's Float8Linear (torchao/float8/float8_linear.py)
with Float8LinearConfig.from_recipe_name(recipe); torchtitan's module_filter_fn
(torchtitan/components/quantization/utils.py @ b5bcd76c66d0acb1a08b176d9639425bc55e0b2a) keeps a linear
in high precision unless both its dimensions divide by 16, and its configs leave the output head out
(filter_fqns = ["output"] / ["lm_head"]). memcalc.exact.aten.float8 replays the same linears.
"""

from __future__ import annotations

import torch

from memcalc.errors import InputError
from memcalc.model.tricks import Tricks, check_measurable

HEAD = "lm_head"  # verify/builder.py's output projection: left in high precision


def convert(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """The model with its linears (bar the head, and any with a dimension not divisible by 16) in float8."""
    if recipe == "te":  # Transformer Engine, not torchao: nothing here can run its te.Linear
        check_measurable(Tricks(fp8=recipe))
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise InputError("fp8 is measured with torchao's float8 training: pip install 'memcalc[fp8]'") from None

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return fqn != HEAD and module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=keep)
