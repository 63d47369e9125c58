"""Where a docs page keeps a hand-written table or quotes a number in prose, a test here computes it with
the engine: the calibration table, FlashAttention's Fig. 2, the JSON keys, and the numbers the step-time,
memory and verify pages quote (item 5 of tests/test_docs.py, which keeps the pages' examples and commands)."""

from __future__ import annotations

import json
import re

import pytest
from test_docs import memcalc, prose, read


def assert_quoted(name: str, claims) -> None:
    """Each claim, a phrase built from the engine's numbers, appears in the page's prose."""
    text = prose(name)
    missing = [c for c in claims if c not in text]
    assert not missing, f"{name} no longer says what the engine computes; expected: {missing}"


def table_rows(text: str, first_cell: str) -> dict[str, list[str]]:
    """Rows of the page's Markdown tables whose first cell matches first_cell, by that cell."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(first_cell, cells[0]):
            rows[cells[0]] = cells[1:]
    return rows


def test_calibration_table():
    from memcalc.time.calibration import PARAMETERS, calibration_for, defaults

    rows = table_rows(read("docs/step-time.md"), r"`\w+`")
    assert {r.strip("`") for r in rows} == set(PARAMETERS)
    shipped = calibration_for("h100-sxm"), calibration_for("h200"), calibration_for("a100-80gb")
    for cell, (default, h100, h200, a100, *_) in rows.items():
        name = cell.strip("`")
        assert float(default) == getattr(defaults("any"), name)
        assert [float(h100), float(h200), float(a100)] == [getattr(c, name) for c in shipped]


def test_flashattention_figure_2_table():
    from memcalc.model.gpus import gpu
    from memcalc.time.attention_io import attention_time
    from memcalc.time.calibration import defaults

    def run(flash: bool, key: str = "a100-40gb"):  # one kernel at the defaults: the shipped values are whole steps'
        return attention_time(64, 16, 1024, 64, "fp16", flash, gpu(key), defaults(key), dropout=0.1)

    std, flash, std80 = run(False), run(True), run(False, "a100-80gb")
    assert_quoted(
        "docs/step-time.md",
        (
            (
                f"| standard, memcalc | {std.bytes / 1e9:.1f} GB | {std.seconds * 1e3:.1f} ms "
                f"({std80.seconds * 1e3:.1f} ms on the 80 GB card) | {std.flops_counted / 1e9:.1f} G "
                f"({std.flops / 1e9:.1f} G) |"
            ),
            (
                f"| flash, memcalc | {flash.bytes / 1e9:.3g} GB | {flash.seconds * 1e3:.1f} ms "
                f"| {flash.flops_counted / 1e9:.1f} G ({flash.flops / 1e9:.1f} G, causal) |"
            ),
            f"Standard moves {std.bytes / 40.3e9 - 1:.0%} more",
            f"{std.bytes / flash.bytes:.0f}× less traffic (paper 9.2×), {std.seconds / flash.seconds:.1f}× faster",
            f"only their ratio compares: {flash.flops_counted / std.flops_counted:.2f} here",
            f"alone are {std.flops_counted / 1e9:.1f} GFLOP",
        ),
    )


def json_keys(obj, into: set[str]) -> set[str]:
    """Every key at any depth of a JSON value, and every string value (some rows name values)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            into.add(k)
            json_keys(v, into)
    elif isinstance(obj, list):
        for v in obj:
            json_keys(v, into)
    elif isinstance(obj, str):
        into.add(obj)
    return into


