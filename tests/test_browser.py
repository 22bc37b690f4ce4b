"""The web app in a real browser: Debian's Chromium driven by Playwright (`pytest -m browser`).

Upload a DICOM, ask, watch the answer stream in, check that citations link to the passages' URLs
and open their text, change the window and see the image change, and try an oversize upload.
Screenshots of each state go to artifacts/browser/ (or $MEDVQA_ARTIFACTS_DIR).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import load_script, prompt_gate
from tests.test_ui import (MAX_UPLOAD_MB, QUESTION, app_url, dicom_file, ui_app, ui_pipeline,  # noqa: F401 - fixtures
                           ui_settings, upload_folder)

pytestmark = pytest.mark.browser

BENCH_BROWSER = load_script("bench_browser")  # its Chromium settings and its measurement
CHROMIUM, CHROMIUM_ARGS = BENCH_BROWSER.CHROMIUM, BENCH_BROWSER.CHROMIUM_ARGS
ARTIFACTS = Path(os.environ.get("MEDVQA_ARTIFACTS_DIR") or Path(__file__).resolve().parents[1] / "artifacts" / "browser")
LAST_REPLY = "#medvqa-chat [data-testid='bot'] >> nth=-1"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser, url: str, width: int = 1280, height: int = 900, **context_options):
    """The app's page in a new browser context, once the page's own script is in place; close its `.context`."""
    context = browser.new_context(viewport={"width": width, "height": height}, **context_options)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#medvqa-upload input[type=file]", state="attached")
    page.wait_for_selector("body[data-medvqa=ready]", state="attached")
    return page


@pytest.fixture
def page(browser, app_url):  # noqa: F811 - the fixture imported above
    page = open_page(browser, app_url)
    yield page
    page.context.close()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def upload_scan(page, path: str) -> str:
    """Upload a file and return the new `src` of the viewer's image."""
    before = page.get_attribute("#medvqa-scan", "src") if page.query_selector("#medvqa-scan") else None
    page.set_input_files("#medvqa-upload input[type=file]", path)
    page.wait_for_function(
        "before => { const img = document.querySelector('#medvqa-scan'); return img && img.src !== before; }",
        arg=before)
    return page.get_attribute("#medvqa-scan", "src")


