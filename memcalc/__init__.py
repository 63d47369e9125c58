"""memcalc: memory and compute of training a transformer, each number with the formula behind it.

The engine is pure functions over frozen dataclasses; it never imports torch (verify/ does that).
Its packages, lowest first; each may import only those before it (tests/test_layering.py holds it):

  records        the decorator memcalc's dataclasses are made with (cheaper to create and to hash)
  errors, terms  the error type for bad input, and a number with the formula it came from
  model          what is trained and on what: shapes, presets, config.json, tricks, GPUs, FLOPs
  exact          bytes and kernels op by op: verify's step replayed under autograd's lifetimes
  memory         bytes by formula: model state, textbook activations, the estimate, the toolbox
  time           seconds: the roofline, calibrations, MFU conventions, training runs, sweeps
  parallel       beyond one GPU: layouts, collectives, the planner, the verdict (what one GPU holds)
  serve          serving: weights at serving precision, the KV cache, vLLM's budget, decode time
  engine         the entry point: a Job in, its Answer out; the toolbox, fit and sweeps around it
  verification   the torch-free side of `memcalc verify`: rows, results, one rank's prediction
  report         result objects formatted and laid out as tables, Markdown, CSV and JSON
  web            `memcalc web`: a local page's server, the commands run as the command line runs them
  cli            the `memcalc` command line

The names below are the public Python API, imported on first use so that `import memcalc` stays cheap:

    from memcalc import Job, Setup, answer, canonical_model, gpu
    result = answer(Job(canonical_model(8_000_000_000), Setup(seq_len=8192), gpu("h100-sxm")))
"""

import importlib

__version__ = "0.1.0"

API = {
    "memcalc.errors": ("InputError",),
    "memcalc.model.shape": ("Model", "ModelShape"),
    "memcalc.model.params": ("n_params", "param_counts"),
    "memcalc.model.presets": ("PRESETS", "canonical_model", "preset_model"),
    "memcalc.model.hfconfig": ("config_model",),
    "memcalc.model.tricks": ("PROGRESSION", "Tricks", "parse_tricks"),
    "memcalc.model.gpus": ("GPU", "GPUS", "find_gpu", "gpu"),
    "memcalc.model.headroom": ("Headroom", "headroom", "usable_bytes"),
    "memcalc.memory.state": ("StateSharding", "model_state", "state_sharding"),
    "memcalc.memory.activations": ("textbook_activations",),
    "memcalc.memory.estimate": ("Estimate", "Setup", "estimate"),
    "memcalc.parallel.verdict": ("Verdict", "gpu_verdict"),
    "memcalc.engine.job": ("Job",),
    "memcalc.engine.answer": ("Answer", "answer"),
    "memcalc.engine.toolbox": ("toolbox",),
    "memcalc.engine.fit": ("fit_limits",),
    "memcalc.exact.step": ("exact_step",),
    "memcalc.exact.timeline": ("Timeline", "step_timeline"),
    "memcalc.exact.kernels": ("step_flops",),
    "memcalc.time.calibration": ("calibration_for",),
    "memcalc.time.roofline": ("Roofline", "roofline", "rooflines"),
    "memcalc.model.layout": ("Layout", "layout_for"),
    "memcalc.parallel.plan": ("layout_estimate", "plan"),
}
WHERE = {name: module for module, names in API.items() for name in names}
__all__ = sorted(WHERE)


def __getattr__(name: str):
    if name not in WHERE:
        raise AttributeError(f"module 'memcalc' has no attribute {name!r}")
    value = getattr(importlib.import_module(WHERE[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
