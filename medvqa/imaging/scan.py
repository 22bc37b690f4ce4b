"""What an opened upload is, and what rendering it gives.

    ScanSource (pixels only, identifying tags dropped, held in memory)
        │ render(window, frame)      (re-windowing never re-reads the file)
        ▼
    Scan(pixels (H, W, 3) uint8, window, frame, safe_meta)

Each format's opener (dicom.py, picture.py) builds a ScanSource around a `load_frame` function;
`ScanLimits` are what those openers check before anything is decoded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .guard import ScanError, _run_public
from .windowing import (
    WINDOW_PRESETS,
    Window,
    _auto_window,
    _check_window,
    _default_window,
    _Frame,
    _to_rgb8,
    _value_range,
    is_grey,
)


# The smallest side accepted, in pixels. Nothing under it can show anatomy: the smallest real scans
# (nuclear medicine, MR spectroscopic maps) are 32 to 64 pixels a side, while the vision encoder
# pads a 3000 × 1 strip to a square of background with one line across it and blows a 4 × 4
# thumbnail up to its input (224 pixels a side or more), and the model would answer about either
# as if it were a scan. Eight keeps every real modality in, with room to spare.
MIN_SIDE = 8


@dataclass
class ScanLimits:
    """Checked against the file and its header before anything is decoded."""

    max_bytes: int = 100 * 1024 * 1024  # size of the upload itself (and of a deflated DICOM once inflated)
    max_pixels: int = 2**28  # Rows × Columns × frames, ≈ 268 M (1024 slices of 512 × 512)
    max_frame_pixels: int = 6000 * 6000  # Rows × Columns of one frame: bounds the float64 working copies
    max_decoded_bytes: int = 1024**3  # Rows × Columns × frames × samples × bytes per sample
    max_frames: int = 10_000  # frames (or TIFF pages) in one file
    # Several files at once (a folder, a .zip, a multi-file upload), checked before any is read (archive.py):
    max_files: int = 4096  # files in one upload (a thin-slice whole-body CT has about 2,000)
    max_total_bytes: int = 2 * 1024**3  # their sizes added up, once extracted
    max_zip_ratio: float = 100.0  # extracted size over compressed size, per entry and in all (zip bombs)


BURNED_IN_NOTE = ("This file says text is burned into its pixels (Burned In Annotation: YES), and such text often "
                  "names the patient. The model reads the pixels as shown, so an answer could repeat it; the "
                  "conversation's export holds no image.")


def burned_in(safe_meta: dict[str, str]) -> bool:
    """Whether a DICOM's Burned In Annotation says identifying text may be drawn into its pixels."""
    return safe_meta.get("BurnedInAnnotation", "").strip().upper() == "YES"


@dataclass
class Scan:
    pixels: np.ndarray | None  # (H, W, 3) uint8, what the model sees and the viewer shows (None: dropped
    # by the app's memory budget for decoded scans, rendered again when needed: medvqa/ui/budget.py)
    window: Window | None  # window applied (None for colour images shown as stored)
    frame_index: int
    frame_count: int
    safe_meta: dict[str, str]  # allowlisted, e.g. {"Modality": "CT", "Rows": "512", ...}
    source_format: str  # "dicom" | "png" | "jpeg" | "tiff"
    series: int | None = None  # a slice of a series (series.py): the series' number in its upload, from 1
    position_mm: float | None = None  # and the slice's position along the slice normal, where the files give it
    grey_in_colour: bool = False  # stored as colour (RGB) but grey throughout, as radiographs often are as JPEG

    def describe_window(self) -> str:
        if self.window is None:
            return ("no window (grey image stored as colour, shown as stored)" if self.grey_in_colour
                    else "no window (colour image shown as stored)")
        return self.window.describe()

    def __repr__(self) -> str:
        shape = None if self.pixels is None else self.pixels.shape
        return (f"Scan({self.source_format}, pixels={shape}, window={self.window}, "
                f"frame={self.frame_index}/{self.frame_count}, safe_meta={self.safe_meta})")


