"""The fuzzer: every command driven through the CLI with generated option sets, valid and invalid.

For every call: no traceback; exit code 0, 1 (verify: a row failed) or 2 (bad input, with exactly one
line on stderr); --format json parses, with no NaN, infinity or negative byte count. And invariants
across calls: a higher ZeRO stage, or more GPUs under ZeRO >= 1, never raises per-GPU memory; fit's
answer fits in estimate and a clearly larger one does not; plan's best layouts, re-run through
estimate, give the same numbers.

A bounded number of examples runs everywhere; where each costs seconds (a plan, a fit and the estimates that
check it) CI runs twice as many (MEMCALC_SLOW=1, as .ci/run sets); MEMCALC_FUZZ=N runs N per test:

    MEMCALC_FUZZ=2000 python -m pytest tests/test_fuzz.py
"""

import csv
import io
import json
import math
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app

ROOT = Path(__file__).parent.parent
ENV = {"COLUMNS": "100", "NO_COLOR": "1"}


def examples(n: int, slow: int | None = None) -> settings:
    """n examples, slow of them where MEMCALC_SLOW is set (CI), or MEMCALC_FUZZ of them when set."""
    if slow is not None and os.environ.get("MEMCALC_SLOW"):
        n = slow
    n = int(os.environ.get("MEMCALC_FUZZ", n))
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(args: list[str]):
    return CliRunner().invoke(app, args, env=ENV)


# ---- what users type: valid values, and the kind of mistakes people make --------------------------

COUNTS = ["1", "2", "8", "1k", "8k", "4096", "0", "-1", "abc", "1e40", "nan", "inf", "1.5", "", "2_048", "1,024"]
SEQS = ["128", "1024", "2k", "8192", "32k", "0", "-5", "8b", "x", "1e12"]
PARAMS = ["8e9", "70B", "1.7e9", "405e9", "1", "1e13", "0", "abc", "-8e9", "nan"]
TRICKS = ["bf16", "fp32", "fp16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective", "fp16,flash,ckpt", "flash",
          "fp32,flash", "ckpt,selective", "bf16,bf16", "xyz", "", "bf16+flash"]  # fmt: skip
CONFIGS = [str(p) for p in sorted((ROOT / "examples" / "configs").glob("*.json"))] + ["/nonexistent.json", "/dev/null"]
PRESETS = ["gpt2", "llama3-8b", "llama3-70b", "qwen3-0.6b", "qwen3-8b", "gpt3-175b", "nope", "GPT2"]
GPUS = ["h100-sxm", "h200", "a100-40gb", "a100-80gb", "h100-pcie", "tpu"]
FORMATS = ["table", "json", "csv", "markdown", "xml"]

model_options = st.one_of(
    st.tuples(st.just("--params"), st.sampled_from(PARAMS)).map(list),
    st.tuples(st.just("--model"), st.sampled_from(PRESETS)).map(list),
    st.tuples(st.just("--config"), st.sampled_from(CONFIGS)).map(list),
    st.tuples(st.sampled_from(["1", "2", "4", "0"]), st.sampled_from(["64", "256", "1024", "100", "-3"]),
              st.sampled_from(["1", "4", "8", "3"])).map(lambda t: ["--layers", t[0], "--hidden", t[1], "--heads", t[2]]),
    st.just([]),
)  # fmt: skip


def flag(name: str, values: list[str]):
    return st.sampled_from(values).map(lambda v: [name, v])


def some(*options) -> st.SearchStrategy[list[str]]:
    """Any subset of the options, each with one generated value."""
    return st.lists(st.one_of(*options), max_size=6).map(lambda groups: [x for g in groups for x in g])


