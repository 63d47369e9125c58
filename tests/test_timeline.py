"""`memcalc estimate --timeline` (issue 23): live memory over the step, allocation by allocation, from the
replay the verdict comes from; in the terminal, as PNG and SVG, and in the JSON."""

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.exact.step import step_phases
from memcalc.exact.timeline import KINDS, ranges, step_timeline
from memcalc.model.presets import PRESETS
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import parse_tricks

LLAMA = ["estimate", "--model", "llama3-8b", "--seq", "8192", "--timeline"]
ENV = {"NO_COLOR": "1", "COLUMNS": "100"}


def run(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


@pytest.fixture(scope="module")
def llama_json() -> dict:
    out = run(*LLAMA, "--tricks", "bf16,flash", "--tricks", "bf16,flash,ckpt", "--format", "json")
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_llama3_8b_peak_is_the_verdicts_to_the_byte(llama_json):
    """Llama-3-8B at seq 8192: the forward climbs, the peak is at the loss's backward (bf16+flash) or in the
    optimizer step (with ckpt, where the gradients of every block are live), and the highest point of the
    series is the verdict's peak, the op at it the verdict's."""
    plain, ckpt = llama_json["timeline"]
    for t, v in zip(llama_json["timeline"], llama_json["verdict"], strict=True):
        assert max(t["live_bytes"]) == t["peak_bytes"] == v["peak_bytes"] == v["phases"]["step_peak_bytes"]
        assert t["peak_at"] == v["peak_at"]
        assert [p["phase"] for p in t["phases"]] == ["forward", "backward", "optimizer"]
        assert t["start_bytes"] == t["end_bytes"] == v["phases"]["state_bytes"] + v["phases"]["inputs_bytes"]
        n = len(t["ops"])
        assert all(len(t[k]) == n for k in ("nbytes", "live_bytes", "layers", "what"))
        assert t["phases"][-1]["end"] == n and sum(g["bytes"] for g in t["at_peak"]) == t["peak_bytes"]
        assert [sum(x) for x in zip(*t["live_by_kind"], strict=True)] == t["live_bytes"]  # each point, by kind
        at_peak = dict(zip(t["kinds"], (series[t["peak_index"]] for series in t["live_by_kind"]), strict=True))
        assert at_peak["weights"] == sum(g["bytes"] for g in t["at_peak"] if g["what"] == "weights")
    forward, backward, _ = plain["phases"]
    assert plain["live_bytes"][forward["end"] - 1] - plain["start_bytes"] > 50e9  # the saved activations of 32 blocks
    assert plain["peak_phase"] == "backward" and plain["peak_index"] - backward["start"] < 8  # the loss's backward
    assert plain["peak_at"] == "backward: _log_softmax_backward_data" and "loss" in plain["peak_what"]
    assert ckpt["peak_at"] == "optimizer: sqrt" and any(g["what"] == "gradients" for g in ckpt["at_peak"])


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 7), seq=st.sampled_from([16, 48]), micro_batch=st.integers(1, 2),
       tricks=st.sampled_from(["fp32", "bf16", "bf16,flash,ckpt", "bf16,ckpt:3", "bf16,selective", "fp16"]),
       stack=st.sampled_from(["reference", "torch", "hf"]), grad_accum=st.integers(1, 2))
def test_the_series_peaks_where_the_grown_step_does(layers, seq, micro_batch, tricks, stack, grad_accum):
    """The whole depth replayed event by event peaks at the bytes and op of the step grown from two short ones
    (the verdict's), and what is live there adds up to it; the live bytes never go below zero."""
    shape = ModelShape(n_layers=layers, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                       vocab=200, tied_embeddings=False, positions="rope")  # fmt: skip
    t, s = parse_tricks(tricks), stack_for(stack)
    try:
        p = step_phases(shape, seq, micro_batch, t, grad_accum, s)
    except InputError:  # a trick set the stack refuses (hf checkpoints every layer or none: no ckpt:3)
        assume(False)
    tl = step_timeline(shape, seq, micro_batch, t, grad_accum, s)
    assert (tl.peak_bytes, tl.peak_at) == (p.step_peak_bytes, max(
        [(p.forward_peak_bytes, p.forward_peak_at), (p.backward_peak_bytes, p.backward_peak_at),
         (p.optimizer_peak_bytes, p.optimizer_peak_at)], key=lambda x: x[0])[1])  # fmt: skip
    assert sum(g.bytes for g in tl.at_peak) == tl.peak_bytes and min(tl.live_bytes) > 0
    assert tuple(map(sum, zip(*tl.live_by_kind, strict=True))) == tl.live_bytes  # what is live, kind by kind
    assert all(min(series) >= 0 for series in tl.live_by_kind) and set(tl.kinds) <= set(KINDS)
    assert ("saved for backward" in tl.kinds) and tl.kinds[0] == "weights"
    assert [sp.phase for sp in tl.phases] == ["forward", "backward"] * grad_accum + ["optimizer"]


