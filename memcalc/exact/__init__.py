"""Bytes and kernels, op by op: a byte-level replay of verify/'s model and training step. aten holds what
each aten op allocates and saves, sim runs them under autograd's lifetimes, mirror follows verify's
builder and recipe line by line, step turns a simulated step into terms, phases and FLOPs, and kernels
traces one block's kernels once: the roofline's inventory and the FLOPs a step executes (hardware FLOPs).

May import: memcalc.model, memcalc.errors, memcalc.terms.
"""
