"""--rl grpo|rloo: the rollout engine (--vllm) or the policy's own generate, and each phase of a step on one GPU
(memcalc.engine.rollout), as a section; --rl ppo: PPOTrainer's rollout and its PPO epochs."""

from __future__ import annotations

from memcalc.engine.rollout import BATCHED_TOKENS

from . import units as u
from .render import Section, sized

GRAPHS_UNCOUNTED = "not counted (give --cudagraph-memory as its log prints them)"


def rollout_section(rollout, verdicts, units: str, trainer: str = "grpo") -> Section:
    """One row per trick set: the startup check, the rollout and the train phase against their limits; the engine's
    parts and host memory in the notes."""
    if rollout.ppos:
        return ppo_section(rollout, verdicts, units)
    if rollout.engine is None:
        return generate_section(rollout, verdicts, units, trainer)
    tricks = [v.tricks.label for v in verdicts]
    e = rollout.engine
    colocated = e.mode == "colocate"
    scored = any(x is not None for x in rollout.scorings)
    rows = [[label, *phase_cells(p, units, scored)] for label, p in zip(tricks, rollout.phases, strict=True)]
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
    beside = ("the engine " + ("asleep" if rollout.sleep else "awake")) if colocated else ""
    notes += scoring_note(rollout, units, beside)
    return Section(f"{trainer.upper()} phases per GPU (vLLM {e.mode})", headers_for(scored), rows, notes)


def generate_section(rollout, verdicts, units: str, trainer: str) -> Section:
    """Without --vllm: the policy's own generate as the rollout phase (memcalc.exact.hf.generate), a row per trick
    set; a trick set it is not replayed for says so."""
    rows, notes = [], []
    scored = any(x is not None for x in rollout.scorings)
    for v, p in zip(verdicts, rollout.phases, strict=True):
        unsized = ["", "not sized"] + ([""] if scored else []) + [sized(v.total_bytes, units), ""]
        rows.append([v.tricks.label, *(unsized if p is None else phase_cells(p, units, scored))])
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
    notes += scoring_note(rollout, units, "")
    if rollout.not_sized:
        notes.append(f"not sized: {rollout.not_sized}")
    return Section(f"{trainer.upper()} phases per GPU (the policy's own generate)", headers_for(scored), rows, notes)


def ppo_section(rollout, verdicts, units: str) -> Section:
    """--rl ppo: each update's rollout (generate, then score) before its PPO epochs (train), a row per trick set;
    a trick set whose rollout is not replayed says so."""
    rows = []
    for v, p in zip(verdicts, rollout.phases, strict=True):
        unsized = ["", "not sized", "", sized(v.total_bytes, units), ""]
        rows.append([v.tricks.label, *(unsized if p is None else phase_cells(p, units, True))])
    notes = []
    r = next((x for x in rollout.ppos if x is not None), None)
    if r is not None:
        notes += [f"rollout: batch_generation, the policy's generate over the {u.plural(r.rows, 'row')} in chunks of "
                  f"{r.chunk} (no_grad), beside the trainer's state and what the previous update left (its fp32 "
                  "scores among them, until train() rebinds them): the cache, each step's fp32 scores kept "
                  "(output_scores), their stack and the padding over the chunks",
                  "score: the scoring loop over the chunks: the policy's log-probs from the scores, the reference's "
                  "forward to its logits (a chunk's every position, every hidden state kept), the value and reward "
                  "models' backbones, then the masks, the rewards, GAE and the advantages whitened",
                  "startup: CUDA context + the models' weights (the reference's too unless the policy is PEFT's); "
                  "train: a PPO epoch's step (the verdict above)"]  # fmt: skip
        host = max(v.host_bytes for v in verdicts)
        held = f"the trainer's {u.size(host, units)}" if host else "none of the trainer's"
        notes.append(f"host memory: {held} in every phase (PPOTrainer offloads nothing: its models, their state and "
                     "the rollout stay on the GPU)")  # fmt: skip
    if rollout.not_sized:
        notes.append(f"not sized: {rollout.not_sized}")
    return Section("PPO phases per GPU (each update's rollout, then its PPO epochs)", headers_for(True), rows, notes)


def headers_for(scored: bool) -> list[str]:
    return ["tricks", "startup", "rollout"] + (["score"] if scored else []) + ["train", "fits?"]


def phase_cells(p, units: str, scored: bool) -> list[str]:
    """startup, rollout, (score,) train, and whether they fit."""
    score = [sized(p.score_bytes, units) if p.score_bytes else "-"] if scored else []
    return [sized(p.startup_bytes, units), sized(p.rollout_bytes, units), *score, sized(p.train_bytes, units),
            phase_verdict(p)]  # fmt: skip


PASSES = {"old": "the policy's log-probs (old_per_token_logps)", "reference": "the reference's log-probs"}


def scoring_note(rollout, units: str, beside: str) -> list[str]:
    """What the score column holds (memcalc.exact.hf.scoring), where the trainer scores the batch."""
    s = next((x for x in rollout.scorings if x is not None), None)
    if s is None:
        return []
    passes = " then ".join(PASSES[k] for k in s.passes)
    return [f"score: the trainer's state{' + ' + beside if beside else ''} + the scoring passes between generating "
            f"and training, {passes}, over the {u.plural(s.rows, 'row')} in chunks of {s.chunk} (no_grad, "
            f"checkpointing off): {u.size(s.peak_bytes, units)} at their peak with the batch's tensors"]


def phase_verdict(p) -> str:
    """'yes', or why not: vLLM does not start, or the first phase that does not fit (RolloutPhases.failed)."""
    return "yes" if p.fits else "no: vLLM does not start" if p.failed == "start" else f"no: {p.failed}"


def rollout_clause(rollout, verdicts, tricks, units: str) -> str:
    """Why the phases of the trick set the verdict sentence names do not fit ("" where they do), as
    RolloutPhases.failed says; the train phase is the verdict's own sentence. verdicts: the answer's, one per phase."""
    p = next((x for x, v in zip(rollout.phases, verdicts, strict=True) if v.tricks == tricks), None)
    if p is None or p.failed in ("", "train"):
        return ""
    if p.failed == "score":
        held, usable = u.size_pair(p.score_bytes, p.score_limit, units)
        return f"the scoring passes (the trainer's state beside them) need {held}, of the {usable} usable"
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
