"""The torch-free side of `memcalc verify`: the rows and results it reports (results), what one rank of
FSDP2 / DTensor tensor parallelism should hold (distributed; dist_tensors: the parameter tensors and what
a rank holds of them; dist_results: the rows and results of that check), one pipeline stage's
(pipeline), and --timeline's measured step over the predicted one (timeline). verify/ measures and fills them in.

May import: the engine (memcalc.model, memory, exact, time, parallel), memcalc.errors, memcalc.terms.
"""
