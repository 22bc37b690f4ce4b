"""The scan viewer: the image as an inline PNG, and the window controls' choices and ranges.

The PNG is inline (a data: URL) so that no rendering of a scan is written to Gradio's cache.
"""

from __future__ import annotations

import base64
import html
import io
import math
import secrets
import weakref
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..imaging import (BURNED_IN_NOTE, WINDOW_PRESETS, Scan, ScanSource, Series, Study, Window, burned_in,
                       in_hounsfield_units)

DISPLAY_MAX_SIDE = 1024  # the viewer shows at most this many pixels a side (the model gets all of them)

_EMPTY_VIEWER = '<div class="medvqa-viewer medvqa-empty"><p>No scan loaded.</p></div>'

_PRESET_LABELS = [("File default", "file"), ("Automatic (0.5–99.5 %)", "auto")] + [
    (f"{name.replace('_', ' ').capitalize()} (C {w.center:g} / W {w.width:g})", name)
    for name, w in WINDOW_PRESETS.items()] + [("Custom (sliders)", "custom")]
# A picture's values (a 16-bit PNG, a float TIFF) pass no modality LUT, so they are not Hounsfield
# units and a CT preset would window them arbitrarily; nor does the file carry a window of its own.
_PICTURE_PRESET_LABELS = [("Automatic (0.5–99.5 %)", "auto"), ("Custom (sliders)", "custom")]
# A DICOM of another modality than CT (MR, X-ray, ultrasound...) is in no Hounsfield units either: its own
# window, the automatic one and the sliders.
_NON_CT_PRESET_LABELS = [("File default", "file"), ("Automatic (0.5–99.5 %)", "auto"), ("Custom (sliders)", "custom")]


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _view_key(source) -> str:
    """A random key for what is being viewed (a file, a series): the same across its frames and windows,
    another for the next file or series. The page keeps its zoom while the key stays (see page.js).
    Random, not counted: a count would tell each page how many scans the app has opened for anyone."""
    if source not in _VIEWS:
        _VIEWS[source] = secrets.token_hex(8)
    return _VIEWS[source]


def _viewer_html(scan: Scan, view: str = "") -> str:
    """The scan as the model sees it (downscaled for display only), with a caption of what it is. `view`
    (_view_key) tells the page whether this is another frame or window of the scan shown, whose zoom it keeps.
    The image's size is given so that the page knows its shape before the image is decoded."""
    pixels = scan.pixels  # (H, W, 3) uint8
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if max(image.size) > DISPLAY_MAX_SIDE:
        image.thumbnail((DISPLAY_MAX_SIDE, DISPLAY_MAX_SIDE), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=3)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    caption = (f"{scan.source_format.upper()} · {pixels.shape[1]}×{pixels.shape[0]} px · "
               f"{_place_caption(scan)} · {scan.describe_window()}")
    # A figure and its caption: a screen reader reads what is shown with the image (the page announces the
    # viewer's changes, see page.js).
    scale = _measure_scale(scan, image.width, image.height)
    return (f'<figure class="medvqa-viewer" data-view="{html.escape(view)}" data-frame="{scan.frame_index}" '
            f'data-measure="{html.escape(scale)}"><div class="medvqa-frame" role="group" '
            f'aria-label="Scan: + and − zoom, 0 shows it whole, i inverts it, p plays its frames, the arrow keys '
            f'move it when zoomed">'
            f'<img id="medvqa-scan" alt="The scan as the model sees it" width="{image.width}" '
            f'height="{image.height}" src="data:image/png;base64,{encoded}"/></div>'
            f'<figcaption class="medvqa-caption">{html.escape(caption)}</figcaption>'
            + (f'<p class="medvqa-warning" role="note">⚠ {html.escape(BURNED_IN_NOTE)}</p>' if burned_in(scan.safe_meta)
               else "") + '</figure>')


def _measure_scale(scan: Scan, shown_width: int, shown_height: int) -> str:
    """What one pixel of the image shown measures, for the page's ruler: "ROW,COLUMN,UNIT,NOTE" (a pixel's
    height and width). In millimetres from the DICOM's Pixel Spacing (in the patient), else from its Imager
    Pixel Spacing (at the detector: a radiograph's anatomy is magnified there, and the note says so; also
    where Pixel Spacing only repeats it), else
    in the scan's own pixels (a picture, or a DICOM that gives no spacing)."""
    rows, columns = scan.pixels.shape[:2]
    down, across = rows / shown_height, columns / shown_width  # the scan's pixels per pixel shown
    imager = _spacing(scan.safe_meta.get("ImagerPixelSpacing", ""))
    for spacing in (_spacing(scan.safe_meta.get("PixelSpacing", "")), imager):
        if spacing is not None:
            # A radiograph's Pixel Spacing that only repeats its Imager Pixel Spacing is not calibrated to
            # the patient either.
            note = "at the detector" if spacing == imager else ""
            return f"{spacing[0] * down:.6g},{spacing[1] * across:.6g},mm,{note}"
    return f"{down:.6g},{across:.6g},px,"


def _spacing(text: str) -> tuple[float, float] | None:
    """Pixel Spacing's two values (between rows, between columns) in mm, if both are usable."""
    try:
        values = [float(part) for part in text.split("\\")]
    except ValueError:
        return None
    if len(values) != 2 or not all(0 < value < 1e4 for value in values):
        return None
    return values[0], values[1]


