"""What the command line makes of what users type: each test names the defect of issue 10 it pins."""

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model.sizes import parse_count, parse_seq

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def run(*args):
    return CliRunner().invoke(app, list(args), env=ENV)


def as_json(*args):
    out = run(*args, "--format", "json")
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


@pytest.mark.parametrize("text, tokens", [("8k", 8192), ("32K", 32768), ("1m", 1 << 20), ("8192", 8192),
                                          ("0.5k", 512), ("128_000", 128_000)])  # fmt: skip
def test_sequence_lengths_take_binary_suffixes(text, tokens):
    """Defect 12: --seq 8k meant 8,000; every model card's 8k context is 8,192 tokens."""
    assert parse_seq(text) == tokens


def test_counts_stay_decimal():
    """Defect 12: parameters and training tokens keep decimal suffixes (70B, 15T)."""
    assert parse_count("70B", "params", 1e15) == 70_000_000_000
    assert parse_count("8k", "gpus") == 8000
    with pytest.raises(InputError, match="seq must be a number"):
        parse_seq("8b")  # a billion-token sequence is not what anyone means


def test_every_sequence_option_reads_8k_as_8192():
    """Defect 12, through each command that takes a sequence length."""
    assert as_json("estimate", "--params", "8e9", "--seq", "8k", "--tricks", "bf16")["setup"]["seq_len"] == 8192
    assert as_json("fit", "--params", "8e9", "--seq", "4k")["seq_len"] == 4096
    assert as_json("mfu", "--params", "8e9", "--seq", "8k", "--tokens-per-sec", "1000")["seq_len"] == 8192
    swept = as_json("estimate", "--params", "8e9", "--tricks", "bf16,flash", "--sweep", "seq=1k:4k")
    assert [p["value"] for p in swept["points"]] == [1024, 2048, 4096]
    plan = as_json("plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--seq", "1k")
    assert plan["seq_len"] == 1024


def test_verify_without_torch_says_how_to_install_it():
    """Defect 2: after the README's first command (no torch), verify printed a rich traceback."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"  # torch absent: import fails, find_spec finds nothing
            "from memcalc.cli import main\n"
            "sys.argv = ['memcalc', 'verify', '--device', 'meta', '--model', 'gpt2', '--seq', '64']\n"
            "main()\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: memcalc verify needs PyTorch: pip install 'memcalc[verify]'"


@pytest.mark.parametrize("path, message", [
    ("s.txt", "give a path ending in .png"),
    ("plot", "give a path ending in .png"),  # matplotlib would have written plot.png beside it
    ("missing-folder/s.png", "does not exist"),
])  # fmt: skip
def test_png_paths_are_checked_before_the_work(tmp_path, monkeypatch, path, message):
    """Defect 3: --png s.txt crashed; --png DIR wrote DIR.png beside it without a word."""
    monkeypatch.chdir(tmp_path)
    out = run("estimate", "--model", "gpt2", "--seq", "1024", "--sweep", "seq=512:1k", "--png", path)
    assert out.exit_code == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_png_in_a_folder_is_refused_and_the_written_path_is_said(tmp_path, monkeypatch):
    """Defect 3 and 13: a folder named x.png is refused; where the image went is printed, in --units."""
    (tmp_path / "d.png").mkdir()
    out = run("estimate", "--model", "gpt2", "--seq", "1024", "--sweep", "seq=512:1k", "--png", str(tmp_path / "d.png"))
    assert out.exit_code == 2 and "is a folder" in out.stderr
    drawn = []
    monkeypatch.setattr("memcalc.report.plot.save_png", lambda sw, path, units: drawn.append((path, units)))
    target = str(tmp_path / "sweep.png")
    out = run("estimate", "--model", "gpt2", "--seq", "1024", "--sweep", "seq=512:1k", "--png", target, "--units", "gib")
    assert out.exit_code == 0, out.output
    assert drawn == [(target, "gib")] and f"wrote {target}" in out.stderr


@pytest.mark.parametrize("args", [
    "estimate --params 8e9 --seq 8192 --detail --gpus 8 --zero 3 --offload",
    "estimate --model llama3-70b --seq 8192 --tp 8 --pp 2 --gpus 64 --sp --detail",
    "plan --model llama3-70b --gpus 64 --global-batch 512 --seq 8192 --detail",
    "fit --model llama3-8b --detail",
])  # fmt: skip
def test_units_gib_reaches_every_line(args):
    """Defect 13: --units gib still printed GB in the GPU line, the model-state footer and plan's notes."""
    out = run(*args.split(), "--units", "gib")
    assert out.exit_code == 0, out.output
    assert " GB" not in out.stdout.replace(" GB/s", "") and " GiB" in out.stdout


