"""`memcalc plan` against published runs: the planner's top layout for each job of a source, given the kernels
and tricks the run had, beside the throughput the run published.

    python benchmarks/published/planner.py

A run's authors searched for their layout (Narayanan et al. 2021 sec. 5: Table 1's are the best of a sweep),
so a planner that promises much more than they measured promises what no one has measured. Each source is
planned with what its stack had at the time (WITHOUT: the features left out of the search, with the
reason), its precision, attention kernel and recompute as the report takes them (report.tricks_of), on the
stack memcalc stands in with; the micro-batch, interleaving and the rest are the planner's.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Inexpressible, assumptions, job_text, load, published_rate, shape_of, stack_of, tricks_of  # noqa: E402

from memcalc.model.gpus import GPUS  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.shape import Model  # noqa: E402
from memcalc.model.stacks import STACKS  # noqa: E402
from memcalc.parallel.plan import plan  # noqa: E402

# The sources planned, and what their stack lacked when the run was made.
WITHOUT = {
    # Megatron-LM in 2021: no sequence parallelism (Korthikanti et al. 2022), no distributed optimizer, no CP
    "narayanan2021": ("sp", "zero", "cp", "offload"),
    # Korthikanti et al. 2022 introduce SP; the distributed optimizer and CP came later
    "korthikanti2022": ("zero", "cp", "offload"),
    # Megatron-Core r0.8 (2024): SP, the distributed optimizer and CP all exist; offload does not
    "megatron_lm_readme": ("offload",),
}
TABLE_ONLY = {"narayanan2021": "Table 1"}  # Table 2 compares fixed layouts: nothing to plan


@dataclass(frozen=True)
class Planned:
    key: str
    published: float  # tokens/s per GPU
    planned: float | None  # the planner's top layout, tokens/s per GPU
    layout: str
    memory_share: float  # the top layout's peak over the GPU's usable memory
    skipped: str = ""

    @property
    def ratio(self) -> float | None:
        return self.planned / self.published if self.planned else None


def planned(run) -> Planned:
    published, _ = published_rate(run)
    tricks = tricks_of(run)
    recomputes = (tricks.recompute,) if tricks.recompute != "none" or run.recompute else ("none", "selective", "full")
    if tricks.flash:
        recomputes = tuple(r for r in recomputes if r != "selective") or ("none",)
    shape = shape_of(run)
    assume = assumptions(run)
    p = plan(Model(shape, n_params(shape), run.key), GPUS[run.gpu], run.gpus, run.seq, run.global_batch,
             gpus_per_node=run.gpus_per_node or 8, tricks=tricks, recomputes=recomputes, assume=assume,
             stack=STACKS[stack_of(run)], without=WITHOUT[run.source.id])  # fmt: skip
    if not p.best:
        return Planned(run.key, published, None, "", 0.0, "no layout fits")
    top = p.best[0]
    share = top.verdict.total_bytes / top.verdict.usable_bytes  # of the GPU less its headroom
    return Planned(run.key, published, top.time.tokens_per_second / top.layout.world, job_text(top), share)


def planned_rows(sources: tuple[str, ...] = tuple(WITHOUT)) -> list[Planned]:
    """The planner's top layout for every job of these sources that gives its global batch."""
    out = []
    for run in load():
        if run.source.id not in sources or not run.global_batch:
            continue
        if not run.where.startswith(TABLE_ONLY.get(run.source.id, "")):
            continue
        try:
            out.append(planned(run))
        except Inexpressible as e:
            out.append(Planned(run.key, 0.0, None, "", 0.0, str(e)))
    return out


def main() -> None:
    got = planned_rows()
    print(f"{'run':46} {'published':>9} {'plan top':>9} {'ratio':>6} {'memory':>7}  top layout (tokens/s per GPU)")
    for r in got:
        if r.ratio is None:
            print(f"{r.key:46} {'':>9} {'':>9} {'':>6} {'':>7}  not planned: {r.skipped}")
        else:
            print(f"{r.key:46} {r.published:9,.0f} {r.planned:9,.0f} {r.ratio:6.2f} {r.memory_share:7.1%}  {r.layout}")
    print()
    for source in WITHOUT:
        ratios = [r.ratio for r in got if r.key.startswith(source + "/") and r.ratio]
        print(f"{source:24} without {','.join(WITHOUT[source]):20} {len(ratios):3} jobs: plan top / published "
              f"{min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
