"""Time to the first word as a clinician sees it: the app in Chromium, a question typed or pasted.

    python scripts/bench_browser.py [--profile offline] [--runs 3] [--url URL] [--json]

Without --url, app.py is started on a free loopback port and stopped at the end. Each run opens a
fresh page, uploads pydicom's CT_small.dcm, waits as a reader would, and asks two questions. The
first is typed key by key (the question box's input events prefill it) or pasted in one go (no
input event per key: only the scan and the prompt up to the question were prefilled); the next
question the other way round, so every run measures both, on a first and on a next turn.

The time is taken inside the page: from the Ask button's click event to the moment the reply shows
answer text (performance.now(), no polling from outside). It includes Gradio's round trip and
rendering, which a Python-level benchmark (bench_latency.py) leaves out. Needs Debian's chromium and
the playwright package (never `playwright install`). Ends with one JSON line with --json:
{"profile", "runs", "first_typed_s", "first_pasted_s", "next_typed_s", "next_pasted_s"} (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
QUESTIONS = ("What organ is shown in this image?", "Is there a lesion on the left side?")
READING_S = 3.0  # a pause before each question: looking at the scan, reading the answer
KEY_DELAY_MS = 60  # typing speed, about 100 words a minute

# Records when Ask is clicked and when the newest reply first shows answer text (a reply showing only
# a status line, or none, has not started).
WATCH = """() => {
  const state = window.__medvqaTiming = {clicked: null, first: null};
  const replies = () => document.querySelectorAll("#medvqa-chat [data-testid='bot']");
  const before = replies().length;
  document.querySelector('#medvqa-ask').addEventListener('click', () => {
    state.clicked = performance.now();
  }, {once: true, capture: true});
  const observer = new MutationObserver(() => {
    const all = replies();
    if (state.clicked === null || all.length <= before) return;
    const last = all[all.length - 1];
    if (!last.querySelector('.medvqa-status') && last.innerText.trim()) {
      state.first = performance.now();
      observer.disconnect();
    }
  });
  observer.observe(document.querySelector('#medvqa-chat'), {subtree: true, childList: true, characterData: true});
}"""
ANSWER_DONE = """() => { const all = document.querySelectorAll("#medvqa-chat [data-testid='bot']");
  return all.length && !!all[all.length - 1].querySelector('.medvqa-sources, .medvqa-error'); }"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--url", help="an app already running (default: start app.py)")
    parser.add_argument("--start-timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise SystemExit("needs the playwright package: pip install playwright (and apt-get install chromium)")
    if not Path(CHROMIUM).is_file():
        raise SystemExit(f"{CHROMIUM} not found: apt-get install chromium")
    from bench_app import start_app  # beside this script (its folder is on the path when run)

    server, url = (None, args.url) if args.url else start_app(args.profile, args.start_timeout)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                times = measure(browser, url, args.runs)
            finally:
                browser.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    result = {"profile": args.profile, "runs": args.runs}
    result.update({key: round(statistics.median(values), 3) if values else None for key, values in times.items()})
    for key, value in result.items():
        print(f"  {key:>15}: {value}")
    if args.json:
        print(json.dumps(result))
    return 0


def measure(browser, url: str, runs: int) -> dict[str, list[float]]:
    """Seconds to the first answer text for each run, by turn and by how the question was entered."""
    import pydicom.data

    scan = pydicom.data.get_testdata_file("CT_small.dcm", download=False)
    times: dict[str, list[float]] = {"first_typed_s": [], "first_pasted_s": [], "next_typed_s": [],
                                     "next_pasted_s": []}
    for run in range(runs):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.set_default_timeout(120_000)
            page.goto(url)
            page.set_input_files("#medvqa-upload input[type=file]", scan)
            page.wait_for_selector("#medvqa-scan")
            typed_first = run % 2 == 0
            for turn, (question, typed) in enumerate(zip(QUESTIONS, (typed_first, not typed_first))):
                time.sleep(READING_S)
                seconds = ask(page, question, typed)
                key = f"{'first' if turn == 0 else 'next'}_{'typed' if typed else 'pasted'}_s"
                times[key].append(seconds)
                print(f"run {run + 1}: {key} {seconds:.3f}", file=sys.stderr)
        finally:
            page.close()
    return times


def ask(page, question: str, typed: bool) -> float:
    """Put `question` in the box (typed key by key, or pasted at once), click Ask, and return the
    seconds from the click to the first answer text, measured in the page."""
    box = page.locator("#medvqa-question textarea")
    if typed:
        box.press_sequentially(question, delay=KEY_DELAY_MS)
    else:
        box.fill(question)
    time.sleep(0.5)  # from the last key to the click
    page.evaluate(WATCH)
    page.click("#medvqa-ask")
    page.wait_for_function("() => window.__medvqaTiming.first !== null")
    timing = page.evaluate("() => window.__medvqaTiming")
    page.wait_for_function(ANSWER_DONE)
    return (timing["first"] - timing["clicked"]) / 1000


if __name__ == "__main__":
    sys.exit(main())