def test_upload_ask_stream_cite_and_window(page, ui_pipeline):  # noqa: F811
    from medvqa.imaging import open_scan

    assert "not a diagnosis" in page.inner_text("#medvqa-notice")
    ct = dicom_file("CT_small.dcm")
    cached_before = set(ui_pipeline.engine.prefixes.keys())
    first_src = upload_scan(page, ct)
    assert first_src.startswith("data:image/png;base64,")
    assert "DICOM · 128×128 px" in page.inner_text("#medvqa-viewer")
    screenshot(page, "01-scan-loaded.png")
    # Showing the scan is followed by warming: its conversation's prompt up to the question is cached.
    deadline = time.time() + 60
    while not set(ui_pipeline.engine.prefixes.keys()) - cached_before and time.time() < deadline:
        time.sleep(0.05)
    assert set(ui_pipeline.engine.prefixes.keys()) - cached_before, "the scan was not warmed after the upload"

    # Typing the question key by key prefills its prompt (the question box's input events): with the
    # offline profile's gate, all of it but the last token is cached before Ask is pressed.
    (key,) = set(ui_pipeline.engine.prefixes.keys()) - cached_before
    warmed = len(ui_pipeline.engine.prefixes.get(key).ids)
    with prompt_gate(ui_pipeline, "never"):
        page.locator("#medvqa-question textarea").press_sequentially(QUESTION)
        deadline = time.time() + 60
        while time.time() < deadline:
            state = ui_pipeline.engine.prefixes.get(key)
            if state is not None and len(state.ids) > warmed:
                break
            time.sleep(0.05)
        else:
            pytest.fail("typing the question did not warm its prompt")
    # Ask, and watch the answer arrive piece by piece.
    page.click("#medvqa-ask")
    partial: list[str] = []
    deadline = time.time() + 120
    while time.time() < deadline:
        reply = page.locator(LAST_REPLY)
        if reply.count():
            state = reply.evaluate(  # one read of the DOM, so text and state belong together
                "el => [el.innerText.trim(), !!el.querySelector('.medvqa-status'),"
                " !!el.querySelector('.medvqa-sources')]")
            text, waiting, finished = state
            if finished:
                break
            if text and not waiting and (not partial or partial[-1] != text):
                partial.append(text)
                if len(partial) == 2:
                    screenshot(page, "02-answer-streaming.png")
        time.sleep(0.01)
    else:
        pytest.fail(f"no complete answer within 120 s; saw {partial}")
    assert len(partial) >= 2, f"the answer did not stream: {partial}"
    assert all(b.startswith(a) for a, b in zip(partial, partial[1:])), partial

    # Citations: numbered links whose href is the URL of the passage the retriever returned.
    expected = [p.url for p in ui_pipeline.retrieve(QUESTION, open_scan(ct).render().safe_meta)]
    assert expected, "the test index should hold passages about pleural effusion"
    links = page.locator(LAST_REPLY).locator("a.medvqa-source-link")
    assert [links.nth(i).get_attribute("href") for i in range(links.count())] == expected
    assert links.first.get_attribute("target") == "_blank"
    assert "noopener" in (links.first.get_attribute("rel") or "")
    summary = page.locator(LAST_REPLY).locator("details summary").first
    summary.click()
    passage = page.locator(LAST_REPLY).locator("details blockquote").first
    passage.wait_for(state="visible")
    assert "effusion" in passage.inner_text().lower()
    screenshot(page, "03-answer-with-sources.png")

    # Change the window: the image changes.
    page.click("#medvqa-preset input")
    page.get_by_role("option", name="Lung (C -600 / W 1500)").click()
    page.wait_for_function(
        "before => document.querySelector('#medvqa-scan').src !== before", arg=first_src)
    assert "lung window (C -600 / W 1500)" in page.inner_text("#medvqa-viewer")
    lung_src = page.get_attribute("#medvqa-scan", "src")
    screenshot(page, "04-lung-window.png")
    # Focus passing through a number box, nothing typed, leaves the window and where it came from alone.
    page.locator("#medvqa-center input[type=number]").focus()
    page.keyboard.press("Tab")
    page.wait_for_timeout(1000)
    assert "lung window (C -600 / W 1500)" in page.inner_text("#medvqa-viewer")
    assert page.get_attribute("#medvqa-scan", "src") == lung_src

    # Typed centre / width: the image changes again.
    center = page.locator("#medvqa-center input[type=number]")
    center.fill("40")
    center.press("Tab")  # the number box reports on blur
    page.wait_for_function(
        "before => document.querySelector('#medvqa-scan').src !== before", arg=lung_src)
    assert "user window (C 40 / W 1500)" in page.inner_text("#medvqa-viewer")

    # A centre typed beyond the slider is taken as its end: the chat stays as it was, with no error on it.
    chat_before = page.inner_text("#medvqa-chat")
    center.fill("-50000")
    center.press("Tab")
    page.wait_for_function("() => document.querySelector('#medvqa-viewer').innerText.includes('user window (C -')"
                           " && !document.querySelector('#medvqa-viewer').innerText.includes('(C 40 ')")
    page.wait_for_timeout(500)
    assert page.inner_text("#medvqa-chat") == chat_before and page.locator("#medvqa-chat").is_visible()
    assert page.get_by_text("less than minimum value").count() == 0

    # Enter applies a typed value as Tab does; a width typed straight after a centre is kept, not overwritten
    # by the centre's answer coming back.
    center.fill("60")
    center.press("Enter")
    page.wait_for_function("() => document.querySelector('#medvqa-viewer').innerText.includes('user window (C 60 ')")
    width = page.locator("#medvqa-width input[type=number]")
    center.fill("70")
    center.press("Tab")
    width.fill("300")
    width.press("Enter")
    page.wait_for_function(
        "() => document.querySelector('#medvqa-viewer').innerText.includes('user window (C 70 / W 300)')")
    page.wait_for_timeout(500)
    assert (center.input_value(), width.input_value()) == ("70", "300")

    # The arrow keys on a window slider change the window shown, as a drag does (they send no release).
    page.locator("#medvqa-center input[type=range]").focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "() => document.querySelector('#medvqa-viewer').innerText.includes('user window (C 72 / W 300)')")
    page.locator("#medvqa-width input[type=range]").focus()
    page.keyboard.press("ArrowLeft")
    page.wait_for_function(
        "() => document.querySelector('#medvqa-viewer').innerText.includes('user window (C 72 / W 299)')")

    # A drag on the scan sets the window as a PACS viewer's does: right widens it, down raises its centre.
    box = page.locator("#medvqa-scan").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + 50, y + 25, steps=5)
    page.mouse.up()
    page.wait_for_function("() => /user window \\(C (\\d+) \\/ W (\\d+)\\)/.test(document.querySelector('#medvqa-viewer')"
                           ".innerText) && !document.querySelector('#medvqa-viewer').innerText.includes('W 299')")
    centre, window_width = map(int, re.search(r"user window \(C (\d+) / W (\d+)\)",
                                              page.inner_text("#medvqa-viewer")).groups())
    assert centre > 72 and window_width > 299, (centre, window_width)
    assert (center.input_value(), width.input_value()) == (str(centre), str(window_width))