def test_what_is_live_at_the_peak():
    """Grouped by what it is: model state, each saved activation over the blocks that keep it, temporaries."""
    t = step_timeline(PRESETS["llama3-8b"], 8192, 1, parse_tricks("bf16,flash"))
    groups = {g.what: g for g in t.at_peak}
    assert groups["weights"].bytes == 2 * 8_030_261_248 and groups["weights"].layers == "0-31"
    assert groups["fp32 master weights"].bytes == 4 * 8_030_261_248
    assert groups["optimizer state"].bytes == 8 * 8_030_261_248  # AdamW's m and v
    by_kind = {kind: series[t.peak_index] for kind, series in zip(t.kinds, t.live_by_kind, strict=True)}
    for kind in ("weights", "fp32 master weights", "optimizer state"):  # the coarse kinds hold the groups' bytes
        assert by_kind[kind] == groups[kind].bytes
    assert by_kind["saved for backward"] == sum(g.bytes for g in t.at_peak if "saved for backward" in g.what)
    saved = [g for g in t.at_peak if g.what.startswith("saved for backward by mlp")]
    assert saved and all(g.layers == "0-31" and g.tensors == 32 for g in saved)
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and ranges([]) == ""


@pytest.mark.parametrize("tricks,args", [("bf16,flash,ckpt", ("--gpus", "8", "--zero", "3")),
                                         ("bf16,selective", ("--stack", "hf")), ("bf16", ("--grad-accum", "2"))])