def test_json_keys_table():
    """docs/output.md's table of `estimate --format json` keys: exactly the top-level keys, with a layout
    and without (one schema), and every key a row names exists under its key in one of the two."""
    data = json.loads(memcalc("estimate --params 8e9 --seq 8192 --tokens 15e12 --price-per-gpu-hour 2 --format json"))
    data |= {"exact": json.loads(memcalc("estimate --model gpt2 --seq 1024 --exact --format json"))["exact"],
             "timeline": json.loads(memcalc("estimate --model gpt2 --seq 1024 --tricks bf16 --timeline --format json"))
             ["timeline"],
             "rollout": [json.loads(memcalc(f"estimate --model llama3.2-1b --seq 1024 --lora 8 --rl grpo --micro-batch "
                                            f"8 {vllm}--format json"))["rollout"] for vllm in ("--vllm colocate ", "")]}
    layout = json.loads(memcalc("estimate --params 8e9 --seq 8192 --tp 2 --pp 2 --dp 2 --zero 1 --format json"))
    rows = table_rows(read("docs/output.md"), r"`[a-z_]+`")
    assert {r.strip("`") for r in rows} == set(data) == set(layout)
    for cell, (meaning, *_) in rows.items():
        named = set(re.findall(r"`([a-z_]+)`", meaning)) - {"null"} - set(data)  # a value; another row
        key = cell.strip("`")
        missing = named - json_keys(data[key], set()) - json_keys(layout[key], set())
        assert not missing, f"docs/output.md's row {cell} names keys the JSON does not have: {missing}"


def test_step_time_prose():
    """docs/step-time.md's reading of the 8B step on the H100 and H200."""
    from memcalc import Setup, canonical_model, gpu, rooflines
    from memcalc.model.tricks import PROGRESSION
    from memcalc.time.calibration import calibration_for

    model = canonical_model(8_000_000_000)
    fp32, bf16, flash, *_ = rooflines(model, Setup(seq_len=8192), gpu("h100-sxm"), PROGRESSION,
                                      calibration_for("h100-sxm"))  # fmt: skip

    def ms(part, t):
        return f"{t.parts[part][0] * 1e3:.0f} ms"

    assert_quoted(
        "docs/step-time.md",
        (
            f"BF16 is {fp32.step_seconds / bf16.step_seconds:.1f}× faster than FP32 here",
            f"flash takes it from {ms('attention core', bf16)} to {ms('attention core', flash)}",
            f"the unfused AdamW step ({ms('optimizer (AdamW)', flash)}",
            f"and {ms('fp32 master copies', flash)} more for the fp32↔bf16 copies",
        ),
    )


def test_textbook_against_exact_prose():
    """docs/memory.md's reading of the `--exact` table, and the GPT layer measured to the byte."""
    from dataclasses import replace

    from memcalc import PRESETS, Setup, canonical_model, estimate, gpu, parse_tricks, textbook_activations
    from memcalc.exact.step import exact_activations, exact_step

    model = canonical_model(8_000_000_000)
    qwen = model.shape
    logits = estimate(model, Setup(seq_len=8192), gpu("h100-sxm"), (parse_tricks("bf16"),)).logits[0].total_bytes
    exact = {t: exact_step(qwen, 8192, 1, parse_tricks(t)) for t in ("bf16", "bf16,flash")}
    book = {t: textbook_activations(qwen, 8192, 1, parse_tricks(t)) for t in ("bf16", "bf16,flash")}
    gpt = replace(PRESETS["gpt2"], n_layers=2, hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128, ffn=16384,
                  max_positions=8192)  # fmt: skip
    gpt_layer = exact_activations(gpt, 8192, 1, parse_tricks("bf16")).per_layer_bytes
    eager, flash = (exact[t].activations.per_layer_bytes for t in ("bf16", "bf16,flash"))
    assert_quoted(
        "docs/memory.md",
        (
            f"the textbook's {book['bf16'].per_layer_bytes:,} bytes per layer",
            f"are measured as {gpt_layer:,}",
            f"the Qwen3-8B layer saves {eager / 1e9:.2f} GB",
            f"the textbook's {book['bf16'].per_layer_bytes / 1e9:.2f} GB",
            f"it saves {flash / 1e9:.2f} GB, about {flash / book['bf16,flash'].per_layer_bytes - 1:.0%} *more*",
            f"34·s·b·h = {book['bf16,flash'].per_layer_bytes / 1e9:.2f} GB",
            f"the textbook's logits (6·b·s·v) are {logits / 1e9:.2f} GB",
            f"where PyTorch keeps {exact['bf16'].activations.outside_bytes / 1e9:.2f} GB",
        ),
    )