def test_a_drag_on_a_float_image_moves_its_window_by_its_own_steps(page, tmp_path):
    """A float TIFF's sliders span less than one unit in steps of 0.001; a drag moves its window by such steps
    (it used to jump by whole units, to the sliders' ends)."""
    import numpy as np
    from PIL import Image

    path = tmp_path / "map.tiff"
    Image.fromarray(np.linspace(0.0, 0.5, 64 * 64, dtype=np.float32).reshape(64, 64), "F").save(path)
    upload_scan(page, str(path))
    width = page.locator("#medvqa-width input[type=number]")
    center = page.locator("#medvqa-center input[type=number]")
    before = (float(center.input_value()), float(width.input_value()))
    box = page.locator("#medvqa-scan").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x - 20, y - 10, steps=4)  # narrower (its automatic window is about as wide as it goes)
    page.mouse.up()
    page.wait_for_function("() => document.querySelector('#medvqa-viewer').innerText.includes('user window')")
    after = (float(center.input_value()), float(width.input_value()))
    assert before[1] - after[1] == pytest.approx(0.02, abs=0.002), (before, after)
    assert before[0] - after[0] == pytest.approx(0.01, abs=0.002), (before, after)


def test_enter_asks_and_an_error_after_an_answer_is_a_message_of_its_own(page):
    """Enter in the question box asks (Shift+Enter would start a new line); an error that follows an answer
    is a chat message of its own, not a line added to the answer."""
    upload_scan(page, dicom_file("CT_small.dcm"))
    box = page.locator("#medvqa-question textarea")
    box.fill(QUESTION)
    box.press("Enter")
    page.locator(LAST_REPLY).locator(".medvqa-sources").wait_for(state="attached", timeout=120_000)
    replies = page.locator("#medvqa-chat [data-testid='bot']")
    answered = replies.count()
    # A screen reader hears the finished answer once, without its list of passages, not each token as it
    # streams (Gradio's chat is a live region: the page quiets it) nor its HTML (Gradio's message names).
    announce = page.locator("#medvqa-announce")
    page.wait_for_function("() => document.querySelector('#medvqa-announce').textContent.includes('Confidence')")
    first_line = page.locator(LAST_REPLY).inner_text().splitlines()[0].strip()
    passage = page.locator(LAST_REPLY).locator(".medvqa-sources li").first.inner_text()
    assert announce.inner_text().startswith(first_line) and passage[:40] not in announce.inner_text()
    assert page.get_attribute("#medvqa-chat [role=log]", "aria-live") == "off"
    assert page.locator("#medvqa-chat [aria-label^=\"bot's message\"]").count() == 0
    page.wait_for_timeout(1200)  # past a double click's second click
    page.click("#medvqa-ask")  # with the box empty
    page.wait_for_function("n => document.querySelectorAll(\"#medvqa-chat [data-testid='bot']\").length > n",
                           arg=answered, timeout=30_000)
    assert "Please type a question" in page.locator(LAST_REPLY).inner_text()
    page.wait_for_function("() => document.querySelector('#medvqa-announce').textContent.includes('Please type')")
    # Another scan replaces the chat with a note that the conversation closed: it is read out too.
    upload_scan(page, dicom_file("MR_small.dcm"))
    page.wait_for_function("() => document.querySelector('#medvqa-announce').textContent"
                           ".startsWith('A new scan starts a new conversation')")
    assert "Please type a question" not in replies.nth(answered - 1).inner_text()
    screenshot(page, "05b-error-as-its-own-message.png")