def _pixel_value_text(source: ScanSource | Series, value: float | tuple[int, ...], row: int, column: int) -> str:
    """What the Value tool says of a pixel: in Hounsfield units for a CT, a colour's channels (as shown),
    else the file's value after its rescale; and where it is (1-based, in the scan's own pixels)."""
    where = f"at column {column + 1}, row {row + 1}"
    if isinstance(value, tuple):
        return f"RGB {', '.join(str(v) for v in value)} {where}"
    number = f"{value:.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:.4g}"
    if in_hounsfield_units(source):
        return f"{number} HU {where}"
    return f"value {number} {where}" + ("" if source.is_dicom else " (as stored: no unit)")


def _probe_html(shown: str, click: str, text: str) -> str:
    """The Value tool's answer, marked with the view and frame it was read on and the click it answers:
    the page shows it only beside that click's mark (page.js)."""
    return (f'<span class="medvqa-probe" data-for="{html.escape(shown)}" data-click="{html.escape(click)}">'
            f'{html.escape(text)}</span>')


def _place_caption(scan: Scan) -> str:
    """"frame 2 of 5", or "series 1 · slice 12 of 40 · 27.5 mm" for a slice of a series."""
    if scan.series is None:
        return f"frame {scan.frame_index + 1} of {scan.frame_count}"
    position = f" · {scan.position_mm:g} mm" if scan.position_mm is not None else ""
    return f"series {scan.series} · slice {scan.frame_index + 1} of {scan.frame_count}{position}"


def _series_choices(study: Study | None) -> list[tuple[str, int]]:
    """The series picker's entries, from allow-listed fields only (modality, slice count)."""
    return [(series.describe(), series.number) for series in study.series] if study else []


def _study_notes(study: Study | None, number: int) -> str:
    """What is odd about the series shown, and which files were skipped, as escaped HTML."""
    if study is None:
        return ""
    series = next(series for series in study.series if series.number == number)
    lines = [f"⚠ {warning}" for warning in series.warnings] + study.notes
    return "".join(f'<p class="medvqa-caption">{html.escape(line)}</p>' for line in lines)


def _scan_meta(scan: Scan) -> dict:
    """What the metadata panel shows: the format and the scan's non-identifying fields only."""
    return {"format": scan.source_format, **scan.safe_meta}


def _preset_value(window: Window) -> str:
    """The dropdown entry that names `window`; "custom" for one set with the sliders."""
    if window.name in ("file", "file-lut"):
        return "file"
    if window.name == "auto-percentile":
        return "auto"
    return window.name if window.name in WINDOW_PRESETS else "custom"


@dataclass(frozen=True)
class _WindowControls:
    """What the window preset dropdown and the centre and width sliders offer for a scan."""

    presets: list[tuple[str, str]]  # the dropdown's (label, value) entries; empty: the controls are hidden
    center_range: tuple[float, float]
    width_range: tuple[float, float]
    step: float  # of both sliders
    user_function: str  # the VOI LUT function of a window set with the sliders

    def rounded(self, value: float) -> float:
        """A slider's value, to a few more decimals than its step shows."""
        return round(float(value), max(3, 2 - math.floor(math.log10(self.step))))


def _window_controls(source: ScanSource | Series, scan: Scan) -> _WindowControls:
    """The window controls for `scan`: none for colour and 8-bit grey, shown as stored; a DICOM's
    presets (the CT ones for a CT only) and sliders over the CT presets and around its own window; and for a picture deeper than
    8 bits (16-bit PNG, 16-bit or float TIFF, rendered through a window), its automatic window and
    sliders over its own values."""
    current = scan.window or Window(40, 400, "none")
    if source.is_dicom or source.value_range is None:
        presets = ((_PRESET_LABELS if in_hounsfield_units(source) else _NON_CT_PRESET_LABELS)
                   if scan.window is not None and source.is_dicom else [])
        default = source.default_window or current
        low = min(-1100.0, default.center - 2 * default.width, current.center)
        high = max(3000.0, default.center + 2 * default.width, current.center)
        widest = float(np.ceil(max(4000.0, 4 * default.width, current.width)))
        return _WindowControls(presets, (float(np.floor(low)), float(np.ceil(high))), (1.0, widest), 1.0, "LINEAR")
    shown_as_stored = source.default_window is None or source.default_window.name == "none"
    lowest, highest = source.value_range
    span = highest - lowest
    # Whole steps over a hundred values or more, finer ones below (a float image's may span less than one).
    step = 1.0 if span >= 100 or span == 0 else 10.0 ** math.floor(math.log10(span / 100))
    low, high = min(lowest, current.center), max(highest, current.center, lowest + step)
    widest = max(span, current.width, 2 * step)
    # LINEAR_EXACT, as the automatic window: centre ± width / 2 is mapped onto black to white, and a
    # window narrower than one unit is allowed (DICOM's LINEAR needs a width of at least 1).
    return _WindowControls([] if shown_as_stored else _PICTURE_PRESET_LABELS,
                           (_on_step(low, step, math.floor), _on_step(high, step, math.ceil)),
                           (step, _on_step(widest, step, math.ceil)), step, "LINEAR_EXACT")


def _on_step(value: float, step: float, rounding) -> float:
    """`value` rounded (math.floor or math.ceil) to a whole number of steps, without float noise."""
    return round(rounding(value / step) * step, 12)
