"""The command line through typer's CliRunner, and once as a real process."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memcalc.cli import app, main

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
MAIN_JOB = ["estimate", "--params", "8e9", "--seq", "8192"]


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


@pytest.fixture(scope="module")
def main_table():
    result = run(*MAIN_JOB, "--detail")
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def short():
    result = CliRunner().invoke(app, MAIN_JOB, env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_default_answers_within_25_lines_of_100_columns(short):
    lines = short.splitlines()
    assert len(lines) <= 25 and max(len(x) for x in lines) <= 100, short
    # ZeRO-2 over 2 GPUs: 83.15 GB of tensors, which the caching allocator replayed holds in 84.71 GB of the
    # 84.87 GB its room leaves on each (docs/gpus.md)
    assert "Cheapest combination that fits: bf16+flash+ckpt, ZeRO-2 over 2 GPUs -> 84.71 GB per GPU." in \
        " ".join(lines[-2:])  # the answer comes last, wrapped to the width
    again = run(*MAIN_JOB, "--tricks", "bf16,flash,ckpt", "--gpus", "2", "--zero", "2").stdout  # that job, estimated
    assert "Fits: bf16+flash+ckpt reserves 84.71 GB at its peak (83.15 GB of tensors)" in again.replace("\n", " ")
    # one row per trick set: the replayed step's state, what else is live at its peak, the peak, whether it fits
    # (exact: = verify's meta measurement, tests/test_verify_meta.py), the textbook's total, step time, MFU
    # over the 85.00 GB the CUDA context and cuBLAS leave the caching allocator
    for row in ("fp32             98.36 GB   446.0 GB  544.4 GB  no, 459.4 GB over  988.2 GB    14.10 s  51.9%",
                "bf16+flash+ckpt  114.7 GB   20.12 GB  134.8 GB  no, 49.78 GB over  139.0 GB     1.81 s  27.4%"):
        assert row in short
    assert " B\n" not in short and "Where the step time goes" not in short  # exact bytes and detail on request


def test_bytes_adds_exact_counts_and_detail_adds_every_section(short, main_table):
    exact = run(*MAIN_JOB, "--bytes").stdout
    assert "3,556,769,792" not in short and "134,785,875,968 B" in exact  # the peak's exact bytes
    assert len(exact.splitlines()) < len(main_table.splitlines())
    for title in ("Model state:", "Activations, textbook", "Logits and loss", "Step time on the h100-sxm",
                  "Where the step time goes", "slowest operations", "the toolbox, cheapest first"):
        assert title in main_table and title not in short


@pytest.mark.parametrize("number", [
    "128,000,000,000", "16,000,000,000", "32,000,000,000",  # model state and its parts
    "134,217,728", "10,737,418,240", "11,878,268,928",  # one head, the s×s part, one layer
    "427,617,681,408", "855,235,362,816",  # 36 layers bf16, fp32
    "1,140,850,688", "41,070,624,768",  # flash
    "67,108,864", "2,415,919,104", "3,556,769,792",  # ckpt, its peak
    "48,000,000,000", "64,000,000,000", "+33.3%", "14.8x",  # 6N, 8N, BF16/FP32 on the H100
])  # fmt: skip
def test_main_job_shows_every_golden_number(main_table, number):
    assert number in main_table


def test_main_job_says_which_shape_it_assumed(main_table):
    assert "canonical qwen3-8b shape (36 layers, hidden 4096, 32 heads" in main_table


@pytest.fixture(scope="module")
def main_json():
    result = run(*MAIN_JOB, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_schema(main_json):
    assert main_json["model_state"]["total_bytes"] == 128_000_000_000
    assert main_json["flops"]["per_token"] == 48_000_000_000
    rows = main_json["activations"]
    assert [r["tricks"] for r in rows] == [["fp32"], ["bf16"], ["bf16", "flash"], ["bf16", "flash", "ckpt"],
                                           ["bf16", "selective"]]  # fmt: skip
    for row in rows:
        assert {"per_layer_bytes", "total_bytes", "peak_bytes", "terms"} <= row.keys()
    assert rows[3]["peak_bytes"] == 3_556_769_792
    assert main_json["memory"][0]["fits"] is False
    assert main_json["toolbox"]["steps"][0]["name"] == "bf16 mixed precision"


def test_tricks_picks_one_combination():
    result = run(*MAIN_JOB, "--tricks", "bf16,flash,ckpt", "--format", "json")
    data = json.loads(result.stdout)
    assert [r["tricks"] for r in data["activations"]] == [["bf16", "flash", "ckpt"]]
    assert data["activations"][0]["total_bytes"] == 2_415_919_104


def test_markdown_and_csv():
    md = run(*MAIN_JOB, "--format", "markdown", "--detail")
    assert md.exit_code == 0
    assert "| bf16+flash+ckpt |" in md.stdout and "### Model state" in md.stdout
    out = run(*MAIN_JOB, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert [r["tricks"] for r in rows] == ["fp32", "bf16", "bf16+flash", "bf16+flash+ckpt", "bf16+selective"]
    assert rows[1]["activations_total_bytes"] == "427617681408"


def test_units_gib():
    out = run(*MAIN_JOB, "--tricks", "bf16", "--units", "gib", "--detail")
    assert "398.2 GiB" in out.stdout  # 427,617,681,408 B = 398.25 GiB


def test_explain_shows_formulas_with_numbers():
    out = run(*MAIN_JOB, "--explain", "--zero", "3", "--gpus", "8")
    assert out.exit_code == 0, out.output
    assert "kept per layer = 369,098,752 + 10,737,418,240 + 637,534,208 + 134,217,728 = 11,878,268,928 B" in out.stdout
    assert "MLP: 19·s·b·h = 19·8,192·1·4,096 = 637,534,208 B" in out.stdout
    assert "weights: ⌈(2·N)/G⌉ = ⌈(2·8,000,000,000)/8⌉ = 2,000,000,000 B" in out.stdout
    assert "6·N = 6·8,000,000,000 = 48,000,000,000 FLOPs" in out.stdout
    assert "peak = 2,415,919,104 + one layer rebuilt" in out.stdout


@pytest.mark.slow("test_docs_numbers.py::test_fit_solves_the_step_as_it_accumulates (fit's limits, a small model)")
def test_fit_command():
    out = run("fit", "--params", "8e9", "--seq", "8192", "--tricks", "bf16,flash,ckpt", "--gpu", "h200",
              "--format", "json")  # fmt: skip
    data = json.loads(out.stdout)
    assert data["max_seq_len"] > 8192 and data["max_micro_batch"] >= 1
    over = run("fit", "--model", "llama3-70b", "--gpu", "a100-40gb", "--format", "json")
    assert json.loads(over.stdout)["max_seq_len"] == 0  # 70B of model state never fits 40 GB


@pytest.mark.parametrize("command", ["formats", "gpus", "presets"])
@pytest.mark.parametrize("fmt", ["table", "json", "markdown", "csv"])
def test_reference_commands(command, fmt):
    out = run(command, "--format", fmt)
    assert out.exit_code == 0, out.output
    assert out.stdout.strip()


def test_formats_shows_the_demonstrations():
    out = run("formats").stdout
    assert "65504" in out and "0.0078125" in out and "448" in out and "57344" in out
    data = json.loads(run("formats", "--format", "json").stdout)
    assert data["rounding"]["bf16_sum"] == 1.0 and data["rounding"]["fp32_sum"] > 1.0
    assert data["underflow"]["fp16_grad"] == 0.0 and data["underflow"]["fp16_scaled"] > 0
    assert data["accumulation"]["bf16_rel_error"] > 1000 * data["accumulation"]["fp32_rel_error"]


BAD_INPUT = [
    (["estimate", "--params", "0"], "params must be positive"),
    (["estimate", "--params", "-8e9"], "params must be positive"),
    (["estimate", "--params", "nan"], "finite"),
    (["estimate", "--params", "eight"], "must be a number"),
    (["estimate", "--params", "1e30"], "absurdly large"),
    (["estimate", "--params", "8e9", "--seq", "0"], "seq must be positive"),
    (["estimate", "--params", "8e9", "--seq", "-1"], "seq must be positive"),
    (["estimate", "--params", "8e9", "--seq", "lots"], "seq must be a number"),
    (["estimate", "--params", "8e9", "--micro-batch", "0"], "micro-batch must be positive"),
    (["estimate", "--params", "8e9", "--seq", "1e12"], "absurdly large"),
    (["estimate", "--params", "8e9", "--heads", "33"], "must divide hidden"),
    (["estimate", "--params", "8e9", "--kv-heads", "5"], "must divide heads"),
    (["estimate", "--model", "gpt5"], "unknown model 'gpt5'"),
    (["estimate", "--params", "8e9", "--tricks", "bf16,turbo"], "unknown trick 'turbo'"),
    (["estimate", "--params", "8e9", "--tricks", "fp32,flash"], "fp32,flash is Transformers"),
    (["estimate", "--params", "8e9", "--tricks", "fp32,bf16"], "choose one precision"),
    (["estimate", "--params", "8e9", "--tricks", "ckpt,selective"], "drop selective or ckpt"),
    (["estimate", "--params", "8e9", "--gpu", "tpu-v5"], "unknown GPU 'tpu-v5'"),
    (["estimate", "--params", "8e9", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["estimate", "--params", "8e9", "--zero", "4"], "zero stage must be"),
    (["estimate", "--params", "8e9", "--mfu", "1.5"], "mfu must be a fraction"),
    (["estimate", "--params", "8e9", "--mfu", "nan"], "mfu must be a fraction"),
    (["estimate", "--params", "8e9", "--format", "xml"], "unknown format"),
    (["estimate", "--params", "8e9", "--units", "tb"], "unknown units"),
    (["estimate", "--params", "8e9", "--model", "gpt2"], "give one of"),
    (["estimate"], "say which model"),
    (["estimate", "--config", "no/such/config.json"], "config file not found"),
    (["estimate", "--params", "8e9", "--bogus"], "No such option"),
    (["estimate", "--params"], "requires an argument"),
    (["fit", "--params", "8e9", "--tricks", "bf16,warp"], "unknown trick"),
    # the rest of docs/options.md's "Bad input" list
    (["estimate", "--params", "2e12"], "the canonical shapes cover"),
    (["estimate", "--params", "8e9", "--tp", "3", "--gpus", "3"], "must divide the 32 attention heads"),
    (["estimate", "--params", "8e9", "--tp", "2", "--gpus", "3"], "do not split into tp 2"),
    (["estimate", "--params", "8e9", "--pp", "2", "--gpus", "8", "--zero", "3"], "ZeRO-3 with pipeline parallel"),
    (["estimate", "--params", "8e9", "--offload", "--gpus", "2"], "needs ZeRO >= 1"),
    (["estimate", "--params", "8e9", "--reshard"], "drop it"),
    (["estimate", "--model", "llama3-8b", "--pp", "3", "--vpp", "2", "--gpus", "3"], "must divide the 32 layers"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert result.stdout == ""


def test_a_pp_that_does_not_divide_the_layers_is_answered():
    """docs/options.md said exit 2; the stages are split as torchtitan splits them: 32 layers as 11, 11, 10."""
    data = json.loads(run("estimate", "--model", "llama3-8b", "--pp", "3", "--gpus", "3", "--tricks", "bf16,flash",
                          "--format", "json").stdout)  # fmt: skip
    assert [stage["layers"] for stage in data["stages"][0]] == [11, 11, 10]  # the one trick set's stages


@pytest.mark.parametrize("content", ["{", "[]", '"text"'])
def test_malformed_config_is_one_line(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    result = run("estimate", "--config", str(path))
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1


def test_warnings_go_to_stderr():
    result = run("estimate", "--params", "8e9", "--tricks", "bf16,flash,selective", "--format", "json")
    json.loads(result.stdout)  # stdout stays parseable
    assert result.stderr.startswith("warning: bf16+flash+selective: selective recompute saves nothing")


ENV = {**os.environ, **WIDE, "PYTHONPATH": os.getcwd()}


def test_python_dash_m_from_a_checkout():
    out = subprocess.run([sys.executable, "-m", "memcalc", *MAIN_JOB, "--tricks", "bf16,flash,ckpt", "--detail"],
                         capture_output=True, text=True, env=ENV, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "3,556,769,792" in out.stdout


def test_main_builds_the_command_asked_for_alone(monkeypatch, capsys):
    # main() builds only the named command (start-up); its answer is the whole app's
    monkeypatch.setattr(sys, "argv", ["memcalc", "gpus", "--format", "json"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    assert json.loads(capsys.readouterr().out) == json.loads(run("gpus", "--format", "json").stdout)


def test_estimate_never_imports_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from memcalc.cli import app\n"
        "r = CliRunner().invoke(app, ['estimate', '--params', '8e9', '--seq', '8192'])\n"
        "assert r.exit_code == 0, r.output\n"
        "r = CliRunner().invoke(app, ['estimate', '--params', '8e9', '--format', 'json'])\n"
        "heavy = [m for m in ('torch', 'numpy', 'verify') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_cached_verdict_never_loads_the_simulator(tmp_path):
    # the verdict's replay is kept on disk (memcalc.exact.base.cache): a second run reads it, and imports
    # neither the simulator's ops and models nor any library the stacks are checked against
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from memcalc.cli import app\n"
        "r = CliRunner().invoke(app, ['estimate', '--params', '8e9', '--seq', '8192'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print([m for m in ('memcalc.exact.aten', 'memcalc.exact.replay.meta', 'memcalc.exact.hf.model',\n"
        "                   'transformers', 'bitsandbytes', 'torch') if m in sys.modules])\n"
    )
    env = {**ENV, "MEMCALC_CACHE": str(tmp_path)}
    first, second = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
                     for _ in range(2))  # fmt: skip
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "memcalc.exact.aten" in first.stdout  # the first run replays
    assert second.stdout.strip() == "[]"


def test_plan_ranks_layouts_that_fit():
    out = run("plan", "--model", "llama3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--seq", "8192",
              "--global-batch", "512", "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["fitting"] > 0 and len(data["best"]) == 5
    speeds = [float(f"{b['time']['tokens_per_second']:.4g}") for b in data["best"]]  # plan's equal speed: 4 digits
    assert speeds == sorted(speeds, reverse=True)
    for best in data["best"]:
        assert best["memory"]["fits"] and best["layout"]["tp"] * best["layout"]["pp"] * best["layout"]["cp"] * \
            best["layout"]["dp"] == 64  # fmt: skip
    table = run("plan", "--model", "llama3-70b", "--gpus", "64", "--seq", "8192", "--global-batch", "512", "--detail")
    assert "Why the obvious alternatives lose" in table.stdout and "out of memory" in table.stdout


def test_estimate_with_a_layout():
    out = run("estimate", "--model", "gpt3-175b", "--seq", "2048", "--tp", "8", "--sp", "--pp", "8", "--gpus", "64",
              "--zero", "1", "--grad-accum", "16", "--tricks", "bf16,selective", "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    (stages,) = data["stages"]  # one trick set, its 8 pipeline stages
    assert data["layout"]["dp"] == 1 and len(stages) == 8
    # Korthikanti et al. 2022 Table 2, TP+SP+selective: 34·s·b·h/t per layer
    assert stages[0]["layer"]["per_layer_bytes"] == 34 * 2048 * 12288 // 8
    assert data["memory"][0]["total_bytes"] == max(st["total_bytes"] for st in stages)
    table = run("estimate", "--params", "8e9", "--seq", "8192", "--tp", "2", "--gpus", "8")
    assert table.exit_code == 0 and "bf16+flash+ckpt" in table.stdout


@pytest.mark.parametrize("args,message", [
    (["estimate", "--params", "8e9", "--tp", "3"], "must divide the 32 attention heads"),
    (["estimate", "--params", "8e9", "--pp", "32"], "leaves a stage without layers"),  # 36 layers + 2 over 32 stages
    (["estimate", "--params", "8e9", "--tp", "2", "--dp", "2", "--gpus", "8"], "world size"),
    (["estimate", "--params", "8e9", "--sp"], "sequence parallel needs tensor parallel"),
    (["estimate", "--params", "8e9", "--pp", "2", "--dp", "2", "--zero", "3"], "unsupported"),
    (["estimate", "--params", "8e9", "--gpus", "8", "--offload"], "needs ZeRO >= 1"),
    (["plan", "--params", "8e9", "--gpus", "0", "--global-batch", "8"], "gpus must be positive"),
    (["plan", "--params", "8e9", "--gpus", "8"], "Missing option"),
])  # fmt: skip
def test_bad_layouts_are_one_line(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_training_run_time_and_cost():
    out = run("estimate", "--params", "8e9", "--seq", "8192", "--tricks", "bf16,flash", "--gpus", "1024",
              "--zero", "3", "--tokens", "15e12", "--price-per-gpu-hour", "2", "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    (r,) = data["runs"]
    (time,) = data["time"]  # the roofline's, by default: the job's rate, 1024 GPUs of one GPU's
    assert data["time_model"] == "roofline" and time["gpus"] == 1024
    assert r["seconds"] == pytest.approx(15e12 / time["tokens_per_second"])
    assert r["gpu_hours"] == pytest.approx(r["seconds"] * 1024 / 3600)
    assert r["cost"] == pytest.approx(2 * r["gpu_hours"])
    table = run("estimate", "--params", "8e9", "--tokens", "1e12")
    assert "Training run: 1,000,000,000,000 tokens on 1 GPU" in table.stdout
    bad = run("estimate", "--params", "8e9", "--price-per-gpu-hour", "2")
    assert bad.exit_code == 2 and "needs --tokens" in bad.stderr
    legacy = json.loads(run("estimate", "--params", "8e9", "--tricks", "bf16,flash", "--mfu", "0.4", "--tokens", "1e12",
                            "--format", "json").stdout)  # fmt: skip
    assert legacy["time_model"] == "mfu" and legacy["roofline"] == [] and legacy["calibration"] is None
    assert legacy["runs"][0]["tokens_per_second"] == pytest.approx(legacy["time"][0]["tokens_per_second"])


def test_exact_beside_textbook():
    out = run(*MAIN_JOB, "--exact", "--format", "json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [x["tricks"] for x in data["exact"]] == [a["tricks"] for a in data["activations"]]
    flash = data["exact"][2]["activations"]
    # the Qwen3-8B layer with flash saves more than the textbook's 34·s·b·h: SwiGLU and fp32 RMSNorm copies
    assert flash["per_layer_bytes"] > data["activations"][2]["per_layer_bytes"]
    assert all(t["source"] for t in flash["terms"])  # every exact term names its op
    table = run(*MAIN_JOB, "--exact", "--bytes")
    assert "Textbook against exact for this llama-family model" in table.stdout
    assert "134,785,875,968 B" in table.stdout  # bf16+flash+ckpt's whole-step peak, as verify measures it


def test_exact_with_a_layout_is_the_tp_shard_op_by_op():
    from memcalc.cli.groups import ModelOptions
    from memcalc.model.layout import Layout
    from memcalc.model.tricks import parse_tricks
    from memcalc.verification.distributed import block_terms

    args = ["estimate", "--model", "llama3-8b", "--seq", "4096", "--tp", "4", "--sp", "--gpus", "4",
            "--tricks", "bf16,flash", "--exact"]  # fmt: skip
    out = run(*args, "--format", "json")
    assert out.exit_code == 0, out.output
    terms = json.loads(out.stdout)["exact"][0]
    expected = block_terms(ModelOptions(model="llama3-8b").resolve().shape, 4096, 1, parse_tricks("bf16,flash"),
                           Layout(tp=4, sp=True))  # fmt: skip
    assert sum(t["value"] for t in terms) == sum(t.value for t in expected)
    assert "textbook against exact for this architecture" in run(*args).stdout
    bad = run("estimate", "--params", "8e9", "--cp", "2", "--gpus", "2", "--tricks", "bf16,flash", "--exact")
    assert bad.exit_code == 2 and "ring attention" in bad.stderr


def test_exact_explain_names_every_symbol_of_the_exact_terms():
    """Issue 10, defect 6: the exact terms use k (KV heads) and f (MLP width), which --explain lacked (KeyError)."""
    out = run("estimate", "--model", "llama3-8b", "--seq", "4096", "--tricks", "bf16,flash", "--exact", "--explain")
    assert out.exit_code == 0, out.output
    assert "k = 8, f = 14,336" in out.stdout
    assert "saves key (bf16): 2·b·k·s·d = 2·1·8·4,096·128 = 8,388,608 B" in out.stdout


@pytest.mark.parametrize("args", [
    "estimate --params 8e9 --seq 8192 --detail --explain",
    "estimate --params 8e9 --seq 8192 --bytes --mfu 0.4 --detail",
    "estimate --model llama3-8b --seq 8192 --exact --detail --explain",
    "estimate --model llama3-70b --seq 8192 --tp 8 --pp 2 --gpus 64 --sp --tricks bf16,flash --detail --explain --exact",
    "estimate --model llama3-70b --seq 8192 --tp 8 --pp 2 --gpus 64 --sp",
    "estimate --model llama3-8b --seq 1024 --sweep seq=1k:8k --tricks bf16,flash",
    "estimate --params 70e9 --seq 4096 --tokens 15e12 --price-per-gpu-hour 2 --detail",
    "plan --model llama3-70b --gpus 64 --global-batch 512 --seq 8192 --detail",
    "fit --model llama3-8b --gpu h200 --detail",
    "mfu --model llama3-8b --tokens-per-sec 4000 --seq 8192",
    "presets", "gpus", "formats",
    "verify --device meta --layers 2 --hidden 256 --heads 4 --seq 128 --detail",
])  # fmt: skip
def test_no_line_is_wider_than_a_100_column_terminal(args):
    out = CliRunner().invoke(app, args.split(), env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    wide = [line for line in out.stdout.splitlines() if len(line) > 100]
    assert not wide, "\n".join(wide)
