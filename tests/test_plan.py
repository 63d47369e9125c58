"""`memcalc plan`: the issue's job ranked, small and impossible jobs, and the Sections the CLI prints."""

import io
import json
import time

import pytest

from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.model.gpus import gpu
from memcalc.model.presets import preset_model
from memcalc.model.tricks import Tricks
from memcalc.model.layout import Layout
from memcalc.parallel.plan import layout_estimate, plan
from memcalc.parallel.search import layouts
from memcalc.report import layout as layout_report
from memcalc.report import plan as plan_report
from memcalc.report import render

H100 = gpu("h100-sxm")


@pytest.fixture(scope="module")
def timed_plan():
    # the issue's "done when": plan --model llama3-70b --gpu h100-sxm --gpus 64 --seq 8192 --global-batch 512
    # CPU time of this process, so that other work on a shared machine does not count against it
    start = time.process_time()
    result = plan(preset_model("llama3-70b"), H100, 64, 8192, 512, gpus_per_node=8)
    return result, time.process_time() - start


@pytest.fixture(scope="module")
def p70(timed_plan):
    return timed_plan[0]


def test_the_issue_job_ranks_layouts_that_fit(p70):
    assert len(p70.best) == 5 and p70.fitting >= 5
    speeds = [float(f"{e.time.tokens_per_second:.4g}") for e in p70.best]  # equal speed to 4 digits (rank_key)
    assert speeds == sorted(speeds, reverse=True)
    for est in p70.best:
        assert est.memory.fits and est.verdict.fits and est.verdict.total_bytes <= est.verdict.usable_bytes
        assert est.verdict.usable_bytes == H100.memory_bytes - est.headroom.total_bytes
        assert est.gpus == 64 and est.global_batch == 512 and est.time.tokens_per_step == 512 * 8192
        assert len(est.memory.stages) == est.layout.pp  # every stage, for the breakdown and cluster totals


def test_searches_thousands_of_layouts_quickly(timed_plan):
    p, seconds = timed_plan
    assert p.searched > 5000 and p.fitting < p.searched
    assert seconds < 5  # cold, its kernel traces included; benchmarks/plan_speed.py measures the wall time


def test_the_winner_is_what_layout_estimate_says(p70):
    best = p70.best[0]
    again = layout_estimate(best.model, best.setup, H100, best.tricks, best.layout)
    assert again.memory.total_bytes == best.memory.total_bytes
    assert again.time.step_seconds == best.time.step_seconds


def test_70b_needs_model_parallel_or_sharding(p70):
    # 70.6B x 16 bytes = 1.13 TB of model state: plain data parallel cannot fit an 80 GB GPU
    best = p70.best[0]
    assert best.layout.tp * best.layout.pp > 1 or best.layout.zero == 3
    alt = {a.name: a for a in p70.alternatives}
    ddp = alt["data parallel only (DDP, ZeRO-0)"]
    assert not ddp.fits and ddp.cause == "out of memory" and ddp.estimate.memory.total_bytes > 1_000_000_000_000
    for a in p70.alternatives:
        if a.fits:
            assert a.estimate.time.tokens_per_second <= best.time.tokens_per_second * (1 + 1e-3)  # rank_key: 4 digits
            assert a.cause in ("tie",) + tuple(plan_report.CAUSES)


def test_fsdp_alone_loses_to_recompute(p70):
    # without TP the 70B's activations (34·s·b·h per layer, 2.3 GB) only fit with full recompute: +1/3 FLOPs
    fsdp = next(a for a in p70.alternatives if a.name.startswith("FSDP"))
    assert fsdp.fits and fsdp.cause == "recompute" and fsdp.estimate.tricks.recompute == "full"


