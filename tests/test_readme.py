"""The README's example output is what memcalc prints today, and CI runs the README's test command.

Refresh the examples after a deliberate change with: UPDATE_README=1 python -m pytest tests/test_readme.py
"""

import os
import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from memcalc.cli import app

README = Path(__file__).parent.parent / "README.md"
EXAMPLE = re.compile(r"<!-- example: memcalc (.+?) -->\n```text\n(.*?)```", re.S)


def output(args: str) -> str:
    result = CliRunner().invoke(app, shlex.split(args), env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_readme_examples_are_real_output():
    text = README.read_text()
    examples = EXAMPLE.findall(text)
    assert examples, "no example blocks in the README"
    if os.environ.get("UPDATE_README"):
        text = EXAMPLE.sub(lambda m: f"<!-- example: memcalc {m[1]} -->\n```text\n{output(m[1])}```", text)
        README.write_text(text)
        examples = EXAMPLE.findall(text)
    for args, shown in examples:
        assert shown == output(args), f"README example `memcalc {args}` is stale: rerun with UPDATE_README=1"


def test_ci_runs_the_readme_test_command():
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```sh\n{ci}\n```" in README.read_text()
    assert "python -m pytest" in ci
