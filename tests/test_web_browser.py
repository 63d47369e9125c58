"""`memcalc web` in a real browser: Debian's Chromium, driven headless by Playwright (both installed by .ci/run).
Every number the page shows is held to what the command line prints for the same inputs (its Markdown, its
JSON); a refusal is the command line's line; the link restores the state; a slider's move answers within
200 ms once its replays are in the disk cache, which the server fills ahead of it.

Each test drives the page for seconds: they run where MEMCALC_SLOW=1 (CI), and fail there, not skip, when the
browser is missing. The screenshots docs/web.md shows are examples/web_screenshots.py's."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import time
from pathlib import Path

import pytest
from test_hub import cache_with
from test_web import cli, get, served

from memcalc.report.units import seconds, size

pytestmark = pytest.mark.slow("tests/test_web.py: the server's answers equal the command line's")
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SMALL = ROOT / "examples" / "configs" / "gpt2-medium.json"
HUB_ID = "openai-community/gpt2-medium"
JOB = ["--model", "llama3.2-1b", "--gpu", "rtx4090", "--lora", "16", "--seq", "1024", "--micro-batch", "1"]
STATE = "#preset=llama3.2-1b&gpu=rtx4090&method=lora&seq=1024"
TRICKS = ["--tricks", "bf16,flash,ckpt"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # the server's and the command line's (cli) cache of Hub models
        env.setenv("HF_HUB_CACHE", str(cache_with(tmp_path_factory.mktemp("hub") / "cache", HUB_ID, SMALL)))
        with served() as address:
            yield address + "/"


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[test]'")
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1300, "height": 1500})
    tab = context.new_page()
    errors = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    yield tab
    context.close()
    assert not errors, errors


def answered(tab, before: int = 0, timeline: bool = True) -> None:
    """Wait for the page's answer to its newest state (after answer number `before`), the timeline too."""
    newest = "document.body.dataset.answered === document.body.dataset.asked"
    tab.wait_for_function(f"+document.body.dataset.answered > {before} && {newest}", timeout=120_000)
    if timeline:
        tab.wait_for_function("document.body.dataset.timeline === document.body.dataset.answered", timeout=120_000)


