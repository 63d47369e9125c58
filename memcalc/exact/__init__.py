"""Bytes and kernels, op by op: a byte-level replay of verify/'s model and training step. aten holds what
each aten op allocates and saves, sim runs them under autograd's lifetimes; builder and recipes follow
verify's builder.py and recipes.py line by line (optimizers: torch.optim's and bitsandbytes' optimizer
steps; autocast: torch.autocast's lists and cast cache; amp: the stock loop's GradScaler and step, as
verify/autocast.py), config says what a step is, mirror runs the measured step as verify/meta.py does;
step turns it into terms, phases and FLOPs, and kernels traces one block's kernels once: the roofline's
inventory and the FLOPs a step executes (hardware FLOPs).

May import: memcalc.model, memcalc.errors, memcalc.terms.
"""