def test_small_model_wins_with_plain_data_parallel():
    # data parallel only; ZeRO-1 ties ZeRO-2 and 3 and beats DDP by its optimizer step alone: each GPU's
    # AdamW runs over 1/8 of the parameters (the roofline times its kernels on the shard; a 124M model's
    # per-tensor kernels sit near the launch floor, so 1/8 of the bytes is not 1/8 of the time)
    p = plan(preset_model("gpt2"), H100, 8, 1024, 64)
    best = p.best[0].time
    assert (best.layout.tp, best.layout.pp, best.layout.cp, best.layout.dp, best.layout.zero) == (1, 1, 1, 8, 1)
    ddp = next(e for e in p.best if e.layout.zero == 0).time
    assert ddp.step_seconds - best.step_seconds == pytest.approx(ddp.optimizer_seconds - best.optimizer_seconds)
    assert ddp.exposed_comm_seconds == best.exposed_comm_seconds == 0


def test_nothing_fits():
    p = plan(preset_model("llama3.1-405b"), gpu("a100-40gb"), 1, 8192, 1)
    assert p.best == () and p.fitting == 0 and p.searched > 0
    assert p.alternatives and all(not a.fits for a in p.alternatives)
    text = tables(plan_report.plan_sections(p, "gb"))  # the short output says why each alternative loses
    assert "out of memory" in text and "Fastest layouts" not in text
    assert plan_report.plan_verdict(p, "gb").startswith("Nothing fits")


@pytest.mark.parametrize("kwargs, message", [
    ({"gpus": 0}, "gpus must be positive"),
    ({"global_batch": 0}, "global batch must be positive"),
    ({"seq_len": 0}, "seq must be positive"),
    ({"recomputes": ()}, "name a recompute mode"),  # selective alone beside flash is searched: test_trick_rules.py
])  # fmt: skip
def test_bad_plan_input(kwargs, message):
    args = {"model": preset_model("gpt2"), "gpu": H100, "gpus": 8, "seq_len": 1024, "global_batch": 8, **kwargs}
    with pytest.raises(InputError, match=message):
        plan(**args)


# ---- what the CLI prints ----------------------------------------------------------------------------------


def tables(sections, preamble=()) -> str:
    out = io.StringIO()
    render.print_tables(sections, list(preamble), file=out, exact=True, cols=400)
    return out.getvalue()


def test_plan_sections(p70):
    text = tables(plan_report.plan_sections(p70, "gb", detail=True), plan_report.plan_preamble(p70))
    best = p70.best[0]
    assert "Fastest layouts that fit" in text and "Why the obvious alternatives lose" in text
    assert f"{best.time.tokens_per_second:,.0f}" in text
    assert f"{best.memory.total_bytes:,} B" in text
    assert "Searched" in text and "64 x h100-sxm" in text
    md = render.to_markdown(plan_report.plan_sections(p70, "gb", detail=True), plan_report.plan_preamble(p70))
    assert md.count("### ") == 4
    short = tables(plan_report.plan_sections(p70, "gb"))
    assert "Fastest layouts that fit" in short and "Why the obvious alternatives lose" not in short
    csv_text = render.to_csv(plan_report.PLAN_CSV_HEADERS, plan_report.plan_csv_rows(p70))
    assert len(csv_text.splitlines()) == 6
    data = json.loads(render.to_json(p70))
    assert data["best"][0]["memory"]["total_bytes"] == best.memory.total_bytes
    assert data["best"][0]["layout"]["world"] == 64


def test_layout_sections_and_explain():
    model = preset_model("llama3-70b")
    est = layout_estimate(model, Setup(seq_len=8192, grad_accum=16), H100, Tricks(flash=True),
                          Layout(tp=8, sp=True, pp=4, vpp=2, dp=2, zero=1))  # fmt: skip
    text = tables(layout_report.layout_sections(est, "gb", detail=True), layout_report.layout_preamble([est]))
    for title in ("Model state", "Activations of one layer", "Peak memory per GPU, by pipeline stage",
                  "Communication per step", "Step time", "Cluster totals over 64 GPUs"):  # fmt: skip
        assert title in text
    assert f"{est.cluster_bytes:,} B" in text
    assert "SP reduce-scatter + all-gather" in text and "PP send/recv" in text
    explain = "\n".join(layout_report.layout_explain_lines(est))
    assert "24·s·b·h/t = 24·8,192·1·8,192/8 = 201,326,592 B" in explain
    rows = layout_report.layout_csv_rows(est)
    assert len(rows) == 4 and rows[0][7] == est.memory.stages[0].total_bytes
    assert layout_report.layout_warnings(est) == []


