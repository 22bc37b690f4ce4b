"""A study in a real browser (`pytest -m browser`): a 40-slice CT series, zipped in shuffled order,
opens as one series in position order; the slice slider moves through it (keyboard too); a question
is answered about the slice shown; the export names series, slice and window; no planted patient
data reaches the page. Screenshots go to artifacts/browser/ as in tests/test_browser.py."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from medvqa.imaging import open_study
from tests.test_browser import LAST_REPLY, browser, page, screenshot  # noqa: F401 - fixtures
from tests.test_ui import app_url, ui_app, ui_pipeline, ui_settings, upload_folder  # noqa: F401 - fixtures

from .imaging_helpers import PLANTED, ct_series, zip_bytes

pytestmark = pytest.mark.browser

def wait_for_caption(page, text: str) -> None:  # noqa: F811
    page.wait_for_function("text => document.querySelector('#medvqa-viewer .medvqa-caption')?.innerText"
                           ".includes(text)", arg=text)


def shown_pixels(page) -> np.ndarray:  # noqa: F811
    from io import BytesIO

    from PIL import Image

    src = page.get_attribute("#medvqa-scan", "src")
    return np.asarray(Image.open(BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))


def test_a_zipped_series_in_the_browser(page, tmp_path, ui_pipeline):  # noqa: F811
    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{PLANTED['PatientName']}/{n:03d}.dcm": f for n, f in enumerate(ct_series(40))}))
    series = open_study(archive).series[0]
    page.set_input_files("#medvqa-upload input[type=file]", str(archive))
    wait_for_caption(page, "series 1 · slice 21 of 40 · 0 mm")
    assert page.locator("#medvqa-series input").input_value() == "Series 1: CT, 40 slices"
    assert "Slice (of 40)" in page.inner_text("#medvqa-frame")

    # The slider scrolls with the keyboard once it has focus, and takes a typed slice number.
    page.focus("#medvqa-frame input[type=range]")
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    wait_for_caption(page, "series 1 · slice 24 of 40 · 7.5 mm")
    # The wheel over the scan scrolls slices (a notch a slice, down to the next), not the page.
    page.hover("#medvqa-scan")
    scrolled = page.evaluate("() => window.scrollY")
    for _ in range(2):
        page.mouse.wheel(0, 100)
        page.wait_for_timeout(100)
    wait_for_caption(page, "series 1 · slice 26 of 40 · 12.5 mm")
    page.mouse.wheel(0, -100)
    wait_for_caption(page, "series 1 · slice 25 of 40 · 10 mm")
    assert page.evaluate("() => window.scrollY") == scrolled
    number = page.locator("#medvqa-frame input[type=number]")
    number.fill("30")
    number.press("Tab")
    wait_for_caption(page, "series 1 · slice 30 of 40 · 22.5 mm")
    page.click("#medvqa-preset input")
    page.get_by_role("option", name="Lung (C -600 / W 1500)").click()
    wait_for_caption(page, "lung window (C -600 / W 1500)")
    assert np.array_equal(shown_pixels(page), series.render("lung", 29).pixels)

    asked_on = []
    real_ask = ui_pipeline.ask

    def ask(conversation, *args, **kwargs):
        asked_on.append(conversation.image)
        yield from real_ask(conversation, *args, **kwargs)

    ui_pipeline.ask = ask
    try:
        page.locator("#medvqa-question textarea").fill("Is there a mass in the upper lobe?")
        page.click("#medvqa-ask")
        page.locator(LAST_REPLY).locator(".medvqa-sources").wait_for(state="attached", timeout=120_000)
    finally:
        del ui_pipeline.ask
    assert len(asked_on) == 1 and np.array_equal(asked_on[0], series.render("lung", 29).pixels)
    screenshot(page, "07-series-slice.png")

    page.get_by_text("Export conversation").click()
    page.click("#medvqa-export")
    link = page.locator("#medvqa-export-links a[download='medvqa-conversation.json']")
    link.wait_for(state="attached")
    record = json.loads(base64.b64decode(link.get_attribute("href").split(",", 1)[1]))
    (turn,) = record["turns"]
    assert (turn["series"], turn["slice"], turn["slices"], turn["position_mm"]) == (1, 30, 40, 22.5)
    assert turn["window"].startswith("lung window")

    content = page.content()
    found = [part for value in PLANTED.values() for part in re.split(r"[\s^]+", value) if part in content]
    assert not found, found


def test_two_orientations_are_said_and_a_bomb_refused(page, tmp_path):  # noqa: F811
    import pydicom

    uid = pydicom.uid.generate_uid()
    mixed = tmp_path / "mixed.zip"
    mixed.write_bytes(zip_bytes({f"{n}.dcm": f for n, f in enumerate(
        ct_series(4, series_uid=uid) + ct_series(3, series_uid=uid, orientation=(0, 1, 0, 0, 0, -1)))}))
    page.set_input_files("#medvqa-upload input[type=file]", str(mixed))
    page.locator("#medvqa-series-notes").get_by_text("2 different orientations").wait_for()
    bomb = tmp_path / "bomb.zip"
    bomb.write_bytes(zip_bytes({"slice.dcm": bytes(60 * 2**20)}))
    page.set_input_files("#medvqa-upload input[type=file]", str(bomb))
    page.locator(LAST_REPLY).get_by_text("zip bomb").wait_for()
    screenshot(page, "08-zip-bomb-refused.png")


def zoom_state(page) -> dict:  # noqa: F811
    return page.evaluate("""() => {
      const img = document.querySelector('#medvqa-scan'), frame = img.parentElement;
      return {label: document.querySelector('#medvqa-zoom output').textContent,
              hidden: document.querySelector('#medvqa-zoom').hidden, zoomed: frame.classList.contains('medvqa-zoomed'),
              ratio: img.offsetWidth / frame.offsetWidth, left: frame.scrollLeft, top: frame.scrollTop,
              x: (frame.scrollLeft + frame.clientWidth / 2) / img.offsetWidth,
              y: (frame.scrollTop + frame.clientHeight / 2) / img.offsetHeight};
    }""")


def test_zoom_follows_a_region_through_the_slices_and_the_next_scan_is_whole(page, tmp_path):  # noqa: F811
    from tests.test_ui import dicom_file

    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n:03d}.dcm": f for n, f in enumerate(ct_series(40))}))
    assert page.locator("#medvqa-zoom").is_hidden()  # no scan, no zoom
    page.set_input_files("#medvqa-upload input[type=file]", str(archive))
    wait_for_caption(page, "slice 21 of 40")
    state = zoom_state(page)
    assert (state["label"], state["hidden"], state["zoomed"], round(state["ratio"], 3)) == ("100 %", False, False, 1)
    assert page.locator("#medvqa-zoom [data-zoom=out]").is_disabled()

    page.click("#medvqa-zoom [data-zoom=in]")
    page.click("#medvqa-zoom [data-zoom=in]")
    state = zoom_state(page)
    assert state["label"] == "150 %" and state["zoomed"] and abs(state["ratio"] - 1.5) < 0.01
    assert abs(state["x"] - 0.5) < 0.02 and abs(state["y"] - 0.5) < 0.02  # about the middle

    # Shift+drag moves the zoomed scan and leaves the window as it was.
    caption = page.inner_text("#medvqa-viewer .medvqa-caption")
    page.locator("#medvqa-viewer .medvqa-frame").scroll_into_view_if_needed()
    box = page.locator("#medvqa-viewer .medvqa-frame").bounding_box()
    middle = (box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.keyboard.down("Shift")
    page.mouse.move(*middle)
    page.mouse.down()
    page.mouse.move(middle[0] + 60, middle[1] + 40, steps=5)
    page.mouse.up()
    page.keyboard.up("Shift")
    moved = zoom_state(page)
    assert moved["left"] < state["left"] - 40 and moved["top"] < state["top"] - 25, (state, moved)
    page.wait_for_timeout(500)
    assert page.inner_text("#medvqa-viewer .medvqa-caption") == caption

    # The next slice is shown at the same zoom and place.
    page.hover("#medvqa-scan")
    page.mouse.wheel(0, 100)
    wait_for_caption(page, "slice 22 of 40")
    follows = zoom_state(page)
    assert follows["label"] == "150 %" and abs(follows["left"] - moved["left"]) <= 1 \
        and abs(follows["top"] - moved["top"]) <= 1, (moved, follows)

    screenshot(page, "08-series-zoomed.png")

    # Ctrl+wheel zooms about the pointer: the point of the scan under it stays under it.
    page.locator("#medvqa-viewer .medvqa-frame").scroll_into_view_if_needed()
    frame = page.locator("#medvqa-viewer .medvqa-frame").bounding_box()
    pointer = (frame["x"] + 100, frame["y"] + 80)
    under = "([x, y]) => { const img = document.querySelector('#medvqa-scan'), r = img.getBoundingClientRect();" \
            " return [(x - r.left) / r.width, (y - r.top) / r.height]; }"
    page.mouse.move(*pointer)
    before = page.evaluate(under, list(pointer))
    zoom_before = page.evaluate("() => window.visualViewport.scale")
    page.keyboard.down("Control")
    page.mouse.wheel(0, -100)
    page.keyboard.up("Control")
    page.wait_for_function("() => document.querySelector('#medvqa-zoom output').textContent !== '150 %'")
    after = page.evaluate(under, list(pointer))
    assert abs(after[0] - before[0]) < 0.01 and abs(after[1] - before[1]) < 0.01, (before, after)
    assert page.evaluate("() => window.visualViewport.scale") == zoom_before  # the page itself not zoomed
    assert int(zoom_state(page)["label"].split()[0]) > 150

    # Slice after slice at that zoom (not one of the buttons' steps), the scan stays where it was put.
    placed = zoom_state(page)
    for n in range(23, 31):
        page.mouse.wheel(0, 100)
        wait_for_caption(page, f"slice {n} of 40")
    page.wait_for_timeout(200)
    later = zoom_state(page)
    assert abs(later["left"] - placed["left"]) <= 1 and abs(later["top"] - placed["top"]) <= 1, (placed, later)

    # A plain drag on a zoomed CT still sets its window.
    assert "user window" not in page.inner_text("#medvqa-viewer .medvqa-caption")
    page.mouse.down()
    page.mouse.move(pointer[0] + 60, pointer[1], steps=5)
    page.mouse.up()
    wait_for_caption(page, "user window")
    assert abs(zoom_state(page)["left"] - later["left"]) <= 1

    # From the keyboard: the scan takes the focus once zoomed, and 0 shows it whole.
    page.focus("#medvqa-viewer .medvqa-frame")
    page.keyboard.press("0")
    state = zoom_state(page)
    assert state["label"] == "100 %" and not state["zoomed"]
    page.keyboard.press("+")
    assert zoom_state(page)["label"] == "125 %"

    # Another scan is shown whole.
    page.set_input_files("#medvqa-upload input[type=file]", dicom_file("CT_small.dcm"))
    wait_for_caption(page, "DICOM · 128×128 px")
    state = zoom_state(page)
    assert state["label"] == "100 %" and not state["zoomed"] and round(state["ratio"], 3) == 1


def test_invert_is_for_the_eye_kept_through_the_slices_and_the_next_scan_is_plain(page, tmp_path):  # noqa: F811
    from tests.test_ui import dicom_file

    def inverted() -> tuple[bool, str, str]:
        return tuple(page.evaluate("""() => {
          const img = document.querySelector('#medvqa-scan');
          return [img.classList.contains('medvqa-inverted'), getComputedStyle(img).filter,
                  document.querySelector('#medvqa-zoom [data-invert]').getAttribute('aria-pressed')];
        }"""))

    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n:03d}.dcm": f for n, f in enumerate(ct_series(12))}))
    page.set_input_files("#medvqa-upload input[type=file]", str(archive))
    wait_for_caption(page, "slice 7 of 12")
    source = page.get_attribute("#medvqa-scan", "src")
    assert inverted() == (False, "none", "false")
    page.click("#medvqa-zoom [data-invert]")
    assert inverted() == (True, "invert(1)", "true")
    assert page.get_attribute("#medvqa-scan", "src") == source  # the same image: the model's is not touched
    page.hover("#medvqa-scan")
    page.mouse.wheel(0, 100)
    wait_for_caption(page, "slice 8 of 12")
    page.wait_for_timeout(200)
    assert inverted()[0], "the next slice is shown inverted too"
    page.focus("#medvqa-viewer .medvqa-frame")
    page.keyboard.press("i")
    assert inverted() == (False, "none", "false")
    page.keyboard.press("i")
    page.set_input_files("#medvqa-upload input[type=file]", dicom_file("CT_small.dcm"))
    wait_for_caption(page, "DICOM · 128×128 px")
    page.wait_for_timeout(200)
    assert inverted() == (False, "none", "false"), "another scan is shown as it is"


def test_a_tall_narrow_scan_is_shown_whole_within_the_window(page, tmp_path):  # noqa: F811
    from PIL import Image

    tall = tmp_path / "tall.png"
    Image.fromarray((np.arange(2000 * 40) % 251).astype(np.uint8).reshape(2000, 40)).save(tall)
    page.set_input_files("#medvqa-upload input[type=file]", str(tall))
    wait_for_caption(page, "40×2000 px")
    page.wait_for_timeout(300)
    sizes = page.evaluate("""() => {
      const img = document.querySelector('#medvqa-scan');
      return [img.getBoundingClientRect().height, window.innerHeight, document.documentElement.scrollHeight];
    }""")
    shown, window_height, page_height = sizes
    assert 0.5 * window_height < shown <= 0.8 * window_height + 1 and page_height < 3 * window_height, sizes
    page.click("#medvqa-zoom [data-zoom=in]")  # zoomed, it still scrolls within its frame
    page.wait_for_timeout(200)
    frame_height = page.evaluate("() => document.querySelector('#medvqa-viewer .medvqa-frame').offsetHeight")
    assert frame_height <= 0.8 * window_height + 1


def test_play_steps_through_the_slices_and_round_again_until_paused(page, tmp_path):  # noqa: F811
    from tests.test_ui import dicom_file

    play = page.locator("#medvqa-zoom [data-play]")
    page.set_input_files("#medvqa-upload input[type=file]", dicom_file("CT_small.dcm"))
    wait_for_caption(page, "DICOM · 128×128 px")
    assert play.is_hidden()  # one frame: nothing to play
    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n:03d}.dcm": f for n, f in enumerate(ct_series(6))}))
    page.set_input_files("#medvqa-upload input[type=file]", str(archive))
    wait_for_caption(page, "slice 4 of 6")
    play.wait_for(state="visible")
    play.click()
    assert play.get_attribute("aria-pressed") == "true" and play.inner_text() == "Pause"
    for n in (5, 6, 1, 2):  # on, and round from the last slice to the first
        wait_for_caption(page, f"slice {n} of 6")
    play.click()
    assert play.get_attribute("aria-pressed") == "false" and play.inner_text() == "Play"
    page.wait_for_timeout(600)
    held = page.inner_text("#medvqa-viewer .medvqa-caption")
    page.wait_for_timeout(600)
    assert page.inner_text("#medvqa-viewer .medvqa-caption") == held, "it stopped"
    # The p key plays too, and the wheel over the scan takes the slices back in hand.
    page.focus("#medvqa-viewer .medvqa-frame")
    page.keyboard.press("p")
    assert play.get_attribute("aria-pressed") == "true"
    page.hover("#medvqa-scan")
    page.mouse.wheel(0, 100)
    assert play.get_attribute("aria-pressed") == "false"


def test_measuring_a_distance_in_mm_and_in_pixels(page, tmp_path):  # noqa: F811
    from PIL import Image

    from tests.test_ui import dicom_file

    page.set_input_files("#medvqa-upload input[type=file]", dicom_file("CT_small.dcm"))  # 128 x 128, 0.661468 mm
    wait_for_caption(page, "DICOM · 128×128 px")
    caption = page.inner_text("#medvqa-viewer .medvqa-caption")
    measure = page.locator("#medvqa-zoom [data-tool=measure]")
    measure.click()
    assert measure.get_attribute("aria-pressed") == "true"

    def drag(fractions: tuple[float, float, float, float]) -> None:
        page.locator("#medvqa-viewer .medvqa-frame").scroll_into_view_if_needed()
        box = page.locator("#medvqa-scan").bounding_box()
        x0, y0, x1, y1 = fractions
        page.mouse.move(box["x"] + x0 * box["width"], box["y"] + y0 * box["height"])
        page.mouse.down()
        page.mouse.move(box["x"] + x1 * box["width"], box["y"] + y1 * box["height"], steps=6)
        page.mouse.up()

    length = "#medvqa-zoom output.medvqa-length"
    drag((0.25, 0.5, 0.75, 0.5))  # 64 of the scan's pixels across
    shown = page.inner_text(length)
    assert shown.endswith(" mm") and abs(float(shown.split()[0]) - 64 * 0.661468) < 0.5, shown
    page.wait_for_timeout(500)
    assert page.inner_text("#medvqa-viewer .medvqa-caption") == caption  # measuring is not windowing
    drag((0.25, 0.25, 0.25 + 30 / 128, 0.25 + 40 / 128))  # a new line replaces it: 50 pixels on the slant
    assert abs(float(page.inner_text(length).split()[0]) - 50 * 0.661468) < 0.5

    # Another window or zoom keeps the line over the same points; Esc ends measuring.
    page.click("#medvqa-preset input")
    page.get_by_role("option", name="Lung (C -600 / W 1500)").click()
    wait_for_caption(page, "lung window (C -600 / W 1500)")
    page.click("#medvqa-zoom [data-zoom=in]")
    ends = page.evaluate("""() => {
      const img = document.querySelector('#medvqa-scan'), line = document.querySelector('.medvqa-overlay line');
      const svg = line.ownerSVGElement.getBoundingClientRect(), r = img.getBoundingClientRect();
      return [svg.width / r.width, svg.height / r.height, Number(line.getAttribute('x1')), Number(line.getAttribute('x2'))];
    }""")
    assert abs(ends[0] - 1) < 0.01 and abs(ends[1] - 1) < 0.01 and abs(ends[2] - 32) < 1 and abs(ends[3] - 62) < 1
    screenshot(page, "09-measured.png")
    page.keyboard.press("Escape")
    assert measure.get_attribute("aria-pressed") == "false" and page.inner_text(length) == ""
    assert page.locator(".medvqa-overlay").count() == 0

    # A line belongs to its slice: the next slice is shown without it.
    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n:03d}.dcm": f for n, f in enumerate(ct_series(5, PixelSpacing=[0.5, 0.5]))}))
    page.set_input_files("#medvqa-upload input[type=file]", str(archive))
    wait_for_caption(page, "slice 3 of 5")
    measure.click()
    drag((0.2, 0.2, 0.8, 0.2))
    assert page.locator(".medvqa-overlay").count() == 1 and page.inner_text(length).endswith(" mm")
    page.hover("#medvqa-scan")
    page.mouse.wheel(0, 100)
    wait_for_caption(page, "slice 4 of 5")
    assert page.locator(".medvqa-overlay").count() == 0 and page.inner_text(length) == ""

    # A picture has no pixel spacing: its own pixels, and the page says why.
    picture = tmp_path / "picture.png"
    Image.fromarray(np.full((100, 200), 128, np.uint8)).save(picture)
    page.set_input_files("#medvqa-upload input[type=file]", str(picture))
    wait_for_caption(page, "PNG · 200×100 px")
    assert measure.get_attribute("aria-pressed") == "true"  # measuring stays on for the next scan
    drag((0.1, 0.5, 0.6, 0.5))
    assert page.inner_text(length) == "100 px (the scan gives no pixel spacing)"


def test_the_value_of_a_pixel_in_hounsfield_units_and_as_stored(page, tmp_path):  # noqa: F811
    from PIL import Image

    from medvqa.imaging import open_scan
    from tests.test_ui import dicom_file

    ct = dicom_file("CT_small.dcm")
    page.set_input_files("#medvqa-upload input[type=file]", ct)
    wait_for_caption(page, "DICOM · 128×128 px")
    value = page.locator("#medvqa-zoom [data-tool=probe]")
    value.click()
    assert value.get_attribute("aria-pressed") == "true"
    page.locator("#medvqa-viewer .medvqa-frame").scroll_into_view_if_needed()
    box = page.locator("#medvqa-scan").bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.6)
    shown = page.locator("#medvqa-probe .medvqa-probe")
    shown.wait_for(state="visible")
    found = re.fullmatch(r"(-?\d+) HU at column (\d+), row (\d+)", page.inner_text("#medvqa-probe"))
    assert found, page.inner_text("#medvqa-probe")
    hu, column, row = (int(part) for part in found.groups())
    assert abs(column - (0.3 * 128 + 1)) <= 1 and abs(row - (0.6 * 128 + 1)) <= 1
    assert hu == round(open_scan(ct).value_at(0, row - 1, column - 1))
    assert page.locator(".medvqa-overlay circle").count() == 2  # the point marked
    # Measure takes over from Value (one tool at a time), and the value shown goes.
    page.click("#medvqa-zoom [data-tool=measure]")
    assert value.get_attribute("aria-pressed") == "false" and shown.is_hidden()
    page.click("#medvqa-zoom [data-tool=probe]")
    assert shown.is_hidden() and page.locator(".medvqa-overlay").count() == 0  # that point's value went with its mark

    picture = tmp_path / "colour.png"
    Image.fromarray(np.dstack([np.full((60, 80), c, np.uint8) for c in (200, 30, 90)])).save(picture)
    page.set_input_files("#medvqa-upload input[type=file]", str(picture))
    wait_for_caption(page, "PNG · 80×60 px")
    page.locator("#medvqa-viewer .medvqa-frame").scroll_into_view_if_needed()
    box = page.locator("#medvqa-scan").bounding_box()
    page.mouse.click(box["x"] + 5, box["y"] + 5)
    page.wait_for_function("() => document.querySelector('#medvqa-probe').innerText.startsWith('RGB 200, 30, 90 at ')")
    page.keyboard.press("Escape")
    assert value.get_attribute("aria-pressed") == "false"
    assert page.locator("#medvqa-probe .medvqa-probe").is_hidden()
