"""How fast `memcalc web` answers a change, as the page measures it (from the change to the verdict's table
on screen), in Debian's Chromium driven by Playwright, with memcalc's disk cache empty at the start.

    python benchmarks/web_latency.py          # needs /usr/bin/chromium and playwright (pip install -e '.[test]')
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from playwright.sync_api import sync_playwright

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
STATE = "#preset=llama3-8b&gpu=rtx4090&method=lora&seq=2048"
NEWEST = "document.body.dataset.answered === document.body.dataset.asked"


def answer_ms(page, act) -> int:
    """The page's own measure of the answer to act(): the change to the verdict's table, in ms."""
    before = page.evaluate("+(document.body.dataset.answered || 0)")
    act()
    page.wait_for_function(f"+document.body.dataset.answered > {before} && {NEWEST}", timeout=600_000)
    return page.evaluate("+document.body.dataset.ms")


def ahead_done(url: str) -> float:
    start = time.monotonic()
    while json.loads(urllib.request.urlopen(url + "api/ahead").read()) != {"pending": 0, "running": False}:
        time.sleep(0.2)
    return time.monotonic() - start


def slide(page, key: str):
    return lambda: (page.focus("#seq"), page.keyboard.press(key))


def main() -> None:
    env = {**os.environ, "MEMCALC_CACHE": tempfile.mkdtemp(prefix="memcalc-cache-")}
    server = subprocess.Popen([sys.executable, "-m", "memcalc", "web", "--port", "0"], stderr=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    rows = []
    try:
        url = re.search(r"http://\S+/", server.stderr.readline()).group(0)
        with sync_playwright() as p:
            page = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS).new_page()
            rows.append(("first answer, Llama-3-8B LoRA on an RTX 4090, seq 2,048 (cold)",
                         answer_ms(page, lambda: page.goto(url + STATE))))  # fmt: skip
            first_step = answer_ms(page, slide(page, "ArrowRight"))
            rows.append(("sequence slider one step, before the server ran ahead", first_step))
            rows.append(("back to the state already answered", answer_ms(page, slide(page, "ArrowLeft"))))
            waited = ahead_done(url)
            for key in ("ArrowLeft", "ArrowLeft", "ArrowRight"):
                rows.append((f"sequence slider one step ({key}), after the server ran ahead ({waited:.0f} s)",
                             answer_ms(page, slide(page, key))))  # fmt: skip
                waited = ahead_done(url)
            rows.append(("micro-batch slider one step, after it ran ahead",
                         answer_ms(page, lambda: (page.focus("#micro-batch"), page.keyboard.press("ArrowRight")))))
            rows.append(("the trick set for fit and the timeline", answer_ms(page, lambda: page.select_option("#tricks", "bf16+flash"))))
            rows.append(("another GPU (an H100)", answer_ms(page, lambda: page.select_option("#gpu", "h100-sxm"))))
            rows.append(("another model (Qwen3-8B, cold)", answer_ms(page, lambda: page.select_option("#preset", "qwen3-8b"))))
    finally:
        server.terminate()
        server.wait(10)
    print("| change | answered in |\n|---|---:|")
    for what, ms in rows:
        print(f"| {what} | {ms:,} ms |")


if __name__ == "__main__":
    main()
