"""Windowing: a decoded frame's values → 0..255 grey (or colour) → (H, W, 3) uint8 RGB.

A grey frame is shown through a window: the file's own (Window Center / Width, or its VOI LUT
Sequence), a preset, the user's, or an automatic 0.5-99.5 percentile one. pydicom's VOI functions
apply it, in the order a viewer does: VOI LUT or window → MONOCHROME1 inversion → 8 bit → RGB.
`_Frame` is what every format's decoder hands over: one frame after the modality LUT (rescale
slope/intercept or Modality LUT Sequence), before any window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydicom.dataset import Dataset
from pydicom.multival import MultiValue
from pydicom.pixels import apply_voi, apply_windowing
from pydicom.valuerep import DSfloat

from .guard import ScanError


@dataclass(frozen=True)
class Window:
    center: float  # in modality units (HU for CT), or stored values where there is no modality LUT
    width: float
    name: str  # preset key, "file", "file-lut", "user", "auto-percentile" or "none" (8-bit as stored)
    function: str = "LINEAR"  # VOI LUT function, PS3.3 C.11.2.1.2: LINEAR, LINEAR_EXACT or SIGMOID

    def describe(self) -> str:
        # A centre that is float noise beside the width (2.3e-12 for a window about 0) is said as 0.
        center = 0.0 if abs(self.center) < 1e-9 * abs(self.width) else self.center
        center_width = f"C {_format_number(center)} / W {_format_number(self.width)}"
        if self.name == "none":
            return "no window (8-bit image shown as stored)"
        if self.name == "file":
            return f"the file's own window ({center_width})"
        if self.name == "file-lut":
            return f"the file's own VOI lookup table (input range {center_width})"
        if self.name == "auto-percentile":
            return f"automatic window over the 0.5-99.5 percentile range ({center_width})"
        if self.name == "user":
            return f"user window ({center_width})"
        return f"{self.name.replace('_', ' ')} window ({center_width})"


# Common CT windows in HU (Radiopaedia, "Windowing (CT)"). They assume modality values in HU, so
# on MR or X-ray they are applied as asked but mean little.
WINDOW_PRESETS: dict[str, Window] = {
    "lung": Window(-600, 1500, "lung"),
    "mediastinum": Window(50, 350, "mediastinum"),
    "bone": Window(400, 1800, "bone"),
    "brain": Window(40, 80, "brain"),
    "abdomen": Window(50, 400, "abdomen"),
    "soft_tissue": Window(40, 350, "soft_tissue"),
}

# An 8-bit grayscale image shown as stored: LINEAR_EXACT with these values is the identity on 0..255.
_AS_STORED = Window(127.5, 255, "none", "LINEAR_EXACT")


@dataclass
class _Frame:
    """One decoded frame, after the modality LUT and before any window."""

    values: np.ndarray  # (H, W) modality values, or (H, W, 3) RGB
    is_color: bool
    invert: bool = False  # MONOCHROME1: low values are bright
    white: float = 255.0  # colour only: the stored value shown as full intensity
    file_window: Window | None = None  # the file's own VOI for this frame, if any
    voi_lut: Dataset | None = None  # holds the VOI LUT Sequence when file_window is "file-lut"
    # (H, W) bool: the pixels a DICOM's Pixel Padding Value marks as no image (outside a CT's field of
    # view, PS3.3 C.7.5.1.1.2), left out of the automatic window; None where there are none.
    padding: np.ndarray | None = None
    # Integer data spanning under 65536 levels (nearly all images) is also kept as level indexes,
    # so that a window is computed once per level rather than once per pixel (see _to_rgb8). 8-bit
    # values are their own indexes (no copy: a uint16 one would hold twice the pixels' bytes).
    levels: np.ndarray | None = field(init=False, default=None)  # values - lowest, uint16; or values, uint8
    lowest: int = field(init=False, default=0)
    level_count: int = field(init=False, default=0)

    def __post_init__(self):
        values = self.values
        if values.size == 0 or not np.issubdtype(values.dtype, np.number):
            return
        if values.dtype == np.uint8:
            self.levels, self.lowest, self.level_count = values, 0, 256
            return
        if not np.issubdtype(values.dtype, np.integer) and not (values == np.rint(values)).all():
            return  # fractional (or NaN) values: windowed pixel by pixel
        lowest, highest = int(values.min()), int(values.max())
        if highest - lowest < 2**16:
            self.levels = (values - lowest).astype(np.uint16)
            self.lowest, self.level_count = lowest, highest - lowest + 1


class _LastFrame:
    """Frames decoded on demand by `_decode(index)`, the last one kept for re-windowing until
    `forget` (the app's memory budget calls it, medvqa/ui/budget.py)."""

    _cached: tuple[int, _Frame] | None = None

    def _decode(self, index: int) -> _Frame:
        raise NotImplementedError

    def load(self, index: int) -> _Frame:
        cached = self._cached
        if cached is not None and cached[0] == index:
            return cached[1]
        decoded = self._decode(index)
        self._cached = (index, decoded)
        return decoded

    def forget(self) -> None:
        self._cached = None

    def held(self) -> int:
        """Bytes of decoded pixels kept."""
        cached = self._cached
        if cached is None:
            return 0
        frame = cached[1]
        return (frame.values.nbytes + (frame.levels.nbytes if frame.levels is not None and frame.levels is not frame.values
                                       else 0) + (frame.padding.nbytes if frame.padding is not None else 0))


def _default_window(decoded: _Frame) -> Window | None:
    """The window used when none is asked for: the file's own, else a robust automatic one."""
    if decoded.is_color:
        return None
    if decoded.file_window is not None:
        return decoded.file_window
    return _auto_window(decoded.values, decoded.padding)


# Mean absolute difference between neighbouring RGB channels (of 255) above which an image has colour.
# On the held-out training images' closed questions: every SLAKE and VQA-RAD image at 0, the images of
# 1,384 of PathVQA's 1,395 above 4 (calibrate_closed.py's groups_by_data); a grey radiograph saved as an
# RGB JPEG differs by a level or two where its chroma was compressed.
COLOUR_DIFFERENCE = 4.0


def is_grey(pixels: np.ndarray) -> bool:
    """Whether an image has no colour: one channel, or RGB channels alike (|R-G| + |G-B| on average at most
    COLOUR_DIFFERENCE). What the calibration's image groups (confidence.image_group) and a scan's caption
    judge by."""
    pixels = np.asarray(pixels)
    if pixels.ndim < 3 or pixels.shape[-1] < 3:
        return True
    rgb = pixels[..., :3].astype(np.int16)
    difference = np.abs(rgb[..., 0] - rgb[..., 1]).mean() + np.abs(rgb[..., 1] - rgb[..., 2]).mean()
    return bool(difference <= COLOUR_DIFFERENCE)


def _value_range(decoded: _Frame) -> tuple[float, float] | None:
    """A grey frame's lowest and highest finite value (None for colour, or where none is finite)."""
    if decoded.is_color:
        return None
    values = decoded.values
    if not np.issubdtype(values.dtype, np.integer):
        values = values[np.isfinite(values)]
        if values.size == 0:
            return None
    return float(values.min()), float(values.max())


def _auto_window(values: np.ndarray, padding: np.ndarray | None = None) -> Window:
    """A window over the 0.5-99.5 percentile range: robust to a few hot or dead pixels. Padding pixels
    (`padding`, True where the file says there is no image) are not counted."""
    # A window needs only the shape of the histogram: a strided sample of at most ~1 M values
    # gives the same percentiles to within a grey level, in a fraction of the time.
    step = max(1, values.size // 2**20)
    sample = values.ravel()[::step]
    if padding is not None:
        sample = sample[~padding.ravel()[::step]]
    finite = sample[np.isfinite(sample)]
    low, high = (np.percentile(finite, [0.5, 99.5]) if finite.size else (0.0, 1.0))
    width = float(high - low) if high > low else 1.0
    # LINEAR_EXACT maps [low, high] exactly onto 0..255, for float data narrower than 1 unit too.
    return Window(float(low + high) / 2 if high > low else float(low), width, "auto-percentile", "LINEAR_EXACT")


def _to_rgb8(decoded: _Frame, window: Window | None) -> np.ndarray:
    if decoded.is_color and window is None:  # colour shown as stored, scaled from its bit depth
        if decoded.values.dtype == np.uint8 and decoded.white == 255:
            return decoded.values.copy()  # a copy: the frame stays cached for the next render
        return _round_to_uint8(decoded.values.astype(np.float32) * np.float32(255.0 / decoded.white))
    # A window on a colour image applies to each channel, as viewers do.
    if decoded.levels is not None:
        # Window every level once and look each pixel up: the same result as windowing the
        # pixels, in milliseconds rather than seconds on a large radiograph.
        domain = np.arange(decoded.lowest, decoded.lowest + decoded.level_count)
        shown = _window_to_uint8(domain, window, decoded)[decoded.levels]
    else:
        shown = _window_to_uint8(decoded.values, window, decoded)
    return shown if decoded.is_color else np.repeat(shown[..., None], 3, axis=2)  # (H, W, 3)


def _window_to_uint8(values: np.ndarray, window: Window, decoded: _Frame) -> np.ndarray:
    gray = _apply_window(values, window, decoded.voi_lut)
    if decoded.invert:  # MONOCHROME1: inverted after the VOI, as PS3.3 C.7.6.3.1.2 orders it
        gray = 255.0 - gray
    return _round_to_uint8(gray)


def _apply_window(values: np.ndarray, window: Window, voi_lut: Dataset | None) -> np.ndarray:
    """Map values to 0..255 (float) through the window, with pydicom's VOI functions."""
    if window.name == "file-lut" and voi_lut is not None:
        if not np.issubdtype(values.dtype, np.integer):  # the LUT indexes integer values
            values = np.rint(values).astype(np.int64)
        out = apply_voi(values, voi_lut)
        return out.astype(np.float64) * (255.0 / _voi_lut_peak(voi_lut))
    voi = Dataset()
    voi.PhotometricInterpretation = "MONOCHROME2"
    # apply_windowing maps onto the output range of the declared stored bits; declaring 8 unsigned
    # bits and no rescale makes that range exactly 0..255.
    voi.BitsStored = 8
    voi.PixelRepresentation = 0
    voi.WindowCenter = DSfloat(window.center, auto_format=True)
    voi.WindowWidth = DSfloat(window.width, auto_format=True)
    voi.VOILUTFunction = window.function
    return apply_windowing(values, voi)


def _voi_lut_peak(voi_lut: Dataset) -> float:
    """Full scale of a VOI LUT's output. Some writers declare 16 bits but fill only 12; scale by
    the bits the table actually uses, so the image is not drawn near-black."""
    entries, first_mapped, declared_bits = voi_lut.VOILUTSequence[0].LUTDescriptor
    table = apply_voi(np.arange(first_mapped, first_mapped + (entries or 2**16)), voi_lut)
    used_bits = max(8, int(table.max()).bit_length())
    return float(2 ** min(used_bits, max(declared_bits, 8)) - 1)


def _round_to_uint8(values: np.ndarray) -> np.ndarray:
    """Round onto 0..255. NaN (from float pixel data) becomes black. Works in place on `values`,
    which is always a fresh array here."""
    np.clip(values, 0, 255, out=values)
    values[np.isnan(values)] = 0
    return np.rint(values, out=values).astype(np.uint8)


def _check_window(window: Window) -> None:
    if not isinstance(window, Window):
        raise ScanError("The window must be a Window, a preset name or None.")
    numbers = (window.center, window.width)
    if not all(isinstance(n, (int, float, np.number)) and math.isfinite(n) for n in numbers):
        raise ScanError("The window centre and width must be numbers.")
    minimum = 1 if window.function == "LINEAR" else 0
    if window.width < minimum or window.width <= 0:
        raise ScanError("The window width must be at least 1.")
    if window.function not in ("LINEAR", "LINEAR_EXACT", "SIGMOID"):
        raise ScanError("The window function must be LINEAR, LINEAR_EXACT or SIGMOID.")


def _format_number(value: float) -> str:
    value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"


def _file_window(ds: Dataset) -> tuple[Window | None, Dataset | None]:
    """The file's own VOI: the VOI LUT Sequence if present (pydicom's preference), else the first
    Window Center / Width pair."""
    items = ds.get("VOILUTSequence")
    if items and "LUTDescriptor" in items[0] and "LUTData" in items[0]:
        entries, first_mapped, _ = items[0].LUTDescriptor
        entries = entries or 2**16
        return Window(first_mapped + entries / 2, entries, "file-lut"), ds
    center, width = _first_number(ds.get("WindowCenter")), _first_number(ds.get("WindowWidth"))
    if center is None or width is None or width <= 0:
        return None, None
    function = str(ds.get("VOILUTFunction") or "LINEAR").strip().upper()
    if function not in ("LINEAR", "LINEAR_EXACT", "SIGMOID"):
        function = "LINEAR"
    if function == "LINEAR" and width < 1:  # LINEAR needs W ≥ 1; an exact window keeps the intent
        function = "LINEAR_EXACT"
    return Window(center, width, "file", function), None


def _first_number(value: Any) -> float | None:
    if isinstance(value, (list, tuple, MultiValue)):
        value = value[0] if len(value) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
