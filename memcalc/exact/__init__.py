"""Bytes and kernels, op by op: a byte-level replay of verify/'s model and training step. aten holds what
each aten op allocates and saves, sim runs them under autograd's lifetimes, mirror follows verify's
builder and recipe line by line, and step turns a simulated step into terms, phases and FLOPs.

May import: memcalc.model, memcalc.errors, memcalc.terms.
"""