def test_new_conversation_is_undone_by_restore_until_the_next_question(page):
    """A click on New conversation (or the chat's bin) no longer loses the conversation: a Restore button
    brings it back, and goes once a question is asked in the new one."""
    upload_scan(page, dicom_file("CT_small.dcm"))
    box = page.locator("#medvqa-question textarea")
    box.fill(QUESTION)
    page.click("#medvqa-ask")
    page.locator(LAST_REPLY).locator(".medvqa-sources").wait_for(state="attached", timeout=120_000)
    answer = page.locator(LAST_REPLY).inner_text()
    restore = page.locator("#medvqa-restore")
    assert not restore.is_visible()
    page.click("#medvqa-new")
    restore.wait_for(state="visible")
    assert restore.inner_text().strip() == "Restore the cleared conversation (1 answer)"
    assert page.locator("#medvqa-chat [data-testid='bot']").count() == 0
    restore.click()
    page.locator(LAST_REPLY).locator(".medvqa-sources").wait_for(state="attached")
    restore.wait_for(state="hidden")
    assert page.locator("#medvqa-chat [data-testid='user']").inner_text().strip() == QUESTION
    assert page.locator(LAST_REPLY).inner_text() == answer
    page.click("#medvqa-new")
    restore.wait_for(state="visible")
    box.fill("Is this a CT scan?")
    page.click("#medvqa-ask")
    restore.wait_for(state="hidden")
    page.locator(LAST_REPLY).locator(".medvqa-sources").wait_for(state="attached", timeout=120_000)
    assert page.locator("#medvqa-chat [data-testid='user']").count() == 1 and not restore.is_visible()


def test_the_notice_reads_in_the_dark_scheme_and_the_skip_link_reaches_the_question(browser, app_url):  # noqa: F811
    """Gradio follows the system's colour scheme; the notice keeps its light background there, so its text
    must stay dark (it was Gradio's near-white on it). The page's first Tab stop skips to the question, and
    the accordions say whether they are open."""
    page = open_page(browser, app_url, color_scheme="dark")
    colours = page.evaluate("() => [...document.querySelectorAll('#medvqa-notice h1, #medvqa-notice p')]"
                            ".map(el => getComputedStyle(el).color)")
    assert colours and set(colours) == {"rgb(120, 53, 15)"}, colours
    # The question box's keys, under its label, in a colour that reads on the dark background.
    assert page.evaluate("() => getComputedStyle(document.querySelector('#medvqa-question .info-text')).color") \
        == "rgb(212, 212, 216)"
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.textContent") == "Skip to the question"
    page.keyboard.press("Enter")
    assert page.evaluate("() => document.activeElement.closest('#medvqa-question') !== null")
    # Gradio's accordions say whether they are open (it sets only a class), and their ▼ is not read out.
    export = page.locator("button.label-wrap", has_text="Export conversation")
    assert export.get_attribute("aria-expanded") == "false"
    assert export.locator(".icon").get_attribute("aria-hidden") == "true"
    export.click()
    page.wait_for_function("() => [...document.querySelectorAll('button.label-wrap')].some("
                           "b => b.textContent.includes('Export conversation') && b.ariaExpanded === 'true')")
    page.context.close()