def markdown_tables(text: str) -> list[list[list[str]]]:
    """The tables of a command's Markdown, as rows of cells (header first, the separator row dropped)."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def page_tables(tab, where: str) -> list[list[list[str]]]:
    cells = "ts => ts.map(t => [...t.rows].map(r => [...r.cells].map(c => c.textContent)))"
    return tab.eval_on_selector_all(f"{where} table", cells)


def last_paragraph(text: str) -> str:
    return text.strip().split("\n\n")[-1].replace("\n", " ")


def test_every_number_on_the_page_is_the_command_lines(url, page):
    page.goto(url + STATE)
    answered(page)
    estimate = cli("estimate", *JOB, "--format", "markdown").stdout
    assert page.text_content("#verdict") == last_paragraph(estimate)
    assert page_tables(page, "#estimate") == markdown_tables(estimate)
    answer = json.loads(cli("estimate", *JOB, "--format", "json").stdout)  # and against the JSON, row by row
    rows = page_tables(page, "#estimate")[0]
    column = {name: rows[0].index(name) for name in ("tricks", "state", "= peak", "step time")}
    for row, v, t in zip(rows[1:], answer["verdict"], answer["time"], strict=True):
        assert row[column["tricks"]] == "+".join(v["tricks"])
        assert (row[column["state"]], row[column["= peak"]]) == (size(v["state_bytes"]), size(v["peak_bytes"]))
        assert row[column["step time"]] == seconds(t["step_seconds"])
    fit_text = cli("fit", *JOB, *TRICKS, "--format", "markdown").stdout
    fit = json.loads(cli("fit", *JOB, *TRICKS, "--format", "json").stdout)
    assert page_tables(page, "#fit") == markdown_tables(fit_text)
    assert page_tables(page, "#fit")[0][1][1] == f"{fit['max_seq_len']:,}"
    assert page_tables(page, "#fit")[0][2][1] == f"{fit['max_micro_batch']:,}"
    seqs = page.evaluate("SEQS")  # the slider's positions, green as far as the longest sequence that fits
    share = 100 * sum(s <= fit["max_seq_len"] for s in seqs) / len(seqs)
    assert f"#9fd8ae {share:g}%" in page.get_attribute("#seq", "style").replace("rgb(159, 216, 174)", "#9fd8ae")
    table = cli("estimate", *JOB, *TRICKS, "--timeline").stdout
    said = next(line for line in table.splitlines() if line.startswith("bf16+flash+ckpt: peak "))
    assert page.text_content("#timeline-note") == said
    t = json.loads(cli("estimate", *JOB, *TRICKS, "--timeline", "--format", "json").stdout)["timeline"][0]
    assert page_tables(page, "#at-peak")[0][1:] == [[g["what"], g["layers"], f"{g['tensors']:,}", size(g["bytes"])]
                                                    for g in t["at_peak"]]  # fmt: skip
    shown = page.text_content("#commands").splitlines()
    assert shown == [f"memcalc estimate {' '.join(JOB)}", f"memcalc fit {' '.join(JOB)} {' '.join(TRICKS)}",
                     f"memcalc estimate {' '.join(JOB)} {' '.join(TRICKS)} --timeline"]  # fmt: skip
    assert cli(*shlex.split(shown[0])[1:], "--format", "markdown").stdout == estimate


def test_the_hover_names_what_the_timeline_holds_at_that_point(url, page):
    page.goto(url + STATE)
    answered(page)
    t = json.loads(cli("estimate", *JOB, *TRICKS, "--timeline", "--format", "json").stdout)["timeline"][0]
    box = page.locator("#chart").bounding_box()
    for share in (0.2, 0.5, 0.8):
        page.mouse.move(box["x"] + box["width"] * share, box["y"] + box["height"] / 2)
        tip = page.text_content("#tip")
        event, of = (int(x.replace(",", "")) for x in re.match(r"event ([\d,]+) of ([\d,]+)", tip).groups())
        i = event - 1
        assert of == len(t["live_bytes"]) and page.is_visible("#tip")
        verb = "frees" if t["nbytes"][i] < 0 else "allocates"
        assert f"{t['ops'][i]} {verb} {size(abs(t['nbytes'][i]))}: {t['labels'][t['what'][i]]}" in tip
        live = [[kind, size(series[i])] for kind, series in zip(t["kinds"], t["live_by_kind"]) if series[i]]
        assert page.eval_on_selector_all("#tip tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))") == [
            *live, ["live", size(t["live_bytes"][i])]]  # what is live there, kind by kind, and in all
    page.mouse.move(0, 0)
    assert not page.is_visible("#tip")


def test_size_formats_bytes_as_the_command_line_does(url, page):
    page.goto(url + "#preset=gpt2&seq=512&gpu=t4&tricks=bf16%2Bflash")
    ties = [62_500_000, 2_500_000, 1_500_000, 187_500_000, 12_345_000_000, 99_995_000_000, 999_950_000_000]
    values = [0, 1, 999, 20_287_392_020, 1_051_000_000, 99_999_999_999, 100_000_000_000, 3_760_000_000_000, *ties]
    values += [-v for v in values] + [int(1.7 ** k) for k in range(80)]
    assert page.evaluate("vs => vs.map(size)", values) == [size(v) for v in values]


@pytest.mark.parametrize("state, argv", [
    ("#preset=llama3.2-1b&seq=0", ["estimate", "--model", "llama3.2-1b", "--gpu", "h100-sxm", "--seq", "0"]),
    ("#preset=llama3.2-1b&method=lora&rank=0", ["estimate", "--model", "llama3.2-1b", "--lora", "0"]),
    ("#preset=llama3.2-1b&gpus=3&zero=3&gpu=rtx4090", ["estimate", "--model", "llama3.2-1b", "--gpus", "3",
                                                       "--zero", "3", "--gpu", "rtx4090"]),  # fmt: skip
])
def test_a_refused_input_shows_the_command_lines_reason(url, page, state, argv):
    shell = cli(*argv)
    page.goto(url + state)
    answered(page)
    if shell.returncode == 0:  # the command takes it: then the page answers, with no error shown
        assert not page.is_visible("#error") and page.text_content("#verdict") == last_paragraph(shell.stdout)
        return
    assert shell.returncode == 2
    assert page.is_visible("#error") and "error: " + page.text_content("#error") == shell.stderr.strip()
    assert page.text_content("#verdict") == ""


def test_the_link_restores_the_state(url, page, browser):
    page.goto(url + "#preset=llama3.2-1b")
    answered(page, timeline=False)
    before = page.evaluate("+document.body.dataset.answered")
    page.select_option("#gpu", "rtx4090")
    page.select_option("#method", "qlora")
    page.fill("#rank", "8")
    page.press("#rank", "Enter")
    page.select_option("#tricks", "bf16+flash")
    answered(page, before)
    link = page.get_attribute("#link", "href")
    other = browser.new_page()
    other.goto(url + link)
    answered(other)
    for where in ("#verdict", "#estimate", "#fit", "#commands", "#timeline-note"):
        assert other.inner_html(where) == page.inner_html(where), where
    argv = ["estimate", "--model", "llama3.2-1b", "--gpu", "rtx4090", "--lora", "8", "--quantize", "nf4",
            "--seq", "4096", "--micro-batch", "1"]  # fmt: skip
    assert other.text_content("#commands").splitlines()[0] == "memcalc " + " ".join(argv)
    assert other.text_content("#verdict") == last_paragraph(cli(*argv, "--format", "markdown").stdout)
    other.close()


def test_a_slider_answers_within_200_ms_once_ahead(url, page):
    page.goto(url + STATE)
    answered(page)
    deadline = time.monotonic() + 240
    while json.loads(get(url + "api/ahead")[1]) != {"pending": 0, "running": False}:  # the neighbours, replayed
        assert time.monotonic() < deadline, "the server's second process did not finish its commands"
        time.sleep(0.2)
    took = []
    for key, step in (("ArrowRight", "1536"), ("ArrowLeft", "1024")) * 2:
        before = page.evaluate("+document.body.dataset.answered")
        page.focus("#seq")
        page.keyboard.press(key)
        answered(page, before, timeline=False)
        assert page.text_content("#seq-value") == f"{int(step):,}"
        assert f"--seq {step} " in page.text_content("#commands")
        took.append(page.evaluate("+document.body.dataset.ms"))
    assert sorted(took)[len(took) // 2] < 200, took  # the median move: CI's other tests share the two cores
    argv = [*JOB[:-4], "--seq", "1024", "--micro-batch", "1", "--format", "markdown"]
    assert page.text_content("#verdict") == last_paragraph(cli("estimate", *argv).stdout)


def test_an_uploaded_config_and_a_cached_hub_id_answer_as_the_command_line(url, page):
    page.goto(url + "#preset=gpt2&seq=512&gpu=t4&tricks=fp16%2Bflash")
    answered(page)
    before = page.evaluate("+document.body.dataset.answered")
    page.check("input[name=source][value=file]")
    page.set_input_files("#config", str(SMALL))
    answered(page, before)
    argv = ["estimate", "--config", str(SMALL), "--gpu", "t4", "--seq", "512", "--micro-batch", "1"]
    assert page.text_content("#verdict") == last_paragraph(cli(*argv, "--format", "markdown").stdout)
    assert page.text_content("#commands").startswith(f"memcalc estimate --config {SMALL.name} --gpu t4")
    before = page.evaluate("+document.body.dataset.answered")
    page.check("input[name=source][value=hub]")
    answered(page, before)
    assert page.eval_on_selector_all("#hub option", "os => os.map(o => o.value)") == [HUB_ID]
    shell = cli("estimate", "--model", HUB_ID, "--gpu", "t4", "--seq", "512", "--format", "markdown")
    assert shell.returncode == 0  # the test process's HF_HUB_CACHE is the server's (the url fixture)
    assert page.text_content("#verdict") == last_paragraph(shell.stdout)


def test_ppo_answers_as_the_command_line_phase_by_phase(url, page):
    """PPO: the completion field alone (no generations, no vLLM), the trick set without its checkpointing for fit
    and the timeline (PPOTrainer never checkpoints); the verdict and the phases' table are the command line's."""
    page.goto(url + "#preset=llama3.2-1b&gpu=rtx4090&method=lora&seq=1024&accum=4&rl=ppo&completion=64")
    answered(page)
    assert page.is_visible("#completion") and not page.is_visible("#generations") and not page.is_visible("#vllm")
    argv = ["--model", "llama3.2-1b", "--gpu", "rtx4090", "--lora", "16", "--rl", "ppo", "--completion-len", "64",
            "--seq", "1024", "--micro-batch", "1", "--grad-accum", "4"]  # fmt: skip
    shown = page.text_content("#commands").splitlines()
    assert shown[0] == "memcalc estimate " + " ".join(argv)
    assert shown[1] == "memcalc fit " + " ".join(argv) + " --tricks bf16,flash"
    estimate = cli("estimate", *argv, "--format", "markdown").stdout
    assert page.text_content("#verdict") == last_paragraph(estimate)
    assert page_tables(page, "#estimate") == markdown_tables(estimate)
    assert "PPO phases per GPU" in page.text_content("#estimate")


def test_grpo_answers_as_the_command_line_phase_by_phase(url, page):
    """The RL fields: GRPO with vLLM colocated, its generation batch over eight micro-batches; the verdict, the
    phases' table, fit (which takes the accumulation too) and the timeline are the command line's."""
    page.goto(url + "#preset=llama3.2-1b&gpu=rtx4090&method=lora&seq=1024&accum=8&rl=grpo&completion=256"
              "&vllm=colocate")  # fmt: skip
    answered(page)
    assert page.is_visible("#online") and page.input_value("#completion") == "256"
    argv = ["--model", "llama3.2-1b", "--gpu", "rtx4090", "--lora", "16", "--rl", "grpo", "--completion-len", "256",
            "--vllm", "colocate", "--seq", "1024", "--micro-batch", "1", "--grad-accum", "8"]  # fmt: skip
    shown = page.text_content("#commands").splitlines()
    assert shown[0] == "memcalc estimate " + " ".join(argv)
    estimate = cli("estimate", *argv, "--format", "markdown").stdout
    assert page.text_content("#verdict") == last_paragraph(estimate)
    assert page_tables(page, "#estimate") == markdown_tables(estimate)
    assert "GRPO phases per GPU (vLLM colocate)" in page.text_content("#estimate h3:nth-of-type(2)")
    assert page_tables(page, "#fit") == markdown_tables(cli("fit", *argv, *TRICKS, "--format", "markdown").stdout)
    t = json.loads(cli("estimate", *argv, *TRICKS, "--timeline", "--format", "json").stdout)["timeline"][0]
    assert page.text_content("#timeline-note").startswith(f"bf16+flash+ckpt: peak {size(t['peak_bytes'])} ")
