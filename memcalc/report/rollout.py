"""--rl grpo|rloo: the rollout engine (--vllm) or the policy's own generate, and each phase of a step on one GPU
(memcalc.engine.rollout), as a section."""

from __future__ import annotations

from memcalc.engine.rollout import BATCHED_TOKENS

from . import units as u
from .render import Section, sized

GRAPHS_UNCOUNTED = "not counted (give --cudagraph-memory as its log prints them)"


def rollout_section(rollout, verdicts, units: str, trainer: str = "grpo") -> Section:
    """One row per trick set: the startup check, the rollout and the train phase against their limits; the engine's
    parts and host memory in the notes."""
    if rollout.engine is None:
        return generate_section(rollout, verdicts, units, trainer)
    tricks = [v.tricks.label for v in verdicts]
    e = rollout.engine
    colocated = e.mode == "colocate"
    rows = []
    for label, p in zip(tricks, rollout.phases, strict=True):
        rows.append([label, sized(p.startup_bytes, units), sized(p.rollout_bytes, units), sized(p.train_bytes, units),
                     phase_verdict(p)])  # fmt: skip
    where = (f"colocated in each training process at gpu_memory_utilization {e.utilization:g}" if colocated else
             f"on GPUs of its own (trl vllm-serve, gpu_memory_utilization {e.utilization:g})")  # fmt: skip
    notes = [f"vLLM {where}; {e.release}'s budget (memcalc serve): weights {u.size(e.weights_bytes, units)}, KV cache "
             f"{u.size(e.cache_bytes, units)} ({e.cache_tokens:,} tokens; max_model_len {e.max_model_len:,}, "
             f"max_num_seqs {e.max_num_seqs}), runner {u.size(e.kept_bytes, units)}, CUDA graphs "
             + (u.size(e.graphs_bytes, units) if e.graphs_bytes else GRAPHS_UNCOUNTED)]  # fmt: skip
    if e.failure:
        notes.append(f"vLLM does not start: {e.failure}")
    prompts = u.plural(e.max_num_seqs, "prompt")
    notes.append(f"rollout time per generation: {u.seconds(e.prefill_seconds + e.decode_seconds)} ({prompts} "
                 f"prefilled {u.seconds(e.prefill_seconds)}, then one decode step per "
                 f"completion token over all of them {u.seconds(e.decode_seconds)}, on memcalc serve's roofline), "
                 "besides the steps' time above")  # fmt: skip
    host = max(v.host_bytes for v in verdicts)
    notes.append(f"host memory: the trainer's {u.size(host, units)} (offloaded state and activations) in every phase; "
                 + ("the engine keeps no weights or KV cache there (sleep level 2 copies none off the GPU)"
                    if rollout.sleep else "the engine keeps no weights or KV cache there"))  # fmt: skip
    if colocated:
        notes.append("startup: CUDA context + the trainer's weights + what vLLM asks free (total x utilization), "
                     "against the card's total; rollout: the trainer's state + the engine awake + its forward of "
                     f"{BATCHED_TOKENS:,} tokens; train: the step's peak + the engine "
                     + ("asleep (sleep mode: its runner's tensors and graphs)" if rollout.sleep else "awake")
                     + " (the verdict above)")  # fmt: skip
    else:
        notes.append("the training GPUs hold no engine: startup is the trainer's weights, rollout its state, train "
                     "the step (the verdict above); the engine's own GPUs hold its budget")  # fmt: skip
    headers = ["tricks", "startup", "rollout", "train", "fits?"]
    return Section(f"{trainer.upper()} phases per GPU (vLLM {e.mode})", headers,
                   rows, notes)  # fmt: skip


def generate_section(rollout, verdicts, units: str, trainer: str) -> Section:
    """Without --vllm: the policy's own generate as the rollout phase (memcalc.exact.hf.generate), a row per trick
    set; a trick set it is not replayed for says so."""
    rows, notes = [], []
    for v, p, gen in zip(verdicts, rollout.phases, rollout.generations, strict=True):
        if p is None:
            rows.append([v.tricks.label, "", "not sized", sized(v.total_bytes, units), ""])
            continue
        rows.append([v.tricks.label, sized(p.startup_bytes, units), sized(p.rollout_bytes, units),
                     sized(p.train_bytes, units), phase_verdict(p)])  # fmt: skip
    gen = next((x for x in rollout.generations if x is not None), None)
    if gen is not None:
        rows_of = u.plural(gen.rows, "row")
        notes.append(f"the policy generates itself (use_vllm False: model.generate, no_grad, gradient checkpointing "
                     f"off): {rows_of} of a {gen.prompt_len:,}-token prompt, each to {gen.completion_len:,} new "
                     f"tokens, at once; its DynamicCache ends at {u.size(gen.cache_bytes, units)}, its peak "
                     + ("in the prefill (the prompts' forward)" if gen.peak_at == "prefill" else
                        "in the last decode step (the cache at its longest)"))  # fmt: skip
        notes.append("startup: CUDA context + the weights; rollout: the trainer's state between steps + generate's "
                     "peak (the prompts, the cache, the loop's tensors); train: the step (the verdict above)")
    if rollout.not_sized:
        notes.append(f"not sized: {rollout.not_sized}")
    headers = ["tricks", "startup", "rollout", "train", "fits?"]
    return Section(f"{trainer.upper()} phases per GPU (the policy's own generate)", headers, rows, notes)


def phase_verdict(p) -> str:
    """'yes', or why not: vLLM does not start, or the first phase that does not fit (RolloutPhases.failed)."""
    return "yes" if p.fits else "no: vLLM does not start" if p.failed == "start" else f"no: {p.failed}"


def rollout_clause(rollout, verdicts, tricks, units: str) -> str:
    """Why the phases of the trick set the verdict sentence names do not fit ("" where they do), as
    RolloutPhases.failed says; the train phase is the verdict's own sentence. verdicts: the answer's, one per phase."""
    p = next((x for x, v in zip(rollout.phases, verdicts, strict=True) if v.tricks == tricks), None)
    if p is None or p.failed in ("", "train"):
        return ""
    if rollout.engine is None:  # the policy's own generate
        held, usable = u.size_pair(p.rollout_bytes, p.rollout_limit, units)
        return (f"the rollout (the trainer's state beside the policy's own generate) needs {held}, of the {usable} "
                "usable")
    if p.failed == "start":
        return f"vLLM does not start: {rollout.engine.failure}"
    if p.failed == "startup":
        asked, total = u.size_pair(p.startup_bytes, p.startup_limit, units)
        return f"vLLM refuses to start: the trainer's weights and what it asks free come to {asked}, of the {total}"
    held, usable = u.size_pair(p.rollout_bytes, p.rollout_limit, units)
    return f"the rollout (the trainer's state beside the engine awake) needs {held}, of the {usable} usable"