def test_mfu_above_100_percent_is_explained_or_refused():
    """Defect 10: MFU 161.9% and 4,871,746% were printed without a word."""
    out = run("estimate", "--params", "8e9", "--seq", "1000000", "--calibration", "flash=1", "--tricks", "bf16,flash")
    assert out.exit_code == 0 and "above 100% because these count every query against every key" in out.stderr
    impossible = run("mfu", "--params", "8e9", "--seq", "8192", "--tokens-per-sec", "1e9")
    assert impossible.exit_code == 2 and "physically impossible" in impossible.stderr
    # long sequences: non-causal conventions pass 100% while the causal work still fits the peak
    from memcalc.model.flops import attention_flops, model_per_token
    from memcalc.model.presets import canonical_shape

    shape, seq = canonical_shape(8_000_000_000), 131072
    least = model_per_token(shape, seq) - attention_flops(shape, seq) // 2
    rate = 0.95 * 989e12 / least
    over = run("mfu", "--params", "8e9", "--seq", "128k", "--tricks", "bf16,flash", "--tokens-per-sec", f"{rate:.6g}")
    assert over.exit_code == 0 and "above 100% of peak under" in over.stderr and "causal" in over.stderr


def test_counts_and_times_read_as_people_write_them():
    """Defect 20: '1 layers', '1 GPU(s)', '2165.88 s'; parameter counts below a million as '0.0M'."""
    from memcalc.report import units as u

    assert u.seconds(2165.88) == "36.1 min" and u.seconds(11.17) == "11.17 s" and u.seconds(7200) == "2.0 h"
    assert u.params(124_439_808) == "124.4M" and u.params(5_000) == "5.0k" and u.params(12) == "12"
    out = run("estimate", "--layers", "1", "--hidden", "64", "--heads", "1", "--seq", "64", "--detail").stdout
    assert "  1 layer, hidden 64, 1 head (" in out and "1 GPU, ZeRO 0" in out and "all 1 layer " in out


def test_messages_say_what_to_change():
    """Defect 18: plan's "no recompute mode left to search"; bare memcalc's empty error line; no --version;
    a layout of several trick sets headed by the first alone."""
    out = run("plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--seq", "1024", "--tricks",
              "bf16,flash,selective")  # fmt: skip
    assert out.exit_code == 0 and "drop selective, or name ckpt" in out.stderr  # ranked, as every command computes it
    bare = run()
    assert bare.exit_code == 0 and "error" not in bare.output and "Commands" in bare.output
    version = run("--version")
    assert version.exit_code == 0 and version.stdout.startswith("memcalc 0.")
    layout = run("estimate", "--model", "llama3-8b", "--seq", "4096", "--tp", "2", "--gpus", "2")
    assert "Tricks: one row each: fp32, bf16, bf16+flash, bf16+flash+ckpt, bf16+selective" in layout.stdout


def test_verify_csv_holds_raw_numbers():
    """Defect 18: verify --format csv held the table's display strings ('1.192 GB')."""
    import csv
    import io

    out = run("verify", "--device", "meta", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128",
              "--format", "csv")  # fmt: skip
    assert out.exit_code == 0, out.output
    rows = {r["quantity"]: r for r in csv.DictReader(io.StringIO(out.stdout))}
    peak = rows["whole-step peak"]
    assert peak["unit"] == "bytes" and int(float(peak["exact"])) == int(float(peak["measured"])) > 0


def test_help_shows_what_it_says():
    """Defect 19: A:B:STEP rendered as an emoji; bracketed defaults vanished; fit --gpus named options fit
    does not take; --units cited "the lesson"."""
    wide = {"COLUMNS": "200", "NO_COLOR": "1"}
    help_text = CliRunner().invoke(app, ["estimate", "--help"], env=wide).stdout
    assert "🅱" not in help_text and "seq=1k:8k:1k (a step)" in help_text
    assert "[default: (1)]" in help_text and "[default: (8)]" in help_text and "lesson" not in help_text
    fit_help = CliRunner().invoke(app, ["fit", "--help"], env=wide).stdout
    assert "--tp" not in fit_help
    verify_help = CliRunner().invoke(app, ["verify", "--help"], env=wide).stdout
    assert "cuda when present, else meta" in verify_help and "0.03 on cuda" in verify_help


