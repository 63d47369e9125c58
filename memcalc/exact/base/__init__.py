"""The bottom of memcalc.exact: the records every room shares and what keeps them.

  config      what decides the bytes of a replayed step (StepConfig), the bytes it comes to (Phases), and what
              the simulator refuses to replay (not_replayed, shape_not_replayed)
  kernel      one kernel of a step (Kernel): what it computes and what it moves through HBM
  cache       replayed results remembered on disk, keyed on the code they depend on
  collection  the cyclic garbage collector held off while the simulator makes many short-lived objects

May import: memcalc.model, memcalc.errors, memcalc.records, memcalc.terms (and memcalc's version).
"""