def contrast(foreground: str, background: str) -> float:
    """WCAG's contrast ratio of two computed `rgb(...)` colours."""
    def luminance(colour: str) -> float:
        channels = [int(v) / 255 for v in re.findall(r"\d+", colour)[:3]]
        linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    light, dark = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_ask_and_stop_buttons_read_at_wcag_aa_contrast(browser, app_url, scheme):  # noqa: F811
    """Gradio's theme draws Ask (white on orange) at 2.8:1 and Stop at 3.8:1, under WCAG AA's 4.5:1 for
    text; the page's own colours are darker, at rest and under the pointer."""
    page = open_page(browser, app_url, color_scheme=scheme)
    style = "id => { const s = getComputedStyle(document.getElementById(id)); return [s.color, s.backgroundColor]; }"
    for button in ("medvqa-ask", "medvqa-stop"):
        for state in ("rest", "hover"):
            if state == "hover":
                page.hover(f"#{button}")
                page.wait_for_timeout(300)  # past a colour transition
            text, background = page.evaluate(style, button)
            assert contrast(text, background) >= 4.5, (button, state, text, background)
    page.context.close()


def test_an_answer_taller_than_the_chat_is_shown_from_its_first_line(browser, app_url, ui_pipeline,  # noqa: F811
                                                                     monkeypatch):
    """On a narrow screen an answer with its sources can be taller than the chat: the chat shows it from its
    first line (the answer, or "Uncertain"), not scrolled to the end of its sources; the next question
    still scrolls into view."""
    from medvqa.retrieval import Passage

    passages = [Passage(f"p{n}", "A short passage.", f"https://pubmed.ncbi.nlm.nih.gov/{n}/",
                        f"A title long enough to wrap over several lines of a narrow chat, number {n}", "PubMed",
                        "", 1.0) for n in range(1, 13)]
    monkeypatch.setattr(ui_pipeline, "retrieve", lambda *a, **k: passages)
    page = open_page(browser, app_url, width=768, height=1024)
    upload_scan(page, dicom_file("CT_small.dcm"))
    visible = ("() => { const log = document.querySelector('#medvqa-chat .bubble-wrap');"
               " const rows = log.querySelectorAll('.message-row'); const last = rows[rows.length - 1];"
               " const top = last.getBoundingClientRect().top - log.getBoundingClientRect().top;"
               " return [last.offsetHeight > log.clientHeight, top >= 0 && top < 64, last.offsetHeight, top]; }")
    for question in (QUESTION, "Is the heart enlarged?"):
        page.locator("#medvqa-question textarea").fill(question)
        page.click("#medvqa-ask")
        page.wait_for_function("n => document.querySelectorAll('#medvqa-chat .medvqa-sources').length === n",
                               arg=1 if question == QUESTION else 2, timeout=120_000)
        page.wait_for_timeout(500)
        assert page.evaluate(visible)[:2] == [True, True], (question, page.evaluate(visible))
    screenshot(page, "06-tall-answer-narrow-screen.png")
    page.context.close()


def test_oversize_upload_is_refused_with_a_message(page, tmp_path):
    big = tmp_path / "too-big.dcm"
    big.write_bytes(b"\0" * (MAX_UPLOAD_MB * 2**20 + 4096))
    page.set_input_files("#medvqa-upload input[type=file]", str(big))
    toast = page.get_by_text("exceed the maximum allowed size of 1.0 Mb", exact=False)  # Gradio's, before uploading
    toast.first.wait_for(state="visible", timeout=30_000)
    screenshot(page, "05-oversize-refused.png")
    assert page.query_selector("#medvqa-scan") is None
    upload_scan(page, dicom_file("CT_small.dcm"))  # the app still serves this tab


