"""Bytes, by formula: model state (state), the textbook's activations and logits (activations), one
estimate per trick set with its fit verdict (estimate), and the OOM toolbox and fit solver (toolbox).

May import: memcalc.model, memcalc.exact (the FLOPs the kernels execute), memcalc.errors, memcalc.terms.
"""
