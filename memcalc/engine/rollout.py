"""GRPO's rollout engine beside the trainer, and what one GPU holds in each phase of a step (--rl grpo --vllm).

TRL 1.16 makes the engine in GRPOTrainer.__init__ (trl/generation/vllm_generation.py VLLMGeneration, the 1.16.0
wheel): vllm_mode "colocate" builds vLLM's LLM in every training process, on its GPU, with
gpu_memory_utilization = vllm_gpu_memory_utilization, max_model_len = vllm_max_model_length, max_num_seqs =
per_device_train_batch_size x vllm_tensor_parallel_size (1) x steps_per_generation (gradient_accumulation_steps by
default) and max_num_batched_tokens 4096; "server" talks to `trl vllm-serve` on GPUs of its own. vLLM sizes its KV
cache by its own budget (memcalc.serve: total x utilization less weights, the profile run's peak, non-torch memory
and the runner's tensors), so one GPU holds, phase by phase:

  startup  vLLM's check as it starts, after the trainer loaded its weights: free memory (total less the CUDA context
           and the trainer's weights) at least total x utilization (vllm/v1/worker/gpu_worker.py init_device)
  rollout  the trainer's state between steps (weights, optimizer state, the generation batch) and the engine awake:
           its weights, KV cache, runner's tensors and CUDA graphs, and its forward's peak
  train    the step replayed (memcalc.exact.hf.grpo) beside the engine: awake, or with vllm_enable_sleep_mode
           asleep (LLM.sleep(level=2): weights and KV cache released) keeping its runner's tensors and graphs

The train phase is the verdict: the engine's bytes are the GPU's colocated_bytes, kept back with the headroom
(memcalc.model.headroom), so fit, sweep and the toolbox see them too.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from memcalc.errors import InputError
from memcalc.memory.setup import Setup
from memcalc.model.gpus import GPU
from memcalc.model.headroom import CONTEXT_BYTES
from memcalc.model.shape import Model
from memcalc.records import record

if TYPE_CHECKING:  # the replays' records: memcalc.exact is imported where a job asks for it
    from memcalc.exact.hf.generate import Generation
    from memcalc.exact.hf.scoring import Scoring
    from memcalc.exact.replay.ppo import PpoRollout

TRL_VLLM = "0.31"  # trl 1.16.0's extra: vllm>=0.22.0,<=0.31.0; the newest it admits decides the budget's rule
BATCHED_TOKENS = 4096  # VLLMGeneration's LLM(max_num_batched_tokens=4096)


@record(frozen=True)
class RolloutEngine:
    """vLLM on one GPU as GRPOTrainer starts it (bytes are integers)."""

    mode: str  # colocate | server
    utilization: float
    max_model_len: int
    max_num_seqs: int
    release: str  # the span of releases whose budget applies
    requested_bytes: int  # total x gpu_memory_utilization: what vLLM asks free at startup
    weights_bytes: int
    cache_bytes: int  # the KV cache's tensors
    kept_bytes: int  # the model runner's tensors kept from its construction
    graphs_bytes: int  # CUDA graphs as --cudagraph-memory gives them (0: not counted)
    forward_bytes: int  # the profile run's activation peak: what a forward of 4,096 tokens adds while it runs
    cache_tokens: int  # vLLM's "GPU KV cache size: N tokens"
    longest_context: int  # the longest request the cache holds
    shortfall_bytes: int  # by how much weights, forward and the rest exceed the budget (0: a cache is left)
    prefill_seconds: float  # the generation batch's prompts, one after another (memcalc.serve.timing's roofline)
    decode_seconds: float  # the completion's tokens, one decode step each over the whole batch

    @property
    def awake_bytes(self) -> int:
        return self.weights_bytes + self.cache_bytes + self.kept_bytes + self.graphs_bytes

    @property
    def asleep_bytes(self) -> int:
        """LLM.sleep(level=2) releases the weights and the KV cache (CuMemAllocator's pools); the rest stays."""
        return self.kept_bytes + self.graphs_bytes

    @property
    def failure(self) -> str:
        """Why vLLM refuses to start with this budget ("" where it starts)."""
        if self.shortfall_bytes:
            return "no memory is left for the KV cache at this gpu_memory_utilization"
        if self.longest_context < self.max_model_len:
            return (f"its KV cache holds {self.longest_context:,} tokens of one request, less than max_model_len "
                    f"{self.max_model_len:,} (--vllm-max-len)")  # fmt: skip
        return ""


@lru_cache(maxsize=64)  # the CLI sets the GPU's colocated bytes by it, the answer lays out the phases: once
def engine_for(model: Model, gpu: GPU, setup: Setup) -> RolloutEngine | None:
    """The engine --vllm asks for, on one GPU of the kind the trainer's (server: one of its own), gpu without an
    engine beside the step; None without --vllm."""
    from memcalc.serve.answer import serve
    from memcalc.serve.job import ServeJob
    from memcalc.serve.releases import release_line
    from memcalc.time.calibration import calibration_for

    online = setup.stack.online
    if online is None or not online.vllm:
        return None
    seqs = setup.micro_batch * setup.grad_accum  # steps_per_generation's default: the accumulation steps
    length = online.max_model_len or setup.seq_len
    line = release_line(TRL_VLLM)
    try:
        job = ServeJob(model, gpu, length, calibration_for(gpu.key),
                       "bf16" if gpu.bf16_tflops else "fp16", gpu_memory_utilization=online.vllm_util,
                       max_num_batched_tokens=BATCHED_TOKENS, max_num_seqs=seqs, vllm=line,
                       cudagraph_memory=online.graphs_bytes)  # fmt: skip
        answer = serve(job, advise=False)
        prefill, decode = generation_seconds(job, setup.seq_len - online.completion_len, online.completion_len)
    except InputError as e:
        raise InputError(f"--vllm {online.vllm}: {e}") from None
    b, requested = answer.budget.binding, int(job.gpu.cuda_total_bytes * job.utilization)
    return RolloutEngine(online.vllm, job.utilization, length, seqs, answer.release, requested, b.weights,
                         answer.budget.cache_bytes, b.kept, b.cudagraphs, answer.activations.peak,
                         answer.budget.cache_tokens, answer.longest_context, b.shortfall, prefill, decode)  # fmt: skip


def generation_seconds(job, prompt: int, completion: int) -> tuple[float, float]:
    """The rollout's time on memcalc serve's roofline (memcalc.serve.timing): each of the max_num_seqs prompts
    prefilled, then `completion` decode steps over all of them at the mean context (prompt + completion / 2);
    every completion taken to run to max_completion_length."""
    from memcalc.serve.answer import stage_parts
    from memcalc.serve.timing import serve_time

    prompts = replace(job, context=prompt)
    parts = stage_parts(prompts)
    prefill = serve_time(prompts, tuple((p.weights, p.kv) for p in parts), job.seqs).prefill.seconds * job.seqs
    decoding = replace(job, context=prompt + completion // 2)
    parts = stage_parts(decoding)
    step = serve_time(decoding, tuple((p.weights, p.kv) for p in parts), job.seqs).decode.seconds
    return prefill, step * completion


def bare(gpu: GPU) -> GPU:
    """The GPU without an engine kept back beside the step (what vLLM's own budget is taken of)."""
    return replace(gpu, colocated_bytes=0, colocated="")


def with_engine(model: Model, gpu: GPU, setup: Setup) -> GPU:
    """The GPU as the step sees it: a colocated engine's bytes beside the step (asleep under --vllm-sleep) kept
    back with the headroom; the GPU itself otherwise."""
    engine = engine_for(model, bare(gpu), setup)
    if engine is None or engine.mode != "colocate":
        return gpu
    sleep = setup.stack.online.sleep
    what = f"vLLM colocated ({'asleep' if sleep else 'awake'}, gpu_memory_utilization {engine.utilization:g})"
    return replace(gpu, colocated_bytes=engine.asleep_bytes if sleep else engine.awake_bytes, colocated=what)


@record(frozen=True)
class RolloutPhases:
    """One trick set's GPU in each phase of a GRPO or RLOO step (bytes; a limit each is held to)."""

    startup_bytes: int  # CUDA context + the trainer's weights (+ what vLLM requests)
    startup_limit: int  # the card's total (torch.cuda.mem_get_info)
    rollout_bytes: int  # the trainer's state + the engine awake and its forward, or the policy's own generate
    rollout_limit: int  # the card's usable bytes as the verdict counts them, no engine kept back
    train_bytes: int  # the step's peak + the engine beside it: the verdict decides it
    train_limit: int
    starts: bool  # vLLM's budget leaves a KV cache that holds a request of max_model_len (RolloutEngine.failure)
    score_bytes: int = 0  # the trainer's state + the engine beside it + the scoring passes (0: the trainer runs none)
    score_limit: int = 0

    @property
    def failed(self) -> str:
        """What stops it, in the order it happens: "start" (vLLM has no room for its cache), "startup", "rollout",
        "score", "train"; "" where every phase fits."""
        if not self.starts:
            return "start"
        over = ((name, used > limit) for name, used, limit in (
            ("startup", self.startup_bytes, self.startup_limit), ("rollout", self.rollout_bytes, self.rollout_limit),
            ("score", self.score_bytes, self.score_limit), ("train", self.train_bytes, self.train_limit)))  # fmt: skip
        return next((name for name, is_over in over if is_over), "")

    @property
    def fits(self) -> bool:
        return not self.failed

    def margin(self) -> int:
        """The most bytes the rollout or the scoring passes are over their limit (negative: under)."""
        rollout = self.rollout_bytes - self.rollout_limit
        return max(rollout, self.score_bytes - self.score_limit) if self.score_bytes else rollout


@record(frozen=True)
class Rollout:
    """The engine and, for each trick set's verdict, the phases on one training GPU (colocate); server mode's
    engine runs on GPUs of its own, so its phases are the step alone. Without --vllm the policy generates itself:
    no engine, and each trick set's generate (memcalc.exact.hf.generate; None and no phases where it is not
    replayed, not_sized says why). scorings: each trick set's scoring passes (memcalc.exact.hf.scoring), None where
    the trainer runs none."""

    engine: RolloutEngine | None
    sleep: bool
    phases: tuple[RolloutPhases | None, ...]
    generations: tuple[Generation | None, ...] = ()
    not_sized: str = ""
    scorings: tuple[Scoring | None, ...] = ()
    ppos: tuple[PpoRollout | None, ...] = ()  # --rl ppo: each trick set's rollout (memcalc.exact.replay.ppo)


def rollout(model: Model, gpu: GPU, setup: Setup, verdicts: tuple) -> Rollout:
    """The rollout's answer for an --rl grpo|rloo|ppo job: gpu is the job's (its colocated bytes set by
    with_engine)."""
    if setup.stack.ppo is not None:
        each = [ppo_phases(model, gpu, setup, v) for v in verdicts]
        why = next((x for _, x in each if isinstance(x, str)), "")
        return Rollout(None, False, tuple(p for p, _ in each), not_sized=why,
                       ppos=tuple(None if isinstance(x, str) else x for _, x in each))  # fmt: skip
    engine = engine_for(model, bare(gpu), setup)
    each = [phases_for(model, gpu, setup, v, engine) for v in verdicts]
    phases, scorings = tuple(p for p, _, _ in each), tuple(s for _, _, s in each)
    if engine is not None:
        return Rollout(engine, setup.stack.online.sleep, phases, scorings=scorings)
    why = next((x for _, x, _ in each if isinstance(x, str)), "")
    generations = tuple(None if isinstance(x, str) else x for _, x, _ in each)
    return Rollout(None, False, phases, generations, why, scorings)


def phases_for(model: Model, gpu: GPU, setup: Setup, verdict, engine: RolloutEngine | None) -> tuple:
    """One verdict's (phases, the policy's own generate or why it is not replayed, the scoring passes): no phases
    where generate is not replayed; no generate where an engine generates. Under --rl ppo its rollout's phases."""
    if setup.stack.ppo is not None:
        return ppo_phases(model, gpu, setup, verdict)[0], None, None
    scoring = own_scoring(model, setup, verdict)
    if engine is not None:
        return phases_of(engine, bare(gpu), verdict, setup.stack.online.sleep, scoring), None, scoring
    generation = own_generation(model, setup, verdict.tricks)
    if isinstance(generation, str):
        return None, generation, scoring
    return generate_phases(gpu, verdict, generation, scoring), generation, scoring


def ppo_phases(model: Model, gpu: GPU, setup: Setup, verdict) -> tuple[RolloutPhases | None, PpoRollout | str]:
    """--rl ppo: startup, the rollout's generate and score and the PPO epochs on one GPU: the weights as it starts,
    the peaks of PPOTrainer's batch_generation and of its scoring loop (memcalc.exact.replay.ppo: each beside the
    trainer's state and what the previous update left), the step; or why the rollout is not replayed."""
    from memcalc.exact.hf.generate import not_replayed
    from memcalc.exact.replay.ppo import rollout_peaks

    cfg = step_config(model, setup, verdict.tricks)
    why = "the step is not replayed, nor is its rollout" if not verdict.replayed else not_replayed(cfg)
    if why:
        return None, why.replace("the policy's own generate", "PPOTrainer's generate")
    r, usable = rollout_peaks(cfg), verdict.usable_bytes
    return RolloutPhases(CONTEXT_BYTES + weights_of(verdict), gpu.cuda_total_bytes, r.generate_bytes, usable,
                         verdict.total_bytes, usable, True, r.score_bytes, usable), r  # fmt: skip


def beside_fails(model: Model, gpu: GPU, setup: Setup, verdict) -> tuple[str, int]:
    """The first phase beside a trick set's step that does not fit (vLLM's start, its startup check, the rollout,
    the scoring passes: RolloutPhases.failed before train; "" where they fit or are not sized), and their bytes over
    their limit (negative under: the margin fit's search steps by). gpu: the job's, as rollout() takes it."""
    p = phases_for(model, gpu, setup, verdict, engine_for(model, bare(gpu), setup))[0]
    if p is None:
        return "", 0
    return ("" if p.failed == "train" else p.failed), p.margin()


def step_config(model: Model, setup: Setup, tricks):
    """The training step's configuration, from which generate and the scoring passes are replayed."""
    from memcalc.exact.base.config import StepConfig

    return StepConfig(model.shape, setup.seq_len, setup.micro_batch, tricks, setup.stack, setup.optimizer,
                      setup.grad_accum)  # fmt: skip


def own_generation(model: Model, setup: Setup, tricks) -> Generation | str:
    """The policy's own model.generate over one GPU's generation batch (per_device_train_batch_size x
    steps_per_generation, the accumulation by default: the rows vLLM's max_num_seqs counts too), or why it is not
    replayed."""
    from memcalc.exact.hf.generate import not_replayed

    if setup.stack.model != "hf":
        return "the policy's own generate is replayed on Transformers' models"
    cfg = step_config(model, setup, tricks)
    return not_replayed(cfg) or generated(cfg, setup.micro_batch * setup.grad_accum)


def own_scoring(model: Model, setup: Setup, verdict) -> Scoring | None:
    """The scoring passes between generating and training over one GPU's generation batch, in chunks of
    per_device_train_batch_size rows; None where the trainer runs none or the step is not replayed."""
    if setup.stack.model != "hf" or not verdict.replayed:
        return None
    return scored(step_config(model, setup, verdict.tricks), setup.micro_batch * setup.grad_accum)


@lru_cache(maxsize=64)  # the answer and the CLI's fit ask for the same job's
def generated(cfg, rows: int) -> Generation:
    from memcalc.exact.hf.generate import generation

    return generation(cfg, rows)


@lru_cache(maxsize=64)
def scored(cfg, rows: int) -> Scoring | None:
    from memcalc.exact.hf.scoring import scoring

    return scoring(cfg, rows)


def generate_phases(gpu: GPU, verdict, generation: Generation, scoring: Scoring | None = None) -> RolloutPhases:
    """startup, rollout, score and train on one GPU where the policy generates itself: its weights as it starts; the
    trainer's state between steps with generate's peak (the prompts, the cache, the loop's tensors); with the
    scoring passes' peak; the step."""
    usable, score = verdict.usable_bytes, scored_bytes(verdict, 0, scoring)
    return RolloutPhases(CONTEXT_BYTES + weights_of(verdict), gpu.cuda_total_bytes,
                         verdict.state_bytes + generation.peak_bytes, usable, verdict.total_bytes, usable, True, score,
                         usable if score else 0)  # fmt: skip


def weights_of(verdict) -> int:
    """The trainer's weights as it starts: the replayed step's, or the textbook's whole state."""
    return verdict.phases.weights_bytes if verdict.phases is not None else verdict.state_bytes


def scored_bytes(verdict, held: int, scoring: Scoring | None) -> int:
    """The score phase: the trainer's state, the engine's bytes beside it, the passes' peak; 0 where none runs."""
    return verdict.state_bytes + held + scoring.peak_bytes if scoring is not None else 0


def phases_of(engine: RolloutEngine, gpu: GPU, verdict, sleep: bool, scoring: Scoring | None = None) -> RolloutPhases:
    """startup, rollout, score and train on one GPU for one verdict (its phases: the trainer's weights and state);
    the scoring passes run beside the engine as the step has it (asleep under sleep mode: TRL sleeps it as
    generation ends, trl/generation/vllm_generation.py)."""
    beside = engine.mode == "colocate"
    startup = CONTEXT_BYTES + weights_of(verdict) + (engine.requested_bytes if beside else 0)
    rollout_bytes = verdict.state_bytes + (engine.awake_bytes + engine.forward_bytes if beside else 0)
    held = (engine.asleep_bytes if sleep else engine.awake_bytes) if beside else 0  # the GPU's colocated_bytes
    usable = verdict.usable_bytes + held  # the GPU's usable bytes as the verdict counts them, the engine's given back
    score = scored_bytes(verdict, held, scoring)
    return RolloutPhases(startup, gpu.cuda_total_bytes, rollout_bytes, usable, verdict.total_bytes + held, usable,
                         not engine.failure, score, usable if score else 0)  # fmt: skip
