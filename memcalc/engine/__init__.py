"""The engine's entry point: a Job (what is asked: the model, the step, the GPUs and how they are laid
out, the trick sets, the time model) in, its Answer out (answer); and what searches around one job over
the same verdict (memcalc.parallel.verdict): the OOM toolbox (toolbox), the longest sequence and largest
micro-batch that fit (fit), sweeps of memory and time (sweep), --timeline's replays (timeline), and the rollout
engine beside an online RL trainer with each phase of its step (rollout: vLLM's budget from memcalc.serve).

May import: memcalc.model, exact, memory, time, parallel, serve, errors, terms.
"""
