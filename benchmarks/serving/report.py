"""memcalc serve's budget beside each published vLLM startup log of benchmarks/serving/ (issue 41).

    python benchmarks/serving/report.py            # each log: published, predicted, error; the summary
    python benchmarks/serving/report.py --summary  # the summary alone

A log is predicted where memcalc has its model (a preset, or a config.json of configs/ read as `memcalc serve
--config` reads one) and the thread names its card: the ServeJob of its settings
(card, tp, max_model_len, gpu_memory_utilization, weights) under the release it names
(memcalc.serve.releases.release_line; a V0-engine log under 0.9's rule, memory_profiling with the baseline
before NCCL, and V0's profile-run defaults: max_num_seqs 256 and max_num_batched_tokens max(max_model_len,
2048), 2048 above 32k where V0 turns chunked prefill on; vllm 0.6.6 config.py SchedulerConfig.__post_init__,
engine/arg_utils.py). The goal of issue 41 (available KV memory within 5% median, 10% worst) is measured over
the logs whose settings are stated, fit and held-out apart: "fit" logs are those the rules were chosen on.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.serving.corpus import HERE, Log, load  # noqa: E402

GIB = 1 << 30
V0_SEQS, V0_TOKENS, V0_CHUNKED_ABOVE = 256, 2048, 32768  # vllm 0.6.6 arg_utils.py, config.py


def job_of(log: Log):
    """The ServeJob of the log's settings, or the reason there is none."""
    from memcalc.errors import InputError
    from memcalc.model.gpus import gpu
    from memcalc.model.hfconfig import config_model
    from memcalc.model.presets import preset_model
    from memcalc.serve.job import ServeJob
    from memcalc.serve.releases import release_line
    from memcalc.time.calibration import calibration_for

    if not log.model and not log.config:
        return "memcalc has no preset of its model, nor a config.json here it reads"
    if not log.tp or not log.context:
        return "the thread leaves tp or max_model_len out"
    if not log.gpu:
        return "the thread does not name the card"
    try:
        release = "0.9" if log.engine == "v0" or not log.version[0].isdigit() else release_line(log.version)
        model = preset_model(log.model) if log.model else config_model(HERE / log.config, origin=f"config {log.config}")
        tokens, seqs = log.max_num_batched_tokens or None, log.max_num_seqs or None
        if log.engine == "v0":
            tokens = tokens or (V0_TOKENS if log.context > V0_CHUNKED_ABOVE else max(log.context, V0_TOKENS))
            seqs = seqs or V0_SEQS
        return ServeJob(model, gpu(log.gpu), log.context, calibration_for(log.gpu), weights=log.weights, tp=log.tp,
                        gpu_memory_utilization=log.utilization, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                        vllm=release, sampler=log.sampler)  # fmt: skip
    except InputError as e:
        return str(e)


def predicted(log: Log) -> dict | str:
    """memcalc's figures for the log, named as the corpus's published ones."""
    from memcalc.serve.answer import serve

    job = job_of(log)
    if isinstance(job, str):
        return job
    a = serve(job, advise=False)
    st = a.budget.binding
    return {"total_gib": a.budget.total / GIB, "weights_gib": st.weights / GIB, "non_torch_gib": st.non_torch / GIB,
            "activation_gib": st.activations / GIB, "available_gib": st.available / GIB,
            "tokens": a.budget.cache_tokens, "blocks": a.budget.num_blocks, "concurrency": a.max_concurrency}


def error(pred: float, pub: float) -> float:
    return (pred - pub) / pub if pub else float("inf")


def rows(logs: list[Log]) -> list[tuple[Log, dict | str]]:
    return [(log, predicted(log)) for log in logs]


FIGURES = ("available_gib", "tokens", "concurrency", "total_gib", "weights_gib")


def stats(results: list[tuple[Log, dict | str]], split: str, name: str, engine: str = "") -> tuple[int, float, float]:
    """n, median and worst |error| of one figure over the predicted logs of a split whose settings are stated
    (engine "": both); n 0 where there are none."""
    errs = [abs(error(p[name], lg.published[name])) for lg, p in results
            if isinstance(p, dict) and lg.split == split and lg.settings_stated and name in lg.published
            and engine in ("", lg.engine)]  # fmt: skip
    return (len(errs), statistics.median(errs), max(errs)) if errs else (0, 0.0, 0.0)


def summary(results: list[tuple[Log, dict | str]]) -> list[str]:
    """Median and worst |error| of each figure over the predicted logs whose settings are stated: fit and
    held-out apart, both engines, then each engine (v0, v1) apart."""
    out = []
    for engine in ("", "v0", "v1"):
        for split in ("fit", "held-out"):
            for name in FIGURES:
                n, median, worst = stats(results, split, name, engine)
                if n:
                    out.append(f"{split:8} {engine or 'all':3} {name:14} n={n:2}  median |error| {median:6.1%}  "
                               f"worst {worst:6.1%}")  # fmt: skip
    return out


def counts(logs: list[Log], results: list[tuple[Log, dict | str]]) -> str:
    """How many logs, threads, models, cards and engines; how many memcalc predicts."""
    predicted = [lg for lg, p in results if isinstance(p, dict)]
    return (f"{len(logs)} logs from {len({lg.url.split('#')[0] for lg in logs})} sources: "
            f"{len({lg.hf_id for lg in logs if lg.hf_id != 'unstated'})} models, "
            f"{len({lg.gpu for lg in logs if lg.gpu})} cards, engines "
            f"{', '.join(f'{e} {sum(lg.engine == e for lg in logs)}' for e in ('v0', 'v1'))}; predicted "
            f"{len(predicted)} ({sum(lg.settings_stated for lg in predicted)} with every setting stated)")


def main(argv: list[str]) -> None:
    logs = load()
    results = rows(logs)
    print(counts(logs, results))
    if "--summary" not in argv:
        for log, p in results:
            card = log.gpu or "card not named"
            print(f"{log.id} ({log.engine}, vLLM {log.version}, {card} x tp {log.tp}, {log.split}"
                  f"{'' if log.settings_stated else ', settings not all stated'}) {log.url}")
            if isinstance(p, str):
                print(f"  not predicted: {p}")
                continue
            for name, pub in log.published.items():
                print(f"  {name:15} published {pub:>10,.2f}  memcalc {p[name]:>10,.2f}  {error(p[name], pub):+7.1%}")
    print("Summary (logs whose settings are stated):")
    print("\n".join(summary(results)) or "  none predicted")


if __name__ == "__main__":
    main(sys.argv[1:])