def test_bench_browser_times_typed_and_pasted_questions(browser, app_url):  # noqa: F811
    """scripts/bench_browser.py's measurement against the test app: both questions of two runs,
    typed and pasted, are answered and timed in the page."""
    BENCH_BROWSER.READING_S = 0.5
    times = BENCH_BROWSER.measure(browser, app_url, runs=2)
    assert set(times) == {"first_typed_s", "first_pasted_s", "next_typed_s", "next_pasted_s"}
    for key, values in times.items():
        assert len(values) == 1 and 0 < values[0] < 60, times


def test_passage_text_shows_as_text_in_the_browser(page, ui_pipeline, monkeypatch):  # noqa: F811
    """A passage whose text holds a blank line, a Markdown link and an image with an event handler:
    Chromium shows all of it as text; the only link in the reply is the passage's own URL."""
    from medvqa.retrieval import Passage

    url = "https://pubmed.ncbi.nlm.nih.gov/31001001/"
    hostile = Passage("<img src=x onerror=window.__pwned=1>", "Pleural effusion.\n\n[click me](http://evil.example/x)"
                      "\n\n<img src=x onerror=window.__pwned=2>", url, "Effusion *review*", "PubMed", "", 1.0)
    monkeypatch.setattr(ui_pipeline, "retrieve", lambda *a, **k: [hostile])
    upload_scan(page, dicom_file("CT_small.dcm"))
    page.locator("#medvqa-question textarea").fill(QUESTION)
    page.click("#medvqa-ask")
    reply = page.locator(LAST_REPLY)
    reply.locator(".medvqa-sources").wait_for(state="attached", timeout=120_000)
    hrefs = reply.evaluate("el => [...el.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))")
    assert set(hrefs) == {url}, hrefs
    assert reply.evaluate("el => el.querySelectorAll('img').length") == 0
    assert page.evaluate("() => window.__pwned === undefined")
    reply.locator("details summary").first.click()
    text = reply.locator("details blockquote").first.inner_text()
    assert "[click me](http://evil.example/x)" in text and "<img src=x onerror=window.__pwned=2>" in text
    assert "<img src=x onerror=window.__pwned=1>" in reply.inner_text()
    screenshot(page, "06-passage-shown-as-text.png")


