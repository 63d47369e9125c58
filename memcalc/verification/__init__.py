"""The torch-free side of `memcalc verify`: the rows and results it reports (results), and what one
rank of FSDP2 / DTensor tensor parallelism should hold (distributed). verify/ measures and fills them in.

May import: the engine (memcalc.model, memory, exact, time, parallel), memcalc.errors, memcalc.terms.
"""
