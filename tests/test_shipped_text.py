"""What memcalc ships reads right: it cites its sources themselves (a paper, a datasheet, a measurement
said how it was made), never a note outside the project that a reader of the package does not have,
and the README's list of pages says each thing once."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("memcalc", "docs", "examples", "verify", "benchmarks", "README.md", "pyproject.toml")
ABSOLUTE = re.compile(r"(?<![\w.:/])/(?:work|home|Users|tmp|mnt|root)/")  # a path on someone's machine
OUTSIDE_NOTES = re.compile(r"shared/reference|\bnumbers\.md\b")  # the development notes beside the repo
RELATIVE = re.compile(r"(?<![\w.])((?:\.\./)+[\w./-]*)")


def shipped_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--", *SHIPPED], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.splitlines() if (ROOT / name).is_file()]


def outside_citations(path: Path, text: str) -> list[str]:
    found = [m.group(0) for m in ABSOLUTE.finditer(text)] + [m.group(0) for m in OUTSIDE_NOTES.finditer(text)]
    for m in RELATIVE.finditer(text):
        target = (path.parent / m.group(1)).resolve()
        if not target.is_relative_to(ROOT):
            found.append(m.group(1))
    return found


def test_no_shipped_file_cites_a_path_outside_the_project():
    """memcalc/time/calibrations/h200.json cited /work/shared/reference/numbers.md for its measurement."""
    files = shipped_files()
    assert any(p.suffix == ".json" for p in files) and any(p.suffix == ".md" for p in files)
    bad = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file cites nothing
        if hits := outside_citations(path, text):
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, bad


@pytest.mark.parametrize("text, cited", [
    ("see /work/shared/reference/numbers.md", True), ("(numbers.md)", True), ("[x](../../outside.md)", True),
    ("[x](../examples/custom_step.py)", False), ("https://example.com/work/x", False), ("from ..report import u", False),
])  # fmt: skip
def test_the_check_sees_what_it_is_for(text, cited):
    assert bool(outside_citations(ROOT / "docs" / "page.md", text)) is cited


def bullets(markdown: str, heading: str) -> list[str]:
    """The items of the list under `## heading`, each with its continuation lines joined."""
    body = markdown.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    items: list[str] = []
    for line in body.splitlines():
        if line.startswith("- "):
            items.append(line[2:])
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
    return items


def test_each_documentation_bullet_says_a_thing_once():
    """A stray copy of an old line ended the docs/parallel.md bullet: "... against their own formulas.
    every collective, the bubble) and `memcalc plan`."."""
    items = bullets((ROOT / "README.md").read_text(), "Documentation")
    assert len(items) >= 8
    for item in items:
        words = re.findall(r"[\w`-]+", re.sub(r"\]\([^)]*\)", "]", item).lower())  # a link's target aside
        grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
        assert len(grams) == len(set(grams)), item