def test_confidence_support_marks_and_image_reliance_in_the_browser(page, ui_pipeline, monkeypatch):  # noqa: F811
    """A closed answer the calibration calls a coin flip is shown as "Uncertain" with its leaning; a
    confident one shows its confidence, a source marked as describing its finding, and
    the note that it does not depend on the image (a Yes forced by a large yes_bias survives a blank image)."""
    from medvqa.confidence import CHOICE, YES_NO, Calibration
    from medvqa.retrieval import Passage

    passage = Passage("p1", "Chest radiograph showing an enlarged cardiac silhouette.",
                      "https://pubmed.ncbi.nlm.nih.gov/31001002/", "Cardiomegaly", "PubMed", "", 1.0)
    monkeypatch.setattr(ui_pipeline, "retrieve", lambda *a, **k: [passage])
    monkeypatch.setattr(ui_pipeline, "calibration", Calibration({YES_NO: (0.0, 0.0), CHOICE: (0.0, 0.0)}))
    monkeypatch.setattr(ui_pipeline.settings.decoder, "yes_bias", 100.0)
    monkeypatch.setattr(ui_pipeline.settings.decoder, "constrained_closed", True)  # this module streams free text
    upload_scan(page, dicom_file("CT_small.dcm"))

    def ask(question: str, expected: str):
        page.locator("#medvqa-question textarea").fill(question)
        page.click("#medvqa-ask")
        reply = page.locator(LAST_REPLY)
        try:  # the last reply is the new one only once it holds the text expected
            page.wait_for_function("([sel, text]) => { const el = document.querySelectorAll(sel); "
                                   "return el.length && el[el.length - 1].innerText.includes(text); }",
                                   arg=["#medvqa-chat [data-testid='bot']", expected], timeout=120_000)
        except Exception:  # noqa: BLE001 - fail with what the page shows instead
            pytest.fail(f"no reply with {expected!r}; the last reply reads {reply.inner_text()!r}")
        reply.locator(".medvqa-sources").wait_for(state="attached", timeout=120_000)
        return reply

    uncertain = ask("Is the heart enlarged?", "Not answered")
    text = uncertain.inner_text()
    assert text.startswith("Uncertain — the model cannot tell from this image") and "leans to Yes" in text
    assert "\\" not in text  # the escaped answer is read as Markdown inside its box, not shown with backslashes
    # Set apart from an answer the app gives by more than colour: a bar beside it.
    assert uncertain.locator(".medvqa-withheld").evaluate("el => getComputedStyle(el).borderLeftWidth") == "4px"
    assert "describes enlarged cardiac silhouette" not in text  # "Uncertain" claims nothing for a source to describe
    assert "Its leaning does not come from the image" in text and "does not depend on the image" not in text
    screenshot(page, "07-uncertain-closed-answer.png")

    monkeypatch.setattr(ui_pipeline, "calibration", Calibration({YES_NO: (0.0, 3.0), CHOICE: (0.0, 3.0)}))
    # Wait for what only the new reply holds (the first one also carries the image-reliance note).
    confident = ask("Is the heart enlarged?", "Confidence: 95 %")
    text = confident.inner_text()
    assert text.startswith("Yes") and "does not depend on the image" in text
    assert "describes enlarged cardiac silhouette" in text
    screenshot(page, "08-confidence-support-and-reliance.png")


def test_logging_in_through_the_browser(browser, ui_pipeline, ui_settings, upload_folder):  # noqa: F811
    """With a login set, Chromium gets Gradio's login form (everything else is behind the login wall),
    which says when the login throttle makes it wait, and the app once logged in."""
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=MAX_UPLOAD_MB)
    _, url, _ = launch(demo, port=None, max_upload_mb=MAX_UPLOAD_MB, auth=("doc", "secret"), block=False, quiet=True)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.locator("input[type=password]").wait_for(state="visible")
        assert page.query_selector("#medvqa-upload") is None
        # Wrong passwords: Gradio's form says so; once the throttle refuses a try (429), which the form
        # alone would not show, the page says how long to wait and when the wait is over.
        for _ in range(6):
            page.locator("input[type=text]").first.fill("doc")
            page.locator("input[type=password]").fill("wrong")
            with page.expect_response(lambda response: response.url.endswith("/login")) as answer:
                page.locator("input[type=password]").press("Enter")
            if answer.value.status == 429:
                break
        assert answer.value.status == 429
        note = page.locator("#medvqa-login-note[role=alert]")
        assert "Too many failed logins" in note.inner_text() and "please wait 1 s" in note.inner_text()
        page.wait_for_function("() => document.querySelector('#medvqa-login-note').textContent"
                               ".startsWith('You can try to log in again now')", timeout=5_000)
        page.locator("input[type=text]").first.fill("doc")
        page.locator("input[type=password]").fill("secret")
        page.locator("input[type=password]").press("Enter")
        page.wait_for_selector("#medvqa-upload input[type=file]", state="attached")
        upload_scan(page, dicom_file("CT_small.dcm"))
    finally:
        context.close()
        demo.close()


