"""PNG, JPEG and TIFF through Pillow: every TIFF page a frame, the EXIF orientation honoured.

Only the pixels are kept; TIFF tags, PNG text chunks and JPEG comments (which can carry names)
stay behind. 8-bit grey is shown as stored, deeper grey through a window, colour as stored.
"""

from __future__ import annotations

import io
import logging

import numpy as np
from PIL import Image, ImageOps

from .guard import ScanError, _guarded
from .scan import ScanLimits, ScanSource, _too_large_message
from .windowing import _AS_STORED, _Frame, _LastFrame, _value_range

log = logging.getLogger(__name__)


_PILLOW_FORMAT = {"png": "PNG", "jpeg": "JPEG", "tiff": "TIFF"}
_HIGH_DEPTH_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _open_picture(raw: bytes, kind: str, limits: ScanLimits) -> ScanSource:
    damaged = f"This {_PILLOW_FORMAT[kind]} image is damaged or incomplete and could not be decoded."
    # Image.open reads only the header; its decompression-bomb check runs here and, with the
    # warning turned into an error by _quiet_libraries, refuses anything over Pillow's limit.
    image = _guarded(damaged, Image.open, io.BytesIO(raw), formats=[_PILLOW_FORMAT[kind]])
    # Only TIFF pages count as frames: a JPEG's second "frame" is an MPO preview, a PNG's an animation.
    count = _guarded(damaged, lambda: getattr(image, "n_frames", 1)) if kind == "tiff" else 1
    if count > limits.max_frames:
        raise ScanError(_too_large_message(*image.size[::-1], count, limits))
    total_pixels, first_mode, shape, shown = 0, image.mode, None, count // 2  # ScanSource shows the middle frame
    lows, highs = [], []  # each grey page's lowest and highest value: the sliders span every page
    shown_grey = False
    for index in range(count):
        _guarded(damaged, image.seek, index)
        columns, rows = image.size
        if rows == 0 or columns == 0:
            raise ScanError(damaged)
        total_pixels += rows * columns
        bytes_per_pixel = max(len(image.getbands()), 1) * (4 if image.mode in ("I", "F") else 2)
        if (rows * columns > limits.max_frame_pixels or total_pixels > limits.max_pixels
                or total_pixels * bytes_per_pixel > limits.max_decoded_bytes):
            raise ScanError(_too_large_message(rows, columns, count, limits))
        # Each frame is decoded once now, so that a damaged one is refused at once, and dropped but
        # the one shown first: the source keeps the file's bytes and decodes a frame again when needed.
        frame = _guarded(damaged, _picture_frame, image, kind)
        shape = shape or frame.values.shape
        if (page_range := _value_range(frame)) is not None:
            lows.append(page_range[0])
            highs.append(page_range[1])
        if index == shown:
            first_shown, shown_grey = frame, page_range is not None
        del frame
    log.debug("decoded %s with %d frame(s)", kind, count)
    frames = _PictureFrames(raw, kind, damaged, decoded=(shown, first_shown))
    rows, columns = shape[:2]
    safe_meta = {"Format": _PILLOW_FORMAT[kind], "Rows": str(rows), "Columns": str(columns),
                 "PixelFormat": first_mode}  # Pillow's mode, e.g. "L", "I;16", "RGB"
    return ScanSource(source_format=kind, frame_count=count, safe_meta=safe_meta,
                      load_frame=frames.load, forget=frames.forget, held=frames.held,
                      value_range=(min(lows), max(highs)) if shown_grey else None)


class _PictureFrames(_LastFrame):
    """A picture's frames decoded on demand from the file's bytes (kept: a PNG or JPEG is far smaller
    than its pixels)."""

    def __init__(self, raw: bytes, kind: str, damaged: str, decoded: tuple[int, _Frame] | None = None):
        self.raw, self.kind, self.damaged = raw, kind, damaged
        self._cached = decoded  # (index, frame) already decoded, kept as the last one

    def _decode(self, index: int) -> _Frame:
        image = _guarded(self.damaged, Image.open, io.BytesIO(self.raw), formats=[_PILLOW_FORMAT[self.kind]])
        _guarded(self.damaged, image.seek, index)
        return _guarded(self.damaged, _picture_frame, image, self.kind)


def _picture_frame(image: Image.Image, kind: str) -> _Frame:
    # TIFF's WhiteIsZero (PhotometricInterpretation 0, TIFF 6.0): Pillow inverts an 8-bit page itself, not
    # a 16-bit or float one, which is then shown inverted, as a DICOM's MONOCHROME1 is.
    white_is_zero = kind == "tiff" and getattr(image, "tag_v2", {}).get(262) == 0
    if kind in ("jpeg", "tiff", "png"):
        # A viewer (a browser too, for a PNG's eXIf chunk) honours the EXIF orientation of a photographed
        # film; a damaged tag is ignored.
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - untrusted EXIF; an unrotated image is still correct data
            pass
    mode = image.mode
    if mode in _HIGH_DEPTH_GRAY:
        return _Frame(values=np.asarray(image), is_color=False, invert=white_is_zero)
    if mode in ("1", "L"):
        return _Frame(values=np.asarray(image.convert("L")), is_color=False, file_window=_AS_STORED)
    if mode in ("LA", "La"):
        gray_alpha = np.asarray(image.convert("LA"), dtype=np.float64)  # (H, W, 2)
        gray = gray_alpha[..., 0] * gray_alpha[..., 1] / 255  # transparent → black, like a viewer's background
        return _Frame(values=np.rint(gray).astype(np.uint8), is_color=False, file_window=_AS_STORED)
    if mode in ("RGBA", "RGBa", "PA", "P"):
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float64)  # (H, W, 4); P may carry transparency
        rgb = rgba[..., :3] * rgba[..., 3:] / 255
        return _Frame(values=np.rint(rgb).astype(np.uint8), is_color=True)
    return _Frame(values=np.asarray(image if mode == "RGB" else image.convert("RGB")), is_color=True)
