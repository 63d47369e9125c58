"""Bytes, by formula (the textbook): model state (state), the textbook's activations and logits
(activations, moe), and one estimate per trick set (estimate) with what a step trains (setup: Setup, and
one GPU's share of host memory). What the stack
really allocates, the verdict, is memcalc.parallel.verdict's.

May import: memcalc.model, memcalc.exact (the FLOPs the kernels execute), memcalc.errors, memcalc.terms.
"""
