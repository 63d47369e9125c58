"""The README and every page under docs/ show what memcalc prints today, and their commands run.

For README.md and each docs/*.md:

1. Example blocks. A line `<!-- example: memcalc ARGS -->` right above a ```text block: the block is
   exactly what `memcalc ARGS` prints (typer's CliRunner from the repository root, NO_COLOR=1,
   COLUMNS=100; stdout only, so warnings on stderr are not part of it).
   `<!-- example: memcalc ARGS | section: TITLE -->` shows one section of that output: the
   blank-line-separated block whose first line starts with TITLE (exactly one block must).
   `<!-- example: python PATH -->` shows what the Python script at PATH prints.
   `<!-- example, takes ~N min: memcalc ARGS -->` is an example that takes long (a plan searched
   cold, the planner over the published corpus): it runs where MEMCALC_SLOW=1 (CI sets it in .ci/run)
   or UPDATE_DOCS=1; elsewhere its command is parsed (a script: found), not run, so the suite stays
   quick where people run it often.
   After a deliberate change, refresh every block with:  UPDATE_DOCS=1 python -m pytest tests/test_docs.py
2. Commands. Every line of a ```sh block that starts with `memcalc ` runs and exits 0. A line whose
   trailing comment starts with `# needs` (a GPU, torchrun, matplotlib) or `# takes` (longer than a
   few seconds) is parsed, not run: the command must exist and accept its options.
3. Python. Every ```python block runs without error.
4. Links. Every relative link points at a file that exists, and its #anchor at a heading there.
5. Hand-written numbers. Where a page keeps a hand-written table or quotes a number in prose, a test
   below computes it with the engine: the calibration table, FlashAttention's Fig. 2, the JSON keys,
   and the numbers the step-time, memory and verify pages quote.

Each command runs once (cached), so the whole file takes a few seconds. CI runs the README's test
command verbatim (the last test).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from memcalc.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
ENV = {"NO_COLOR": "1", "COLUMNS": "100"}

EXAMPLE = re.compile(r"<!-- example(, takes [^:]+)?: (memcalc|python) (.+?) -->\n```text\n(.*?)```", re.DOTALL)
SECTION = " | section: "
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.DOTALL | re.MULTILINE)
PY_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
PARSE_ONLY = re.compile(r"\s#\s*(needs|takes)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def read(name: str) -> str:
    return (ROOT / name).read_text()


def prose(name: str) -> str:
    """The page with every run of whitespace made one space, so that wrapped sentences match."""
    return " ".join(read(name).split())


@contextlib.contextmanager
def at_root():
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(here)


@cache
def memcalc(args: str) -> str:
    """What `memcalc ARGS` prints on stdout; it must exit 0."""
    with at_root():
        result = CliRunner().invoke(app, shlex.split(args), env=ENV)
    assert result.exit_code == 0, f"`memcalc {args}` exited {result.exit_code}:\n{result.output}"
    return result.stdout


@cache
def python(spec: str) -> str:
    """What `python PATH ARGS...` prints, run in this process."""
    path, *args = shlex.split(spec)
    out, argv = io.StringIO(), sys.argv
    sys.argv = [path, *args]
    try:
        with at_root(), contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / path), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def section(output: str, title: str) -> str:
    blocks = [b for b in output.split("\n\n") if b.startswith(title)]
    assert len(blocks) == 1, f"{len(blocks)} sections start with {title!r} (one must)"
    return blocks[0].rstrip("\n") + "\n"


def shown(kind: str, spec: str) -> str:
    """What an example marker's block must hold."""
    if kind == "python":
        return python(spec)
    args, _, title = spec.partition(SECTION)
    out = memcalc(args)
    return section(out, title) if title else out


def block(m: re.Match) -> str:
    return f"<!-- example{m[1] or ''}: {m[2]} {m[3]} -->\n```text\n{shown(m[2], m[3])}```"