SWITCH = [st.just([f]) for f in ("--detail", "--bytes", "--explain", "--offload", "--sp", "--hybrid")]
estimate_options = some(
    flag("--seq", SEQS), flag("--micro-batch", COUNTS), flag("--grad-accum", ["1", "4", "0", "x"]),
    flag("--tricks", TRICKS), flag("--gpus", COUNTS), flag("--zero", ["0", "1", "2", "3", "5"]),
    flag("--optimizer", ["adamw", "sgd", "adam8bit", "lion"]), flag("--gpu", GPUS), flag("--tp", ["1", "2", "8", "3"]),
    flag("--pp", ["1", "2", "4"]), flag("--cp", ["1", "2"]), flag("--dp", ["1", "2", "0"]),
    flag("--units", ["gb", "gib", "tb"]), flag("--format", FORMATS), flag("--mfu", ["0.4", "1.5", "0", "x"]),
    flag("--calibration", ["matmul=0.5", "flash=1", "nope=1", "matmul=2"]), flag("--tokens", ["1e12", "0"]),
    flag("--sweep", ["seq=1k:4k", "micro-batch=1:4", "heads=1:2", "seq=4k:1k"]), flag("--host-memory", ["2T", "1e9", "0"]),
    *SWITCH,
)  # fmt: skip


def check(args: list[str], result) -> None:
    """The contract every call keeps."""
    where = f"memcalc {' '.join(args)}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (where, result.exception)
    assert result.exit_code in (0, 1, 2), (where, result.exit_code)
    if result.exit_code == 1:
        assert args[0] == "verify", (where, result.output)  # only verify fails a row
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > len("error: "), (where, lines)
    elif last_format(args) == "json":
        sane(json.loads(result.stdout), where)
    elif last_format(args) == "csv":
        sane_csv(result.stdout, where)


def last_format(args: list[str]) -> str:
    """The --format a call asked for (the last one wins), table by default."""
    return args[len(args) - 1 - args[::-1].index("--format") + 1] if "--format" in args else "table"


def sane_csv(text: str, where: str) -> None:
    """A CSV's byte columns are whole, non-negative numbers (or empty, where the textbook has no formula)."""
    for row in csv.DictReader(io.StringIO(text)):
        for key, value in row.items():
            if key and key.endswith("bytes") and value not in ("", None):
                assert float(value) >= 0 and float(value).is_integer(), (where, key, value)


CHANGES = ("free_bytes", "saves_bytes", "saves_alone_bytes")  # signed: below 0, over by (or costs) that much