class ScanSource:
    """A decoded upload held in memory, identifying tags already dropped. Render it as often as
    needed (new window, other frame) without reading the file again."""

    def __init__(self, *, source_format: str, frame_count: int, safe_meta: dict[str, str],
                 load_frame: Callable[[int], _Frame], forget: Callable[[], None] | None = None,
                 held: Callable[[], int] | None = None, value_range: tuple[float, float] | None = None):
        """`value_range`: the lowest and highest grey value over every frame, where the opener saw them
        all (a picture's pages; given only when the default frame is grey), else those of the default frame."""
        self.source_format = source_format
        self.is_dicom = source_format == "dicom"
        self.frame_count = frame_count
        self.default_frame = frame_count // 2  # the middle slice of a stack, as viewers open it
        self.safe_meta = safe_meta
        self._load_frame = load_frame
        self._forget = forget
        self._held = held
        # Decode the default frame now, so that a damaged or degenerate upload is refused when it is opened.
        default = self._checked_frame(self.default_frame, opening=True)
        self.default_window = _default_window(default)
        # (lowest, highest) grey value, or None for a colour frame shown first.
        self.value_range = value_range if value_range is not None else _value_range(default)

    def forget_decoded(self) -> None:
        """Drop the decoded frame kept for re-windowing (a series keeps only the slice on screen)."""
        if self._forget is not None:
            self._forget()

    @property
    def decoded_bytes(self) -> int:
        """Bytes of decoded pixels this source keeps (the frame kept for re-windowing)."""
        return self._held() if self._held is not None else 0

    def render(self, window: Window | str | None = None, frame: int | None = None) -> Scan:
        """`window`: a Window, a WINDOW_PRESETS key, "file" (the file's own), "auto" (0.5-99.5
        percentile of this frame), or None for the file's own window where it has one, else the
        automatic window of the default frame (so a stack keeps one window while scrolling).
        `frame`: 0-based, None for the middle one."""
        return _run_public(self._render, window, frame)

    def value_at(self, frame: int, row: int, column: int) -> float | tuple[int, ...]:
        """The value of one pixel of frame `frame` (0-based) before any window: after the modality rescale
        (Hounsfield units for a CT), or a colour pixel's channels on the 0-255 scale it is shown on (a
        12-bit RGB's or a palette's as drawn)."""
        return _run_public(self._value_at, frame, row, column)

    def _value_at(self, frame: int, row: int, column: int) -> float | tuple[int, ...]:
        decoded = self._checked_frame(_check_frame(frame, self.frame_count))
        values = decoded.values
        rows, columns = values.shape[:2]
        if not (0 <= row < rows and 0 <= column < columns):
            raise ScanError(f"Pixel (column {column + 1}, row {row + 1}) is outside this {columns}×{rows} image.")
        value = values[row, column]
        if np.ndim(value):
            return tuple(min(255, max(0, int(round(float(v) * 255.0 / decoded.white)))) for v in value)
        return float(value)

    def _render(self, window: Window | str | None, frame: int | None) -> Scan:
        index = self.default_frame if frame is None else _check_frame(frame, self.frame_count)
        decoded = self._checked_frame(index)
        window = self._resolve_window(window, decoded)
        pixels = _to_rgb8(decoded, window)  # (H, W, 3) uint8
        return Scan(pixels=pixels, window=window, frame_index=index, frame_count=self.frame_count,
                    safe_meta=dict(self.safe_meta), source_format=self.source_format,
                    grey_in_colour=window is None and is_grey(pixels))

    def _checked_frame(self, index: int, opening: bool = False) -> _Frame:
        """Frame `index` decoded, refused if too small to show anything: every format passes here when
        it is opened, and every frame before it is shown (a TIFF's pages may differ in size)."""
        decoded = self._load_frame(index)
        rows, columns = decoded.values.shape[:2]
        if min(rows, columns) < MIN_SIDE:
            what = "This image" if opening or self.frame_count == 1 else f"Frame {index + 1} of this image"
            raise _TooSmall(f"{what} is {columns}×{rows} pixels, too small to read; the smallest accepted "
                            f"is {MIN_SIDE} pixels on each side.")
        return decoded

    def _resolve_window(self, window: Window | str | None, decoded: _Frame) -> Window | None:
        if isinstance(window, str):
            if window == "auto":
                return None if decoded.is_color else _auto_window(decoded.values, decoded.padding)
            if window == "file":
                window = None
            elif window in WINDOW_PRESETS:
                window = WINDOW_PRESETS[window]
            else:
                raise ScanError(f"Unknown window preset; choose one of: file, auto, {', '.join(WINDOW_PRESETS)}.")
        if window is None:
            return decoded.file_window or self.default_window
        _check_window(window)
        return window

    def __repr__(self) -> str:
        return (f"ScanSource({self.source_format}, frames={self.frame_count}, "
                f"default_window={self.default_window}, safe_meta={self.safe_meta})")


