"""The scan viewer: the image as an inline PNG, and the window controls' choices and ranges.

The PNG is inline (a data: URL) so that no rendering of a scan is written to Gradio's cache.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np
from PIL import Image

from ..imaging import WINDOW_PRESETS, Scan, Study, Window

DISPLAY_MAX_SIDE = 1024  # the viewer shows at most this many pixels a side (the model gets all of them)

_EMPTY_VIEWER = '<div class="medvqa-viewer medvqa-empty"><p>No scan loaded.</p></div>'

_PRESET_LABELS = [("File default", "file"), ("Automatic (0.5–99.5 %)", "auto")] + [
    (f"{name.replace('_', ' ').capitalize()} (C {w.center:g} / W {w.width:g})", name)
    for name, w in WINDOW_PRESETS.items()] + [("Custom (sliders)", "custom")]


def _viewer_html(scan: Scan) -> str:
    """The scan as the model sees it (downscaled for display only), with a caption of what it is."""
    pixels = scan.pixels  # (H, W, 3) uint8
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if max(image.size) > DISPLAY_MAX_SIDE:
        image.thumbnail((DISPLAY_MAX_SIDE, DISPLAY_MAX_SIDE), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=3)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    caption = (f"{scan.source_format.upper()} · {pixels.shape[1]}×{pixels.shape[0]} px · "
               f"{_place_caption(scan)} · {scan.describe_window()}")
    return (f'<div class="medvqa-viewer"><img id="medvqa-scan" alt="The scan as the model sees it" '
            f'src="data:image/png;base64,{encoded}"/><div class="medvqa-caption">{html.escape(caption)}</div></div>')


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
    series = study.series[number - 1]
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


def _slider_ranges(default: Window, current: Window) -> tuple[tuple[float, float], float]:
    """Centre range covering the CT presets and a generous span around the file's window."""
    low = min(-1100.0, default.center - 2 * default.width, current.center)
    high = max(3000.0, default.center + 2 * default.width, current.center)
    return (float(np.floor(low)), float(np.ceil(high))), float(np.ceil(max(4000.0, 4 * default.width, current.width)))
