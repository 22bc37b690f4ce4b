"""The README's screenshot, taken from the running app: start it on a profile (offline by default), open the
page in Debian's chromium, upload a scan, ask a question, wait for the answer and its sources, and save the page.

    python scripts/screenshot_app.py                    # writes docs/screenshot.png
    python scripts/screenshot_app.py --scan FILE --question "..." -o shot.png

It prints the answer the page shows, so the README's caption can say what the picture holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_app import start_app, stop_app  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCAN = REPO.parent / "shared" / "data" / "vqa_rad" / "images" / "synpic42202.jpg"
QUESTION = "Is there evidence of an aortic aneurysm?"
LAST_REPLY = "#medvqa-chat [data-testid='bot'] >> nth=-1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline")
    parser.add_argument("--scan", default=str(SCAN), help="the file to upload (default: a VQA-RAD chest radiograph)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("-o", "--output", default=str(REPO / "docs" / "screenshot.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    # The first start may build the literature index and convert the decoder (minutes on 2 cores).
    app, url = start_app(args.profile, timeout=900)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(300_000)
            page.goto(url)
            page.set_input_files("#medvqa-upload input[type=file]", args.scan)
            page.wait_for_selector("#medvqa-scan")
            box = page.locator("#medvqa-question textarea")
            box.fill(args.question)
            box.press("Enter")
            reply = page.locator(LAST_REPLY)
            reply.locator(".medvqa-sources").wait_for(state="attached")
            page.wait_for_timeout(500)  # the last render settles
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.output, full_page=True)
            print(f"wrote {args.output}")
            print("answer shown:", reply.inner_text().split("\n")[0])
            browser.close()
    finally:
        stop_app(app)
    return 0


if __name__ == "__main__":
    sys.exit(main())
