"""The screenshots docs/web.md shows: `memcalc web` in Debian's Chromium, driven by Playwright.

    python examples/web_screenshots.py    # needs /usr/bin/chromium and playwright (pip install -e '.[test]')
"""

import re
import subprocess
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

DOCS = Path(__file__).resolve().parents[1] / "docs"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
LORA_8B = "#preset=llama3-8b&gpu=rtx4090&method=lora&seq=2048"  # Llama-3-8B LoRA on a 24 GB card
REFUSED = "#preset=llama3-8b&gpu=rtx4090&method=qlora&rank=0&seq=2048"
NEWEST = "+document.body.dataset.answered > 0 && document.body.dataset.answered === document.body.dataset.asked"
DRAWN = NEWEST + " && document.body.dataset.timeline === document.body.dataset.answered"


def main() -> None:
    server = subprocess.Popen([sys.executable, "-m", "memcalc", "web", "--port", "0"], stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        url = re.search(r"http://\S+/", server.stderr.readline()).group(0)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
            page = browser.new_page(viewport={"width": 1300, "height": 1400})
            page.goto(url + LORA_8B)
            page.wait_for_function(DRAWN, timeout=300_000)
            page.screenshot(path=DOCS / "web.png")
            box = page.locator("#chart").bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.38, box["y"] + box["height"] * 0.3)
            page.locator("#timeline").screenshot(path=DOCS / "web-timeline.png")
            page.goto(url + REFUSED)
            page.wait_for_function(NEWEST, timeout=300_000)
            page.screenshot(path=DOCS / "web-refused.png", clip={"x": 0, "y": 0, "width": 1300, "height": 330})
            browser.close()
    finally:
        server.terminate()
        server.wait(10)
    print("wrote docs/web.png, docs/web-timeline.png, docs/web-refused.png")


if __name__ == "__main__":
    main()
