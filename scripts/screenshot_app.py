"""The README's screenshot, taken from the running app: start it on a profile (offline by default), open the
page in Debian's chromium, upload a scan, ask a question, wait for the answer and its sources, and save the page.

    python scripts/screenshot_app.py                    # writes docs/screenshot.png
    python scripts/screenshot_app.py --scan FILE --question "..." -o shot.png

It prints the answer the page shows, so the README's caption can say what the picture holds.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCAN = REPO.parent / "shared" / "data" / "vqa_rad" / "images" / "synpic42202.jpg"
QUESTION = "Is there evidence of an aortic aneurysm?"
LAST_REPLY = "#medvqa-chat [data-testid='bot'] >> nth=-1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_served(url: str, app: subprocess.Popen, timeout_s: float = 900) -> None:
    """The first start may build the literature index and convert the decoder (minutes on 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if app.poll() is not None:
            raise SystemExit(f"the app exited with status {app.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the app did not serve {url} within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline")
    parser.add_argument("--scan", default=str(SCAN), help="the file to upload (default: a VQA-RAD chest radiograph)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("-o", "--output", default=str(REPO / "docs" / "screenshot.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    app = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--profile", args.profile, "--port", str(port)],
                           cwd=REPO, start_new_session=True, env=dict(os.environ))
    try:
        wait_until_served(url, app)
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
        os.killpg(app.pid, signal.SIGTERM)
        app.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
