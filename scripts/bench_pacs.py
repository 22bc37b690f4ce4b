"""Issue 34's figures on the real app: a slow archive, a 600,000-study answer, a closed tab and huge PNGs.

    python scripts/bench_pacs.py                       # app.py --profile offline, about 3 minutes
    python scripts/bench_pacs.py --profile tiny --archive-delay-s 10

Starts scripts/fake_archive.py in this process and app.py with --pacs-url pointing at it, then:

1. the upload time of a small DICOM (pydicom's CT_small.dcm) with the archive idle (median of 5);
2. the same uploads from another tab while one tab's *Find* waits on an archive that answers after
   --archive-delay-s (40 s): their times, and when and how that Find ended;
3. a *Find* whose answer lists one study 600,000 times: its time and the requests the archive saw;
4. a *Find* of one study (listed 50 times) whose series query takes 10 s, typed into the page in
   Chromium (Debian's, driven by Playwright as in scripts/bench_browser.py) whose tab is closed after
   3 s: the requests the archive saw start after the tab was closed (skipped without Playwright or
   Chromium);
5. eight tabs each holding a 5,900 × 5,900 PNG: the app's RSS before and after (all tabs open).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_app import start_app, stop_app, text_of
from fake_archive import Behaviour, FakeArchive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="offline")
    parser.add_argument("--archive-delay-s", type=float, default=40.0)
    parser.add_argument("--startup-timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    import pydicom.data

    ct = Path(pydicom.data.get_testdata_file("CT_small.dcm"))
    with tempfile.TemporaryDirectory(prefix="medvqa-bench-pacs-") as work, \
            FakeArchive(Behaviour(instances=[ct.read_bytes()] * 3)) as archive:
        work_dir = Path(work)
        huge = work_dir / "huge.png"
        huge_png(huge)
        env = {**os.environ, "GRADIO_TEMP_DIR": str(work_dir / "uploads"), "MEDVQA_PACS_USERNAME": "",
               "MEDVQA_PACS_PASSWORD": "", "MEDVQA_PACS_TOKEN": ""}
        server, url = start_app(args.profile, args.startup_timeout, ["--pacs-url", archive.url], env)
        try:
            run(url, server, archive, ct, huge, args)
        finally:
            stop_app(server)
    return 0


def run(url: str, server, archive: FakeArchive, ct: Path, huge: Path, args) -> None:
    from gradio_client import Client, handle_file
    from soak_app import rss_mb  # here: soak_app imports this module

    def upload_time(client) -> float:
        began = time.monotonic()
        *_, chat = client.predict(handle_file(str(ct)), api_name="/upload")
        assert not chat or "medvqa-error" not in text_of(chat[-1]), chat
        return time.monotonic() - began

    other = Client(url, verbose=False)
    alone = [upload_time(other) for _ in range(5)]
    print(f"1. small DICOM upload, archive idle: median {statistics.median(alone):.2f} s "
          f"(max {max(alone):.2f})")

    archive.behaviour.delay_s = args.archive_delay_s
    finder, outcome = Client(url, verbose=False), {}

    def find(identifier: str, client, key: str) -> None:
        began = time.monotonic()
        status = client.predict(identifier, api_name="/pacs_find")[2]
        outcome[key] = (time.monotonic() - began, status)

    slow = threading.Thread(target=find, args=("ACC-SLOW", finder, "slow"))
    slow.start()
    time.sleep(1)
    during = [upload_time(other) for _ in range(5)]
    slow.join()
    print(f"2. the same uploads from another tab while a Find waits on an archive answering after "
          f"{args.archive_delay_s:.0f} s: median {statistics.median(during):.2f} s (max {max(during):.2f}); "
          f"the Find ended after {outcome['slow'][0]:.1f} s: {plain_status(outcome['slow'][1])!r}")

    archive.behaviour.delay_s, archive.behaviour.study_copies = 0.0, 600_000
    before = len(archive.requests)
    find("ACC-MANY", finder, "many")
    print(f"3. a Find whose answer lists one study 600,000 times: {outcome['many'][0]:.1f} s, "
          f"{len(archive.requests) - before} requests; {plain_status(outcome['many'][1])!r}")

    archive.behaviour.study_copies, archive.behaviour.series_delay_s = 50, 10.0  # one study: several are refused
    tab_closed_during_find(url, archive)
    archive.behaviour.series_delay_s = 0.0

    rss_before = rss_mb(server.pid)
    holders = [Client(url, verbose=False) for _ in range(8)]
    for client in holders:
        *_, chat = client.predict(handle_file(str(huge)), api_name="/upload")
        if chat and "medvqa-error" in text_of(chat[-1]):
            print("   refused: " + plain_status(text_of(chat[-1])))
    time.sleep(3)
    rss_after = rss_mb(server.pid)
    print(f"5. eight tabs each holding a 5,900 x 5,900 PNG ({huge.stat().st_size / 1024:.0f} KB): RSS "
          f"{rss_before:.0f} -> {rss_after:.0f} MiB, growth {rss_after - rss_before:.0f} MiB; "
          f"peak (VmHWM) {rss_mb(server.pid, 'VmHWM'):.0f} MiB")
    for client in holders + [other, finder]:
        client.close()


def tab_closed_during_find(url: str, archive: FakeArchive) -> None:
    """Step 4 in a real browser tab: a gradio_client Client is no stand-in here, since its close()
    leaves the session open until the next heartbeat (up to 15 s; see medvqa/ui/remote.py)."""
    try:
        from bench_browser import CHROMIUM, CHROMIUM_ARGS
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("4. skipped: needs the playwright package")
        return
    if not Path(CHROMIUM).is_file():
        print(f"4. skipped: {CHROMIUM} not found")
        return
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.goto(url)
        before = len(archive.requests)
        page.locator("#medvqa-pacs-id input").fill("ACC-LEAVE")
        page.click("#medvqa-pacs-find")
        time.sleep(3)
        page.close()
        closed = time.monotonic()
        time.sleep(15)
        browser.close()
    started = archive.request_times()[before:]
    after = [t for t in started if t > closed]
    print(f"4. a Find whose series query takes 10 s, its browser tab closed after 3 s: {len(started)} "
          f"requests in all, {len(after)} started after the tab was closed"
          + (f" (the last {max(after) - closed:.1f} s after)" if after else ""))


def huge_png(path: Path, side: int = 5_900) -> None:
    """An RGB PNG of side × side pixels that compresses to tens of KB (a bomb of pixels, not bytes)."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((side, side, 3), np.uint8)
    pixels[::64, :, 1] = 200
    Image.fromarray(pixels).save(path, optimize=True)


def plain_status(html_text: str) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", html_text)).strip()


if __name__ == "__main__":
    sys.exit(main())