def test_moe_counts():
    """docs/moe.md's table of exact counts and its DeepSeek-V3 figures, from the engine."""
    from memcalc.model.params import n_params, param_counts
    from memcalc.model.presets import PRESETS

    rows = table_rows(read("docs/moe.md"), r"[a-z0-9.-]+")
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
        counts = param_counts(PRESETS[name])
        assert (rows[name][0], rows[name][2]) == (f"{counts.main:,}", f"{counts.active:,}"), name
    v3 = PRESETS["deepseek-v3"]
    mtp = param_counts(v3).mtp
    own_copies = mtp + 2 * v3.vocab * v3.hidden
    assert_quoted("docs/moe.md", [f"{mtp:,} parameters of its own", f"{n_params(v3):,} parameters",
                                  f"({own_copies / 1e9:.2f}B)"])  # fmt: skip


def test_stack_pages_prose():
    """docs/stack-reference.md and docs/stack-hf.md: what their prose says of Llama-3-8B at seq 8192."""
    from memcalc import PRESETS, parse_tricks, textbook_activations
    from memcalc.exact.step import exact_step
    from memcalc.model.stacks import stack_for

    llama, s = PRESETS["llama3-8b"], 8192
    hf = stack_for("hf", recipe="master", impl="reference")

    def layer(tricks, stack=stack_for("reference")):
        return exact_step(llama, s, 1, parse_tricks(tricks), stack=stack).activations

    def book(tricks):
        return textbook_activations(llama, s, 1, parse_tricks(tricks)).per_layer_bytes

    # "well under this per layer" with flash; "about twice the replay" without
    assert book("bf16,flash") < 0.75 * layer("bf16,flash").per_layer_bytes
    assert 1.8 < book("bf16") / layer("bf16").per_layer_bytes < 2.2
    # "the same 19 tensors, byte for byte" (Transformers' `weight * x` saves the norm's cast as `other`);
    # eager: "4·b·a·s² bytes a layer more"
    ours, theirs = layer("bf16,flash").terms, layer("bf16,flash", hf).terms
    assert len(theirs) == len(ours) == 19 and sorted(t.value for t in theirs) == sorted(t.value for t in ours)
    assert layer("bf16", hf).per_layer_bytes - layer("bf16").per_layer_bytes == 4 * llama.n_heads * s * s


def test_trl_prose():
    """docs/finetune.md's two peaks of Llama-3-8B's QLoRA, the plain Trainer's and TRL 0.22-0.25's."""
    out = [json.loads(memcalc(f"estimate --model llama3-8b --seq 2048 --lora 16 --quantize nf4 --tricks bf16,flash "
                              f"--gpu a100-80gb --format json{stack}"))["verdict"][0]["total_bytes"]
           for stack in ("", " --stack trl:0.25")]  # fmt: skip
    assert 1.25 < out[1] / out[0] < 1.42  # "about a third higher"
    assert_quoted("docs/finetune.md", [f"({out[0] / 1e9:.1f} GB against {out[1] / 1e9:.1f} GB today)"])


@pytest.mark.slow("test_fit_solves_the_step_as_it_accumulates (the same rule on a small model)")
def test_fit_with_accumulation_prose():
    """docs/memory.md: what `memcalc fit` finds for Llama-3-8B on an H200 with and without --grad-accum 4."""
    args = "fit --model llama3-8b --gpu h200 --seq 4096 --tricks bf16,flash,ckpt --format json"
    four, one = json.loads(memcalc(args + " --grad-accum 4")), json.loads(memcalc(args))
    assert four["max_seq_len"] < one["max_seq_len"]
    assert_quoted("docs/memory.md", [f"{four['max_seq_len']:,} tokens with `--grad-accum 4`",
                                     f"{one['max_seq_len']:,} without"])  # fmt: skip


def test_fit_solves_the_step_as_it_accumulates():
    """A later micro-batch's backward runs beside the gradients the earlier ones left: fit finds less room."""
    args = ("fit --model llama3.2-1b --layers 2 --gpu rtx4090 --gpu-memory 12G --seq 1024 --tricks bf16,flash,ckpt "
            "--format json")
    four, one = json.loads(memcalc(args + " --grad-accum 4")), json.loads(memcalc(args))
    assert (four["max_micro_batch"], four["max_seq_len"]) < (one["max_micro_batch"], one["max_seq_len"])
    assert four["memory_at_max_batch"]["phases"]["grads_bytes"] == one["memory_at_max_batch"]["phases"]["grads_bytes"]
