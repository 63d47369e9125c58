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
   trailing comment starts with `# needs` (a GPU, torchrun, matplotlib), `# takes` (longer than a
   few seconds) or `# writes` (files into the folder it runs in: here, the repository) is parsed, not
   run: the command must exist and accept its options.
3. Python. Every ```python block runs without error.
4. Links. Every relative link points at a file that exists, and its #anchor at a heading there.
5. Hand-written numbers. Where a page keeps a hand-written table or quotes a number in prose, a test
   in tests/test_docs_numbers.py computes it with the engine: the calibration table, FlashAttention's Fig. 2, the JSON keys,
   and the numbers the step-time, memory and verify pages quote.

Each command runs once (cached), so the whole file takes a few seconds. CI runs the README's test
command verbatim (the last test).
"""

from __future__ import annotations

import contextlib
import io
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
PARSE_ONLY = re.compile(r"\s#\s*(needs|takes|writes)\b")
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


def parse_only(args: list[str]) -> None:
    """The command exists and accepts these options (click parses them; nothing runs), and names its model
    as the command would resolve it (memcalc.cli.groups.ModelOptions: a model is an option click cannot
    require, one of several; verify --step without one measures the step's own)."""
    from memcalc.cli.groups import ModelOptions

    group = typer.main.get_command(app)
    name, *rest = args
    command = group.commands.get(name)
    assert command is not None, f"no command `memcalc {name}`"
    with command.make_context(name, rest) as ctx:
        given = dict(ctx.params)
    if "model" in given and given.get("step") is None:
        ModelOptions.of(given).resolve()


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


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```sh\n{ci}\n```" in README.read_text()
    assert "python -m pytest" in ci