class _TooSmall(ScanError):
    """An image under MIN_SIDE pixels a side (a study notes such files apart from damaged ones)."""


def parse_window(text: str) -> Window | str:
    """A window typed by a user: a preset name ("lung", "soft tissue"), "file", "auto", or
    "CENTER,WIDTH" such as "40,400" (in HU for CT). Raises ScanError on anything else."""
    name = re.sub(r"[\s-]+", "_", text.strip().lower())
    if name in ("file", "auto"):
        return name
    if name in WINDOW_PRESETS:
        return WINDOW_PRESETS[name]
    parts = re.split(r"\s*[,/]\s*", text.strip())
    try:
        center, width = (float(part) for part in parts)
    except ValueError:
        center = width = None
    if center is None:
        raise ScanError(f"A window is a preset ({', '.join(WINDOW_PRESETS)}), 'file', 'auto', "
                        "or CENTER,WIDTH such as 40,400.")
    window = Window(center, width, "user")
    _check_window(window)
    return window


def in_hounsfield_units(source) -> bool:
    """Whether the CT presets mean anything for `source` (a ScanSource or a Series): a CT's values,
    after its rescale, are Hounsfield units; a picture's, or another modality's, are in no such unit."""
    return source.is_dicom and source.safe_meta.get("Modality", "").upper() == "CT"


def check_preset(source, window: Window | str | None) -> None:
    """Refuse a CT preset (a WINDOW_PRESETS name, or its Window from parse_window) for a scan whose
    values are not in Hounsfield units: it would window them arbitrarily."""
    name = window.name if isinstance(window, Window) else window
    if name not in WINDOW_PRESETS or in_hounsfield_units(source):
        return
    kind = (f"{source.safe_meta.get('Modality') or 'non-CT'} DICOM" if source.is_dicom
            else source.source_format.upper())
    raise ScanError(f"The {name.replace('_', ' ')} window is a CT window in Hounsfield units, which a "
                    f"{kind} image does not have. Choose the automatic window, or set the centre and width.")


def _check_frame(frame: int, frame_count: int) -> int:
    if isinstance(frame, bool) or not isinstance(frame, (int, np.integer)) or not 0 <= frame < frame_count:
        raise ScanError(f"Frame {frame} was requested, but this scan has {frame_count} "
                        f"frame{'s' if frame_count > 1 else ''} (numbered 0 to {frame_count - 1}).")
    return int(frame)


def _too_large_message(rows: int, columns: int, frames: int, limits: ScanLimits) -> str:
    size = f"{columns} × {rows} pixels" + (f" × {frames} frames" if frames > 1 else "")
    return (f"This image is too large to open safely ({size}; the limit is "
            f"{limits.max_frame_pixels / 1e6:.0f} million pixels a frame and "
            f"{limits.max_pixels / 1e6:.0f} million in all).")