def run_slow() -> bool:
    return bool(os.environ.get("MEMCALC_SLOW") or os.environ.get("UPDATE_DOCS"))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_examples_are_what_memcalc_prints(page):
    text = page.read_text()
    if os.environ.get("UPDATE_DOCS"):
        new = EXAMPLE.sub(block, text)
        if new != text:
            page.write_text(new)
            text = new
    for slow, kind, spec, block_text in EXAMPLE.findall(text):
        if slow and not run_slow():
            if kind == "python":  # the script is there; tests/test_published_report.py runs what it prints
                assert (ROOT / spec.split()[0]).is_file(), spec
            else:
                parse_only(shlex.split(spec.partition(SECTION)[0]))
            continue
        assert block_text == shown(kind, spec), (
            f"{page_id(page)}: the example `{kind} {spec}` is stale; "
            "refresh with UPDATE_DOCS=1 python -m pytest tests/test_docs.py"
        )


def sh_commands(text: str) -> list[str]:
    """The `memcalc ...` lines of the page's ```sh blocks, backslash continuations joined."""
    lines = []
    for body in SH_BLOCK.findall(text):
        for line in body.replace("\\\n", " ").splitlines():
            if line.startswith("memcalc "):
                lines.append(line)
    return lines


MODEL_OPTIONS = ("params", "model", "config", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def parse_only(args: list[str]) -> None:
    """The command exists and accepts these options (click parses them; nothing runs), and names its model
    as the command would resolve it (memcalc.cli.inputs.resolve_model: a model is an option click cannot
    require, one of several; verify --step without one measures the step's own)."""
    from memcalc.cli.inputs import resolve_model

    group = typer.main.get_command(app)
    name, *rest = args
    command = group.commands.get(name)
    assert command is not None, f"no command `memcalc {name}`"
    with command.make_context(name, rest) as ctx:
        given = dict(ctx.params)
    if "model" in given and given.get("step") is None:
        resolve_model(*(given[k] for k in MODEL_OPTIONS))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_run(page):
    for line in sh_commands(page.read_text()):
        args = shlex.split(line, comments=True)[1:]
        if PARSE_ONLY.search(line):
            try:
                parse_only(args)
            except Exception as e:  # noqa: BLE001 - click's UsageError, vendored by some typer releases
                pytest.fail(f"{page_id(page)}: `{line}` does not parse: {e}")
        else:
            memcalc(shlex.join(args))


def test_parse_only_rejects_what_memcalc_would():
    parse_only(["verify", "--model", "qwen3-8b", "--device", "cuda", "--matrix", "--format", "json"])
    parse_only(["verify", "--step", "my_step.py:train_step", "--device", "cuda"])  # the step brings its model
    for bad in (["verify", "--no-such-option"], ["nosuch"], ["estimate", "--seq"],
                ["verify", "--matrix", "--device", "cuda"], ["plan", "--gpus", "8", "--global-batch", "8"],
                ["estimate", "--model", "no-such-preset"], ["fit", "--params", "-8e9"]):  # fmt: skip
        with pytest.raises(Exception):  # noqa: B017 - click's UsageError, vendored by some typer releases
            parse_only(bad)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_run(page):
    for code in PY_BLOCK.findall(page.read_text()):
        with at_root(), contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{page_id(page)} python block", "exec"), {"__name__": "__docs__"})  # noqa: S102


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    heads = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        assert goal.exists(), f"{page_id(page)} links to {target}, which does not exist"
        if anchor and goal.suffix == ".md":
            assert anchor in anchors(goal), f"{page_id(page)} links to {target}: no such heading"


def test_readme_links_every_page():
    text = README.read_text()
    for page in PAGES[1:]:
        assert f"]({page_id(page)})" in text, f"the README does not link {page_id(page)}"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


# -- hand-written numbers, computed ---------------------------------------------------------------


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
             ["timeline"]}  # fmt: skip
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
    from memcalc import Setup, canonical_model, gpu, step_times
    from memcalc.model.tricks import PROGRESSION
    from memcalc.time.calibration import calibration_for

    model = canonical_model(8_000_000_000)
    fp32, bf16, flash, *_ = step_times(model, Setup(seq_len=8192), gpu("h100-sxm"), PROGRESSION,
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


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```sh\n{ci}\n```" in README.read_text()
    assert "python -m pytest" in ci