def test_peak_equals_the_verdict_across_jobs(tricks, args):
    """ZeRO-3's rank, Transformers' classes, two micro-batches: the series peaks where the verdict does (the
    engine refuses to answer otherwise)."""
    out = run("estimate", "--model", "qwen3-8b", "--seq", "4096", "--tricks", tricks, "--timeline", *args,
              "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    t, v = data["timeline"][0], data["verdict"][0]
    assert (max(t["live_bytes"]), t["peak_at"]) == (v["peak_bytes"], v["peak_at"])
    assert [p["phase"] for p in t["phases"]][-1] == "optimizer"


def test_terminal_chart_fits_100_columns():
    out = run(*LLAMA, "--tricks", "bf16,flash", "--tricks", "bf16,flash,ckpt")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert max(len(x) for x in lines) <= 100
    assert sum("forward" in x and "backward" in x and "optimizer" in x for x in lines) == 2  # each chart's phases
    t = step_timeline(PRESETS["llama3-8b"], 8192, 1, parse_tricks("bf16,flash"))
    assert f"bf16+flash: peak 178.0 GB at event {t.peak_index + 1:,} of {len(t.ops):,} ({t.peak_at})" in lines
    assert sum("▲" in x for x in lines) == 2 and "Live at the peak of bf16+flash+ckpt (optimizer: sqrt)" in lines
    p = step_phases(PRESETS["llama3-8b"], 8192, 1, parse_tricks("bf16,flash"))
    assert f"({p.step_peak_bytes:,} B)" in out.stdout


def test_csv_has_every_allocation(llama_json):
    out = run(*LLAMA, "--tricks", "bf16,flash", "--format", "csv")
    rows = out.stdout.splitlines()
    assert rows[0] == "tricks,event,phase,op,what,layer,bytes,live_bytes"
    assert len(rows) - 1 == len(llama_json["timeline"][0]["ops"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the plot extra)")
def test_png_and_svg_open(tmp_path):
    """The images open: the PNG read back at the figure's size, the SVG parsed as XML."""
    from matplotlib.image import imread

    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    out = run(*LLAMA, "--tricks", "bf16,flash", "--tricks", "bf16,flash,ckpt", "--png", str(png), "--svg", str(svg))
    assert out.exit_code == 0, out.output
    assert imread(png).shape[:2] == (504, 1200)  # 10 x 4.2 inches at 120 dpi
    assert ET.parse(svg).getroot().tag.endswith("svg")
    assert png.stat().st_size < 150_000
    assert {"forward", "bf16+flash+ckpt", "h100-sxm usable"} <= svg_texts(svg)  # text, not glyph paths


def svg_texts(path) -> set[str]:
    """The strings an SVG writes as <text> (matplotlib with svg.fonttype "none")."""
    return {"".join(t.itertext()) for t in ET.parse(path).getroot().iter() if t.tag.endswith("}text")}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the plot extra)")
def test_the_legend_lists_only_what_is_drawn(tmp_path):
    """A step far under the GPU's usable memory: the usable line would be above the chart, so it is neither
    drawn nor listed."""
    svg = tmp_path / "small.svg"
    out = run("estimate", "--model", "gpt2", "--seq", "256", "--tricks", "bf16", "--timeline", "--svg", str(svg))
    assert out.exit_code == 0, out.output
    texts = svg_texts(svg)
    assert "bf16" in texts and not [x for x in texts if "usable" in x]


def test_missing_matplotlib_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = run(*LLAMA, "--tricks", "bf16,flash", "--svg", str(tmp_path / "t.svg"))
    assert out.exit_code == 2 and out.stderr.strip() == "error: --svg needs matplotlib: pip install 'memcalc[plot]'"


@pytest.mark.parametrize("args,message", [
    (("--svg", "t.png"), "--svg writes an SVG file"), (("--tp", "2"), "drop --tp"),
    (("--stack", "fsdp2", "--gpus", "8"), "FSDP2"), (("--exact",), "drop one"),
    (("--sweep", "seq=1k:4k"), "drop --sweep"),
])  # fmt: skip
def test_refused(args, message):
    out = run(*LLAMA, "--tricks", "bf16,flash", *args)
    assert out.exit_code == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert run("estimate", "--model", "gpt2", "--svg", "t.svg").exit_code == 2  # --svg alone draws nothing


def test_repeated_tricks_estimate_several_sets():
    """--tricks twice: two rows, in the order given (the same set twice: once)."""
    out = run("estimate", "--model", "gpt2", "--seq", "1024", "--tricks", "bf16,flash", "--tricks", "bf16",
              "--tricks", "bf16,flash", "--format", "json")  # fmt: skip
    assert [v["tricks"] for v in json.loads(out.stdout)["verdict"]] == [["bf16", "flash"], ["bf16"]]


def test_a_long_accumulation_is_drawn_over_three_micro_batches():
    """--grad-accum 512 replayed whole ran for minutes and gigabytes of host memory; the chart draws the first three
    micro-batches (each later one starts where the third did and repeats it) and peaks where the verdict does, and
    says so; the JSON carries how many it drew of how many."""
    args = ("estimate", "--model", "gpt2", "--seq", "256", "--grad-accum", "512", "--tricks", "bf16", "--timeline")
    out = run(*args, "--format", "json")
    assert out.exit_code == 0, out.output
    tl = json.loads(out.output)["timeline"][0]
    assert (tl["micro_batches"], tl["accumulated"]) == (3, 512)
    assert sum(span["phase"] == "forward" for span in tl["phases"]) == 3
    text = run(*args)
    assert text.exit_code == 0 and "the first 3 of its 512 micro-batches" in " ".join(text.output.split())


@pytest.mark.parametrize("rl", ["grpo", "rloo"])
def test_a_generation_batch_of_many_micro_batches_keeps_its_size_when_drawn_over_three(rl):
    """GRPO's and RLOO's generation batch holds every micro-batch of the step (eight here) from the first: drawn
    over three micro-batches, the timeline still holds all eight's, and peaks where the verdict does (it raised
    the full depth's disagreement when the drawn three sized the batch)."""
    out = run("estimate", "--model", "llama3.2-1b", "--lora", "16", "--seq", "512", "--grad-accum", "8", "--rl", rl,
              "--num-generations", "8", "--completion-len", "256", "--tricks", "bf16,flash,ckpt", "--timeline",
              "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    t, v = data["timeline"][0], data["verdict"][0]
    assert (t["peak_bytes"], t["peak_at"]) == (v["peak_bytes"], v["peak_at"])
    assert (t["micro_batches"], t["accumulated"]) == (3, 8)