def test_tricks_section_lists_one_row_per_trick_set():
    from memcalc.model.tricks import PROGRESSION

    model, layout = preset_model("llama3-8b"), Layout(tp=2, sp=True, dp=4, zero=1)
    ests = [layout_estimate(model, Setup(seq_len=8192), H100, t, layout) for t in PROGRESSION]
    section = layout_report.tricks_section(ests, "gb")
    assert [row[0] for row in section.rows] == [t.label for t in PROGRESSION]
    assert "tp2 sp pp1 cp1 dp4 zero1" in section.title


def test_without_leaves_features_out_of_the_search():
    """plan --without: a 2021 Megatron-LM run had no SP and no distributed optimizer; the search leaves
    them out (and says so), and what it keeps is exactly the full search's layouts without them."""
    model, g = preset_model("llama3-8b"), gpu("a100-80gb")
    args = (model, g, 8, 2048, 16)
    full = plan(*args, tricks=Tricks("bf16", flash=True), top=1000, recomputes=("none",))
    bare = plan(*args, tricks=Tricks("bf16", flash=True), top=1000, recomputes=("none",),
                without=("zero", "sp", "interleave", "cp", "offload"))  # fmt: skip
    assert bare.without == ("cp", "interleave", "offload", "sp", "zero") and bare.searched < full.searched
    for est in bare.best:
        lay = est.layout
        assert not lay.sp and lay.zero == 0 and lay.vpp == 1 and lay.cp == 1 and not lay.offload_optimizer
    allowed = []  # every layout of the full search that has none of the features, timed one by one
    for lay, b, m in layouts(model, 8, 8, 2048, 16, True, True):
        if not (lay.sp or lay.zero or lay.vpp > 1 or lay.cp > 1 or lay.offload_optimizer):
            est = layout_estimate(model, Setup(seq_len=2048, micro_batch=b, grad_accum=m), g, Tricks("bf16", flash=True), lay)
            allowed += [est.time.tokens_per_second] if est.verdict.fits else []
    assert bare.best[0].time.tokens_per_second == pytest.approx(max(allowed))
    assert bare.best[0].time.tokens_per_second < full.best[0].time.tokens_per_second
    assert "without sequence parallel" in "\n".join(plan_report.plan_preamble(bare, "gb")).replace("\n  ", " ")
    with pytest.raises(InputError, match="--without takes"):
        plan(model, g, 16, 2048, 64, without=("pipelines",))


def test_a_plan_row_says_its_gpus_once():
    """Each row's JSON has one record of its GPUs, the layout: its setup once carried parallel {gpus 1, zero 0}
    beside a layout of dp 4 zero 2 (Setup.parallel, gone: how the GPUs share the work is the layout's alone)."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, ["plan", "--params", "8e9", "--gpus", "8", "--global-batch", "64", "--seq", "4096",
                                 "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["best"]
    assert rows and all("parallel" not in row["setup"] for row in rows)
    assert all(row["layout"]["world"] == 8 for row in rows)


def test_the_ranking_says_what_it_shows():
    """'6 fit' above two rows: the rows are the fastest layout of each kind (kind_of), and --top cuts the kinds."""
    args, kw = (preset_model("llama3-8b"), H100, 1, 2048, 4), {"recomputes": ("full",)}  # --tricks bf16,flash,ckpt
    p = plan(*args, **kw)
    assert (p.fitting, p.fitting_kinds, len(p.best)) == (6, 2, 2)
    text = tables(plan_report.plan_sections(p, "gb"))
    assert "Fastest layouts that fit, one per kind: all 2 kinds (6 layouts)" in text
    assert "a kind: the layouts that differ only in how dp, cp and the micro-batch split the batch" in text
    one = plan(*args, **kw, top=1)
    assert len(one.best) == 1
    assert ("Fastest layouts that fit, one per kind: the best 1 of 2 kinds (6 layouts; --top N for more)"
            in tables(plan_report.plan_sections(one, "gb", detail=True)))  # fmt: skip
    assert json.loads(render.to_json(one))["fitting_kinds"] == 2
