"""The engine's entry point: a Job (what is asked: the model, the step, the GPUs and how they are laid
out, the trick sets, the time model) in, its Answer out (answer); and what searches around one job over
the same verdict (memcalc.parallel.verdict): the OOM toolbox (toolbox), the longest sequence and largest
micro-batch that fit (fit), sweeps of memory and time (sweep), and --timeline's replays (timeline).

May import: memcalc.model, exact, memory, time, parallel, errors, terms.
"""
