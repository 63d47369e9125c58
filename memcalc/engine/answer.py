"""The engine's one entry point: answer(job) -> Answer, everything `memcalc estimate` prints and its JSON
serialises. One path for every job: one GPU is the layout of one GPU, --gpus N alone is data parallelism
over N (the same job as --dp N), and every trick set is answered the same way:

  verdict   what one GPU holds at its step's peak (memcalc.parallel.verdict: the stack's step replayed,
            sharded inside the step; the textbook where the simulator does not replay the job)
  layout    the textbook's memory stage by stage and the step time with its traffic (memcalc.parallel.plan
            layout_estimate: the roofline of each stage's kernels, or --mfu's rate)
Around them: the whole-model textbook terms (data-parallel jobs: memcalc.memory.estimate), one GPU's
kernels on the roofline (a one-GPU job), the OOM toolbox (memcalc.engine.toolbox), the whole run,
--exact's op-by-op terms, and --timeline's step allocation by allocation (memcalc.engine.timeline).
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.memory.estimate import Estimate, estimate
from memcalc.parallel.plan import LayoutEstimate, layout_estimate
from memcalc.parallel.verdict import Verdict
from memcalc.records import record
from memcalc.time.training_run import TrainingRun, runs_for_layouts

from .job import Job
from .rollout import Rollout, rollout
from .toolbox import Toolbox, toolbox


@record(slots=True)
class Answer:
    """One job answered, one entry per trick set in every tuple, in the job's order."""

    job: Job
    layouts: tuple[LayoutEstimate, ...]  # each trick set's verdict, the textbook's stages, the step time
    textbook: Estimate | None  # the whole-model textbook terms (data-parallel jobs; None with tp, pp, cp or ep)
    roofline: tuple | None  # one GPU's step on the roofline, kernel by kernel (a one-GPU job timed by it)
    toolbox: Toolbox | None  # the cheapest way to fit the first trick set (data-parallel jobs)
    runs: tuple[TrainingRun, ...]  # --tokens: the whole run
    exact: tuple  # --exact: one GPU's steps op by op (memcalc.exact.step.ExactStep), or one layer per TP rank
    timelines: tuple = ()  # --timeline: each step allocation by allocation (memcalc.exact.timeline.Timeline)
    rollout: Rollout | None = None  # --rl grpo --vllm: the engine and each phase on one GPU (memcalc.engine.rollout)

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        """The peak per GPU that decides whether each trick set fits (memcalc.parallel.verdict)."""
        return tuple(e.verdict for e in self.layouts)


def answer(job: Job) -> Answer:
    """Everything `memcalc estimate` answers for one job (--sweep is memcalc.engine.sweep's)."""
    m, s, g, lay = job.model, job.setup, job.gpu, job.layout
    sets, timing = job.trick_sets, job.time_model
    layouts = tuple(layout_estimate(m, s, g, t, lay, timing=timing) for t in sets)
    textbook = estimate(m, s, g, sets, lay) if job.data_parallel else None
    runs = runs_for_layouts(layouts, job.tokens, job.price) if job.tokens is not None else ()
    tb = toolbox(m, s, g, sets[0], lay, timing) if job.data_parallel else None
    timelines = ()
    if job.timeline:
        from .timeline import step_timelines

        timelines = step_timelines(job, tuple(e.verdict for e in layouts))
    verdicts = tuple(e.verdict for e in layouts)
    engine = rollout(m, g, s, verdicts) if s.stack.online is not None or s.stack.ppo is not None else None
    return Answer(job, layouts, textbook, one_gpu_roofline(job), tb, runs, exact_terms(job, layouts), timelines,
                  engine)  # fmt: skip


def one_gpu_roofline(job: Job) -> tuple | None:
    """A one-GPU job's step on the roofline, kernel by kernel (memcalc.time.roofline.rooflines), the same
    step its layout's time composes; None under --mfu or for a job over several GPUs."""
    timing = job.time_model
    if job.layout.world > 1 or isinstance(timing, float):
        return None
    from memcalc.time.roofline import rooflines

    return rooflines(job.model, job.setup, job.gpu, job.trick_sets, timing)


def exact_terms(job: Job, layouts: tuple[LayoutEstimate, ...]) -> tuple:
    """--exact: what each trick set saves, op by op: one GPU's step replayed (a data-parallel job: what a
    layer saves does not depend on data parallelism), or with tensor parallel what one layer saves on one
    TP rank (memcalc.parallel.tp_layer)."""
    if not job.exact:
        return ()
    if job.data_parallel:
        from memcalc.exact.step import exact_for

        return tuple(exact_for(job.model, job.setup, t) for t in job.trick_sets)
    shape = job.model.shape
    if job.layout.cp > 1:
        raise InputError("--exact with --cp: ring attention's saved tensors are not simulated; drop --exact or --cp")
    if shape.is_moe or shape.is_mla:
        raise InputError("--exact over several GPUs replays a dense block's TP shard; MoE and latent-attention blocks "
                         "are replayed on one GPU: drop --gpus and the layout (memcalc estimate --exact)")  # fmt: skip
    from memcalc.parallel.tp_layer import block_terms

    return tuple(block_terms(shape, job.setup.seq_len, job.setup.micro_batch, e.tricks, e.layout) for e in layouts)