def test_two_questions_asked_100_ms_apart_both_get_answers(page):
    """A question asked while the previous answer is still coming (or still warming the next turn) is
    queued and answered, never dropped; the box is free for it at once and keeps what is typed."""
    upload_scan(page, dicom_file("CT_small.dcm"))
    box = page.locator("#medvqa-question textarea")
    questions = ["Is there a pleural effusion?", "Is the heart enlarged?", "Is this a CT scan?"]

    def ask(text: str) -> None:
        box.fill(text)
        page.click("#medvqa-ask")

    def answered(count: int) -> None:
        page.wait_for_function(
            "n => document.querySelectorAll(\"#medvqa-chat [data-testid='bot'] .medvqa-sources\").length >= n",
            arg=count, timeout=240_000)

    # What a screen reader is given: each answer once finished, the first though a question waited behind it.
    page.evaluate("() => { window.heard = []; new MutationObserver(() => window.heard.push("
                  "document.querySelector('#medvqa-announce').textContent)).observe("
                  "document.querySelector('#medvqa-announce'), {childList: true, characterData: true}); }")
    ask(questions[0])
    page.wait_for_timeout(100)
    ask(questions[1])
    answered(2)
    # The moment an answer is complete (the previous turn is still warming the next one), ask again.
    ask(questions[2])
    answered(3)
    users = page.locator("#medvqa-chat [data-testid='user']")
    assert [users.nth(i).inner_text().strip() for i in range(users.count())] == questions
    bots = page.locator("#medvqa-chat [data-testid='bot']")
    assert bots.count() == 3 and "medvqa-error" not in page.inner_html("#medvqa-chat")
    assert box.input_value() == ""
    # Each answer read once (two finished together are read in one announcement), none twice.
    page.wait_for_function("() => window.heard.join(' ').split('Confidence').length - 1 >= 3")
    heard = " ".join(page.evaluate("() => window.heard"))
    assert heard.count("Confidence") == 3 and heard.startswith(bots.nth(0).inner_text().splitlines()[0].strip())
    screenshot(page, "07-two-questions-queued.png")


def test_closing_the_tab_stops_its_pacs_find(browser, ui_pipeline, ui_settings, upload_folder):  # noqa: F811
    """A Find waits on an archive that holds its first answer; the tab is closed. The Find ends (the
    page's unload event cancelled it, not its deadline) and, once the archive answers, no further
    query is made."""
    from medvqa.pacs import Pacs, PacsLimits
    from medvqa.ui import build_app, launch

    fake = load_script("fake_archive")
    hold = threading.Event()
    with fake.FakeArchive(fake.Behaviour(study_copies=10, hold=hold)) as archive:
        demo = build_app(ui_pipeline, ui_settings, max_upload_mb=MAX_UPLOAD_MB, 
                         pacs=Pacs(archive.url, env={}, limits=PacsLimits(find_s=600)))
        _, url, _ = launch(demo, port=None, max_upload_mb=MAX_UPLOAD_MB, block=False, quiet=True)
        remote = next(fn.fn.__self__ for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "find")
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        try:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(url)
            page.locator("#medvqa-pacs-id input").fill("ACC-1")
            page.click("#medvqa-pacs-find")
            wait_until(lambda: len(archive.requests) == 1 and remote._running, "the Find did not reach the archive")
            context.close()  # the tab goes while its first query waits
            wait_until(lambda: not remote._running, "the Find went on after its tab was closed")
            hold.set()
            time.sleep(1)  # time for a query that should not come
            assert len(archive.requests) == 1
        finally:
            hold.set()
            context.close()
            demo.close()


def wait_until(condition, failure: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(failure)
        time.sleep(0.05)


def test_a_window_box_emptied_and_left_gets_its_value_back(page):  # noqa: F811
    """Emptied, a number box would report 0: a window of centre 0 was applied without a word."""
    page.set_input_files("#medvqa-upload input[type=file]", dicom_file("CT_small.dcm"))
    page.wait_for_selector("#medvqa-scan")
    caption = page.inner_text("#medvqa-viewer .medvqa-caption")
    center = page.locator("#medvqa-center input[type=number]")
    shown = center.input_value()
    center.click()
    page.keyboard.press("Control+a")
    page.keyboard.press("Backspace")
    page.keyboard.press("Enter")
    page.wait_for_timeout(1500)
    assert page.inner_text("#medvqa-viewer .medvqa-caption") == caption and center.input_value() == shown