def test_gemma_is_geglu_and_verified_as_such(tmp_path):
    """Defect 20: Gemma was labelled (and simulated) SwiGLU; its MLP is GeGLU (gelu_pytorch_tanh)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gemma", "num_hidden_layers": 2, "hidden_size": 256,
                                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
                                  "intermediate_size": 512, "vocab_size": 1000}))  # fmt: skip
    out = run("estimate", "--config", str(config), "--seq", "128")
    assert out.exit_code == 0 and "GeGLU 512" in out.stdout and "SwiGLU" not in out.stdout
    checked = run("verify", "--device", "meta", "--config", str(config), "--seq", "128", "--tricks", "bf16,flash")
    assert checked.exit_code == 0 and "Pass: all" in checked.stdout, checked.output  # exact = meta, gelu and all


@pytest.mark.parametrize("args, message", [
    ("verify --params 8e9 --fsdp 8 --tol 0.01", "--tol applies to one GPU's verify"),
    ("verify --params 8e9 --tp 2 --save out", "add --matrix"),
    ("verify --params 8e9 --fsdp 8 --device cuda", "--device applies to one GPU's verify"),
    ("mfu --params 8e9 --tokens-per-sec 3000 --gpus 8", "per GPU already: drop --gpus"),
    ("estimate --params 8e9 --sweep seq=1k:4k --tokens 1e12", "drop --sweep or --tokens"),
    ("estimate --params 8e9 --explain --format json", "drop --explain"),
    ("estimate --params 8e9 --explain --format csv", "drop --explain"),
    ("estimate --params 8e9 --exact --optimizer sgd", "--optimizer sgd runs with --optimizer-impl loop or foreach"),
    ("estimate --params 8e9 --no-reshard --stack deepspeed --gpus 8 --zero 3", "not on deepspeed"),
    ("estimate --params 8e9 --reshard --stack reference", "not on reference"),
    ("estimate --params 8e9 --reshard --stack fsdp2 --tp 8 --gpus 8", "one data-parallel rank"),
    ("estimate --params 8e9 --gpus 8 --zero 3 --hybrid", "drop --hybrid"),
    ("estimate --params 8e9 --gpus 16 --tp 2 --zero 1 --hybrid --gpus-per-node 16", "drop --hybrid"),
    ("estimate --params 8e9 --gpus 8 --tp 8 --zero 1 --hybrid", "drop --hybrid"),
])  # fmt: skip
def test_options_that_would_be_ignored_are_refused(args, message):
    """Defect 15: each option either works or is refused with one line."""
    out = run(*args.split())
    assert out.exit_code == 2, out.output
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_exact_over_data_parallel_gpus_shows_the_layer_and_the_sharded_peak():
    """Issue 18: --exact --gpus 8 --zero 1 was refused; a layer saves what it saves on any data-parallel rank,
    and the step peak beside the textbook's is the job's (the verdict, sharded), not one GPU's."""
    out = run("estimate", "--params", "8e9", "--seq", "4096", "--exact", "--gpus", "8", "--zero", "1", "--tricks",
              "bf16,flash", "--format", "json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    (exact,), (verdict,) = data["exact"], data["verdict"]
    assert exact["activations"]["per_layer_bytes"] > 0 and verdict["total_bytes"] < exact["phases"]["optimizer_peak_bytes"]
    table = run("estimate", "--params", "8e9", "--seq", "4096", "--exact", "--gpus", "8", "--zero", "1", "--tricks",
                "bf16,flash")  # fmt: skip
    assert table.exit_code == 0 and "Textbook against exact" in table.stdout


def test_mfu_gpus_divides_the_step_time_only():
    """Defect 15: mfu --gpus 8 equalled --gpus 1; it applies to --step-time, where it divides the batch."""
    one = as_json("mfu", "--params", "8e9", "--seq", "8192", "--step-time", "100", "--global-batch", "64")
    eight = as_json("mfu", "--params", "8e9", "--seq", "8192", "--step-time", "100", "--global-batch", "64",
                    "--gpus", "8")  # fmt: skip
    assert one["tokens_per_second"] == 8 * eight["tokens_per_second"]


def test_python_verify_refuses_what_it_does_not_measure():
    """Defect 15: verify(..., Setup(grad_accum=2)) reported 2 and measured one micro-batch."""
    pytest.importorskip("torch")
    from memcalc import Setup, parse_tricks, preset_model
    from verify.run import verify

    with pytest.raises(InputError, match="grad_accum must be 1"):
        verify(preset_model("gpt2"), Setup(seq_len=64, grad_accum=2), parse_tricks("bf16"), device="meta")


@pytest.mark.parametrize("args", [
    "estimate --model gpt2 --seq 2048",
    "estimate --model gpt2 --seq 2048 --tp 2 --gpus 2",
    "estimate --model gpt2 --seq 1024 --sweep seq=512:2k",
    "plan --model gpt2 --gpus 8 --global-batch 8 --seq 2048",
    "mfu --model gpt2 --seq 2048 --tokens-per-sec 1000",
    "fit --model gpt2 --seq 2048",
    "estimate --model gpt2 --seq 2048 --exact",
])  # fmt: skip
def test_one_rule_for_a_sequence_past_the_position_table(args):
    """Defect 16: estimate warned, exact and verify refused, fit, plan and mfu said nothing."""
    out = run(*args.split())
    assert out.exit_code == 2
    assert out.stderr.strip() == ("error: seq 2,048 exceeds the 1,024 rows of gpt2's learned position table: "
                                  "give --seq 1024 or less")  # fmt: skip


def test_fit_stops_at_the_position_table():
    """Defect 16: fit --model gpt2 proposed 134,972 tokens."""
    data = as_json("fit", "--model", "gpt2", "--seq", "1024")
    assert data["max_seq_len"] == 1024 and data["seq_capped"]
    assert "the length of the model's position table" in run("fit", "--model", "gpt2", "--seq", "1024").stdout


OFFLOADED_405B = ["estimate", "--model", "llama3.1-405b", "--seq", "8192", "--gpus", "8", "--zero", "3",
                  "--offload-params", "--tricks", "bf16,flash,ckpt"]  # fmt: skip


def test_offload_is_charged_against_the_host_memory():
    """Defect 14: a 405B ZeRO-3 param-offload job on 8 GPUs "fit" while needing 812 GB of host RAM per GPU."""
    out = run(*OFFLOADED_405B)
    assert out.exit_code == 0, out.output
    assert "Does not fit" in out.stdout and "811.7 GB of host memory per GPU, of its 250.0 GB share" in out.stdout
    assert "no, host 561.7 GB over" in out.stdout  # the stage table's verdict


@pytest.mark.slow("test_offload_is_charged_against_the_host_memory (the same job, short of host memory)")
def test_offload_fits_with_the_host_memory_it_needs():
    roomy = run(*OFFLOADED_405B, "--host-memory", "8T")  # 8 TB for the node: 1 TB each
    assert "Fits:" in roomy.stdout


@pytest.mark.slow("test_offload_is_charged_against_the_host_memory (the verdict plan ranks by)")
def test_the_plan_says_offload_does_not_rescue_it():
    """Defect 14's plan: no 405B layout on 8 GPUs fits with 1 TB of host memory for the node, and it says why."""
    plan = ["plan", "--model", "llama3.1-405b", "--gpus", "8", "--global-batch", "8", "--seq", "8192",
            "--host-memory", "1T"]  # fmt: skip
    assert as_json(*plan)["fitting"] == 0
    assert "out of host memory" in run(*plan).stdout  # why offloading does not rescue it


@pytest.mark.parametrize("args, where", [
    ("estimate --model gpt2 --tricks bf16", ("setup", "seq_len")),
    ("fit --model gpt2", ("seq_len",)),
    ("mfu --model gpt2 --tokens-per-sec 1000", ("seq_len",)),
    ("plan --model gpt2 --gpus 8 --global-batch 8", ("seq_len",)),
])  # fmt: skip
def test_without_seq_a_short_position_table_is_the_default(args, where):
    """`memcalc estimate --model gpt2` exited 2: the default --seq 4096 is past GPT-2's 1,024 positions."""
    data = as_json(*args.split())
    for key in where:
        data = data[key]
    assert data == 1024
    assert as_json("estimate", "--model", "llama3-8b", "--tricks", "bf16")["setup"]["seq_len"] == 4096  # RoPE


def test_verify_without_seq_takes_gpt2s_position_table():
    pytest.importorskip("torch")
    out = run("verify", "--device", "meta", "--model", "gpt2", "--layers", "2", "--tricks", "bf16,flash")
    assert out.exit_code == 0 and "seq 1,024" in out.stdout, out.output[-500:]


@pytest.mark.parametrize("args, message", [
    (["estimate", "--model", "gpt2", "--capacity-factor", "1.25"],
     "--capacity-factor describes how a mixture of experts routes tokens; gpt2 has no experts"),
    (["estimate", "--model", "gpt2", "--capacity-factor", "1.25", "--expert-imbalance", "2"],
     "--capacity-factor and --expert-imbalance describe how a mixture of experts routes tokens"),
    (["verify", "--model", "gpt2", "--fsdp", "2", "--device", "meta"], "--device applies to one GPU's verify"),
    (["verify", "--model", "gpt2", "--fsdp", "2", "--device", "meta", "--tol", "0.1"],
     "--device and --tol apply to one GPU's verify"),
])  # fmt: skip
def test_refusals_agree_with_what_they_name(args, message):
    """'--capacity-factor describe': the options named were joined into a subject whose verb stayed plural."""
    out = run(*args)
    assert out.exit_code == 2 and len(out.stderr.strip().splitlines()) == 1 and message in out.stderr


def test_latent_attention_fields_agree_with_their_verb():
    from dataclasses import replace

    from memcalc.model.presets import preset

    with pytest.raises(InputError, match="^q_lora_rank, qk_rope_head_dim and v_head_dim describe latent attention"):
        replace(preset("mixtral-8x7b"), q_lora_rank=64, qk_rope_head_dim=64, v_head_dim=128)