def sane(value, where: str, key: str = "") -> None:
    """No NaN or infinity anywhere, and no negative byte count but in the fields named as changes."""
    if isinstance(value, dict):
        for k, v in value.items():
            sane(v, where, k)
    elif isinstance(value, list):
        for v in value:
            sane(v, where, key)
    elif isinstance(value, float):
        assert math.isfinite(value), (where, key, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith("bytes"):
        assert (value >= 0 or key in CHANGES) and float(value).is_integer(), (where, key, value)


# ---- every call keeps the contract ------------------------------------------------------------------


@examples(14, slow=60)
@given(model=model_options, options=estimate_options)
def test_estimate_answers_or_says_why_in_one_line(model, options):
    args = ["estimate", *model, *options]
    check(args, run(args))


@examples(3, slow=25)
@given(model=model_options, options=some(flag("--seq", SEQS), flag("--micro-batch", COUNTS), flag("--tricks", TRICKS),
                                         flag("--gpus", COUNTS), flag("--zero", ["0", "3"]), flag("--gpu", GPUS),
                                         flag("--format", FORMATS), flag("--host-memory", ["2T", "1"]), *SWITCH[:2]))  # fmt: skip
def test_fit_answers_or_says_why(model, options):
    args = ["fit", *model, *options]
    check(args, run(args))


@examples(3, slow=15)
@given(model=model_options, gpus=st.sampled_from(["8", "16", "64", "0", "x", "3"]),
       batch=st.sampled_from(["8", "64", "512", "0", "7"]),
       options=some(flag("--seq", ["1024", "4k", "0"]), flag("--tricks", ["bf16,flash", "bf16", "bf16,flash,selective",
                                                                            "fp32", "bf16,ckpt"]),
                    flag("--format", FORMATS), flag("--top", ["1", "3", "0"]), flag("--mfu", ["0.4", "2"]), *SWITCH[:2]))  # fmt: skip
def test_plan_answers_or_says_why(model, gpus, batch, options):
    args = ["plan", *model, "--gpus", gpus, "--global-batch", batch, *options]
    check(args, run(args))


@examples(25)
@given(model=model_options, options=some(
    flag("--seq", SEQS), flag("--tokens-per-sec", ["1000", "1e9", "0", "-1", "x"]), flag("--step-time", ["10", "0"]),
    flag("--global-batch", ["64", "0"]), flag("--gpus", ["8", "0"]), flag("--tricks", TRICKS), flag("--gpu", GPUS),
    flag("--format", FORMATS)))  # fmt: skip
def test_mfu_answers_or_says_why(model, options):
    args = ["mfu", *model, *options]
    check(args, run(args))


@examples(12)
@given(command=st.sampled_from(["presets", "gpus", "formats", "--version", "", "nope", "estimate --nope"]),
       fmt=st.sampled_from(FORMATS + [None]))  # fmt: skip
def test_the_other_commands_answer_or_say_why(command, fmt):
    args = command.split() + (["--format", fmt] if fmt and command in ("presets", "gpus", "formats") else [])
    check(args, run(args))


@examples(4, slow=8)
@given(layers=st.sampled_from(["1", "2"]), hidden=st.sampled_from(["64", "128", "60"]), heads=st.sampled_from(["4", "2"]),
       kv=st.sampled_from([None, "1", "2", "3"]), seq=st.sampled_from(["32", "64", "0"]),
       tricks=st.sampled_from(["bf16", "bf16,flash", "bf16,flash,ckpt", "fp32", "bf16,selective", "fp16"]),
       fmt=st.sampled_from(["table", "json", "csv"]))  # fmt: skip
def test_verify_on_meta_passes_or_says_why(layers, hidden, heads, kv, seq, tricks, fmt):
    """verify on meta with tiny shapes (a few seconds each): exact equals measured, or one line of why."""
    args = ["verify", "--device", "meta", "--layers", layers, "--hidden", hidden, "--heads", heads,
            *(["--kv-heads", kv] if kv else []), "--seq", seq, "--tricks", tricks, "--format", fmt, "--no-linearity"]  # fmt: skip
    result = run(args)
    check(args, result)
    assert result.exit_code != 1, result.output  # on meta the exact prediction equals the measurement


# ---- the jobs people run: mostly valid combinations, every format one verdict ------------------------

VALID = st.fixed_dictionaries({
    "model": st.sampled_from([["--model", "llama3-8b"], ["--model", "gpt2"], ["--model", "qwen3-0.6b"],
                              ["--params", "70e9"], ["--model", "mixtral-8x7b"], ["--model", "llama3-70b"],
                              ["--layers", "4", "--hidden", "512", "--heads", "8"]]),
    "seq": st.sampled_from(["512", "1024", "2048", "4096", "8192"]),
    "gpus": st.sampled_from(["1", "2", "8", "64"]), "zero": st.sampled_from(["0", "1", "2", "3"]),
    "stack": st.sampled_from(["reference", "torch", "hf", "fsdp2", "megatron", "deepspeed"]),
    "tricks": st.sampled_from([None, "fp32", "bf16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective",
                               "bf16,flash,ckpt:2", "bf16,flash,sac"]),
    "offload": st.booleans(), "micro_batch": st.sampled_from(["1", "2"]),
})  # fmt: skip


def valid_args(job: dict) -> list[str]:
    args = [*job["model"], "--seq", job["seq"], "--gpus", job["gpus"], "--zero", job["zero"], "--stack", job["stack"],
            "--micro-batch", job["micro_batch"]]  # fmt: skip
    return args + (["--tricks", job["tricks"]] if job["tricks"] else []) + (["--offload"] if job["offload"] else [])


@examples(3, slow=12)
@given(job=VALID)
def test_the_jobs_people_run_give_one_verdict_in_every_format(job):
    """Issue 18: the defects lived in mostly valid combinations (ZeRO x GPUs x stack x tricks x offload): each
    is answered or refused in one line; JSON and CSV are sane; table, JSON and CSV say the same of every
    trick set (fits, and the peak) and of the job."""
    args = ["estimate", *valid_args(job)]
    result = run([*args, "--format", "json"])
    check([*args, "--format", "json"], result)
    if result.exit_code:
        return
    data = json.loads(result.stdout)
    table = run(args)
    check(args, table)
    rows = run([*args, "--format", "csv"])
    check([*args, "--format", "csv"], rows)
    verdicts = data["verdict"]
    assert len(verdicts) == len(data["trick_sets"]) and all(v["state_bytes"] >= 0 for v in verdicts)
    text = table.stdout.replace("\n", " ")
    if "peak_bytes" in rows.stdout.splitlines()[0]:  # a data-parallel job's: one row per trick set
        csv_rows = list(csv.DictReader(io.StringIO(rows.stdout)))
        assert [(r["fits"], int(r["peak_bytes"])) for r in csv_rows] == [(str(v["fits"]), v["peak_bytes"])
                                                                          for v in verdicts]  # fmt: skip
        assert text.count("Fits: ") == (1 if verdicts[0]["fits"] else 0), text
    for v in verdicts:  # what forward keeps for backward sits beside the weights (or shards) held through it
        p = v["phases"]
        assert p is None or v["peak_bytes"] >= p["weights_bytes"] + p["retained_bytes"], v


# ---- invariants across calls ------------------------------------------------------------------------

MODELS = [["--model", "llama3-8b"], ["--model", "gpt2"], ["--params", "70e9"], ["--model", "qwen3-0.6b"],
          ["--layers", "2", "--hidden", "256", "--heads", "4"]]  # fmt: skip


def estimate_json(args: list[str]) -> dict:
    result = run(["estimate", *args, "--format", "json"])
    assert result.exit_code == 0, (args, result.output)
    return json.loads(result.stdout)


def totals(data: dict) -> list[int]:
    """Per-GPU peaks: the verdict's (the replayed step), and the textbook's."""
    return [m["total_bytes"] for m in data["verdict"] + data["memory"]]


@examples(1, slow=20)
@given(model=st.sampled_from(MODELS), seq=st.sampled_from(["256", "1024"]), gpus=st.sampled_from([2, 4, 64]),
       zero=st.sampled_from([0, 1, 2]), offload=st.booleans())  # fmt: skip
def test_a_higher_zero_stage_never_raises_memory(model, seq, gpus, zero, offload):
    """Stages 1 and 2 only take state off a GPU. Stage 3 also gathers each unit back (the running block and
    the prefetched one): on a model of a few layers over few GPUs that outweighs the weights it shards, as
    FSDP's own shard beside the gathered copy does, and the replay says so; on a deep model it never does."""
    if zero == 2 and "--layers" in model:
        zero = 1
    offload = offload and zero >= 1  # offload over several GPUs needs ZeRO >= 1
    base = [*model, "--seq", seq, "--gpus", str(gpus), *(["--offload"] if offload else [])]
    lower, higher = estimate_json([*base, "--zero", str(zero)]), estimate_json([*base, "--zero", str(zero + 1)])
    assert all(h <= lo for h, lo in zip(totals(higher), totals(lower))), (base, zero)


@examples(2, slow=20)
@given(model=st.sampled_from(MODELS), seq=st.sampled_from(["256", "1024"]), gpus=st.sampled_from([1, 2, 8]),
       factor=st.sampled_from([2, 4, 16]), zero=st.sampled_from([1, 2, 3]))  # fmt: skip
def test_more_gpus_under_zero_never_raise_memory(model, seq, gpus, factor, zero):
    base = [*model, "--seq", seq, "--zero", str(zero)]
    few, many = estimate_json([*base, "--gpus", str(gpus)]), estimate_json([*base, "--gpus", str(gpus * factor)])
    assert all(m <= f for m, f in zip(totals(many), totals(few))), (base, gpus, factor)


@examples(1, slow=15)  # each fit near a card's limit replays the caching allocator some 10 times: CI runs 15
@given(model=st.sampled_from(MODELS[:4]), tricks=st.sampled_from(["bf16", "bf16,flash", "bf16,flash,ckpt"]),
       gpu=st.sampled_from(["h100-sxm", "a100-40gb", "h200"]))  # fmt: skip
def test_fit_answers_what_estimate_says_fits(model, tricks, gpu):
    seq = "1024" if "gpt2" in model else "2048"
    result = run(["fit", *model, "--seq", seq, "--tricks", tricks, "--gpu", gpu, "--format", "json"])
    assert result.exit_code == 0, result.output
    limits = json.loads(result.stdout)
    if not limits["max_seq_len"]:
        return
    at = [*model, "--tricks", tricks, "--gpu", gpu]
    # fit solves for estimate's verdict: the replayed step
    assert estimate_json([*at, "--seq", str(limits["max_seq_len"])])["verdict"][0]["fits"]
    if not limits["seq_capped"]:  # a clearly longer sequence does not fit (unless the position table stops it)
        assert not estimate_json([*at, "--seq", str(2 * limits["max_seq_len"])])["verdict"][0]["fits"]
    if limits["max_micro_batch"]:
        assert estimate_json([*at, "--seq", seq, "--micro-batch", str(limits["max_micro_batch"])])["verdict"][0]["fits"]
        over = estimate_json([*at, "--seq", seq, "--micro-batch", str(2 * limits["max_micro_batch"])])
        assert not over["verdict"][0]["fits"]


def layout_args(best: dict) -> list[str]:
    """The options that make `estimate` compute one of plan's layouts."""
    lay, setup = best["layout"], best["setup"]
    tricks = [t for t in best["tricks"] if t not in ("ckpt", "selective")]
    recompute = next((t for t in best["tricks"] if t in ("ckpt", "selective")), None)
    args = ["--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--cp", str(lay["cp"]), "--dp", str(lay["dp"]),
            "--zero", str(lay["zero"]), "--vpp", str(lay["vpp"]), "--gpus", str(lay["world"]),
            "--gpus-per-node", str(lay["gpus_per_node"]), "--micro-batch", str(setup["micro_batch"]),
            "--grad-accum", str(setup["grad_accum"]), "--tricks", ",".join(tricks + ([recompute] if recompute else []))]  # fmt: skip
    args += ["--sp"] * lay["sp"] + ["--hybrid"] * lay["hybrid"]
    args += ["--offload-params"] if lay["offload_params"] else ["--offload"] * lay["offload_optimizer"]
    return args


@examples(1, slow=6)
@given(model=st.sampled_from([["--model", "llama3-8b"], ["--model", "llama3-70b"], ["--params", "8e9"]]),
       gpus=st.sampled_from(["8", "16", "64"]), batch=st.sampled_from(["16", "64"]),
       seq=st.sampled_from(["2048", "8192"]))  # fmt: skip
def test_plan_layouts_rerun_through_estimate_give_the_same_numbers(model, gpus, batch, seq):
    result = run(["plan", *model, "--gpus", gpus, "--global-batch", batch, "--seq", seq, "--top", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    for best in json.loads(result.stdout)["best"]:
        again = estimate_json([*model, "--seq", seq, *layout_args(best)])
        assert again["verdict"][0]["total_bytes"] == best["verdict"]["total_bytes"]  # what plan ranked it by
        assert again["time"][0]["tokens_per_second"] == best["time"]["tokens_per_second"]
