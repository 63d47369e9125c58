"""memcalc serve's budget beside each published vLLM startup log of benchmarks/serving/ (issue 41).

    python benchmarks/serving/report.py            # each log: published, predicted, error; the summary
    python benchmarks/serving/report.py --summary  # the summary alone

A log is predicted where memcalc has its model (a preset) and its card: the ServeJob of its settings
(card, tp, max_model_len, gpu_memory_utilization, weights) under the release it names
(memcalc.serve.releases.release_for; a V0-engine log under 0.9's rule, memory_profiling with the baseline
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

from benchmarks.serving.corpus import Log, load  # noqa: E402

GIB = 1 << 30
V0_SEQS, V0_TOKENS, V0_CHUNKED_ABOVE = 256, 2048, 32768  # vllm 0.6.6 arg_utils.py, config.py


def job_of(log: Log):
    """The ServeJob of the log's settings, or the reason there is none."""
    from memcalc.errors import InputError
    from memcalc.model.gpus import gpu
    from memcalc.model.presets import preset_model
    from memcalc.serve.job import ServeJob
    from memcalc.serve.releases import release_for
    from memcalc.time.calibration import calibration_for

    if not log.model or not log.tp or not log.context:
        return "memcalc has no preset of its model, or the thread leaves tp or max_model_len out"
    try:
        release = "0.9" if log.engine == "v0" or not log.version[0].isdigit() else release_for(log.version).key
    except InputError as e:
        return str(e)
    tokens, seqs = log.max_num_batched_tokens or None, log.max_num_seqs or None
    if log.engine == "v0":
        tokens = tokens or (V0_TOKENS if log.context > V0_CHUNKED_ABOVE else max(log.context, V0_TOKENS))
        seqs = seqs or V0_SEQS
    return ServeJob(preset_model(log.model), gpu(log.gpu), log.context, calibration_for(log.gpu), weights=log.weights,
                    tp=log.tp, gpu_memory_utilization=log.utilization, max_num_batched_tokens=tokens,
                    max_num_seqs=seqs, vllm=release)  # fmt: skip


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


def summary(results: list[tuple[Log, dict | str]]) -> list[str]:
    out = []
    for split in ("fit", "held-out"):
        for name in ("available_gib", "tokens", "concurrency", "total_gib", "weights_gib"):
            errs = [abs(error(p[name], lg.published[name])) for lg, p in results
                    if isinstance(p, dict) and lg.split == split and lg.settings_stated and name in lg.published]
            if errs:
                out.append(f"{split:8} {name:14} n={len(errs):2}  median |error| {statistics.median(errs):6.1%}  "
                           f"worst {max(errs):6.1%}")  # fmt: skip
    return out


def main(argv: list[str]) -> None:
    results = rows(load())
    if "--summary" not in argv:
        for log, p in results:
            print(f"{log.id} ({log.engine}, vLLM {log.version}, {log.gpu} x tp {log.tp}, {log.split}"
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
