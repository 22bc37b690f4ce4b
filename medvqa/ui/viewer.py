"""The scan viewer: the image as an inline PNG, and the window controls' choices and ranges.

The PNG is inline (a data: URL) so that no rendering of a scan is written to Gradio's cache.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np
from PIL import Image

from ..imaging import WINDOW_PRESETS, Scan, Window

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
               f"frame {scan.frame_index + 1} of {scan.frame_count} · {scan.describe_window()}")
    return (f'<div class="medvqa-viewer"><img id="medvqa-scan" alt="The scan as the model sees it" '
            f'src="data:image/png;base64,{encoded}"/><div class="medvqa-caption">{html.escape(caption)}</div></div>')


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
