"""DICOM pixel data decoded one frame at a time, on demand, through crash-safe plugins only.

Each frame becomes the `_Frame` that windowing takes: modality LUT applied to grey data, palette
and YBR colour converted to RGB, the file's own window attached. Only the copied pixel dataset
(dicom._copy_pixel_dataset) is ever decoded, never the upload with its identifying tags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydicom.dataset import Dataset
from pydicom.encaps import get_frame
from pydicom.pixels import apply_color_lut, apply_modality_lut, convert_color_space, get_decoder
from pydicom.uid import UID

from .codestream import _J2K_SYNTAXES, _JPEG_SYNTAXES, _j2k_frame_size, _jpeg_frame_size
from .guard import _INTERRUPTS, ScanError, _guarded
from .windowing import _AS_STORED, _file_window, _first_number, _Frame, _LastFrame

log = logging.getLogger(__name__)


_DAMAGED_PIXELS = "The image data in this DICOM file is damaged or incomplete and could not be decoded."

_MONOCHROME = ("MONOCHROME1", "MONOCHROME2")

# pydicom's decoding plugins, in the order tried. GDCM is left out on purpose: on a corrupt JPEG
# or JPEG-LS frame it throws a C++ exception that its Python binding does not translate, and the
# whole process aborts (found by scripts/fuzz_imaging.py). pylibjpeg decodes every syntax GDCM
# would, and Pillow backs it up for JPEG and JPEG 2000.
_DECODING_PLUGINS = ("pylibjpeg", "pydicom", "pillow")


@dataclass(frozen=True)
class _PixelHeader:
    rows: int
    columns: int
    frames: int
    samples: int
    bits_allocated: int
    bits_stored: int
    pixel_representation: int
    photometric: str
    transfer_syntax: UID


class _DicomFrames(_LastFrame):
    """Decodes one frame at a time on demand, keeping the last one for re-windowing."""

    def __init__(self, pixel_ds: Dataset, header: _PixelHeader, per_frame: list[dict[str, Any]] | None):
        self.pixel_ds = pixel_ds
        self.header = header
        self.per_frame = per_frame

    def _decode(self, index: int) -> _Frame:
        ds = self._frame_dataset(index)
        header = self.header
        if header.transfer_syntax.is_encapsulated:
            self._check_codestream(index)
        arr, info = _decode_with_safe_plugins(ds, index, header.transfer_syntax)
        photometric = str(info.get("photometric_interpretation", header.photometric))
        log.debug("decoded DICOM frame %d of %d, shape %s", index, header.frames, arr.shape)
        expected = (header.rows, header.columns) + ((3,) if header.samples == 3 else ())
        if arr.shape != expected:
            raise ScanError(_DAMAGED_PIXELS)

        if photometric in _MONOCHROME:
            values = _guarded(_DAMAGED_PIXELS, apply_modality_lut, arr, ds)
            file_window, voi_lut = _guarded(_DAMAGED_PIXELS, _file_window, ds)
            if file_window is None and _is_plain_8_bit(ds, header):
                file_window = _AS_STORED
            return _Frame(values=values, is_color=False, invert=_shown_inverted(photometric, ds),
                          file_window=file_window, voi_lut=voi_lut, padding=_padding(arr, ds))
        if photometric == "PALETTE COLOR":
            rgb = _guarded(_DAMAGED_PIXELS, apply_color_lut, arr, ds)
            return _Frame(values=rgb, is_color=True, white=float(np.iinfo(rgb.dtype).max))
        if photometric in ("YBR_FULL", "YBR_FULL_422"):
            rgb = _guarded("This DICOM file's colour encoding is not supported.",
                           convert_color_space, arr, photometric, "RGB")
            return _Frame(values=rgb, is_color=True, white=255.0)
        if photometric in ("RGB", "YBR_RCT", "YBR_ICT"):  # J2K decoders return RCT/ICT as RGB
            return _Frame(values=arr, is_color=True, white=float(2**header.bits_stored - 1))
        raise ScanError("This DICOM file's colour encoding is not supported.")

    def _frame_dataset(self, index: int) -> Dataset:
        if not self.per_frame or not self.per_frame[index]:
            return self.pixel_ds
        ds = Dataset()
        ds.file_meta = self.pixel_ds.file_meta
        ds.set_original_encoding(*self.pixel_ds.original_encoding)
        for element in self.pixel_ds:
            ds[element.tag] = element
        for element in self.per_frame[index].values():
            ds[element.tag] = element  # replaces the element in this dataset only
        return ds

    def _check_codestream(self, index: int) -> None:
        """Compressed frames carry their own size; check it against the header before a decoder
        allocates for it, so a doctored codestream cannot claim gigapixels."""
        data = self.pixel_ds.get("PixelData")
        if data is None:
            return
        offsets = None
        if "ExtendedOffsetTable" in self.pixel_ds and "ExtendedOffsetTableLengths" in self.pixel_ds:
            offsets = (self.pixel_ds.ExtendedOffsetTable, self.pixel_ds.ExtendedOffsetTableLengths)
        frame = _guarded(_DAMAGED_PIXELS, get_frame, data, index, extended_offsets=offsets,
                         number_of_frames=self.header.frames)
        syntax = self.header.transfer_syntax
        size = (_jpeg_frame_size(frame) if syntax in _JPEG_SYNTAXES
                else _j2k_frame_size(frame) if syntax in _J2K_SYNTAXES else None)
        if size is None:  # unparsed here; the decoder will judge it
            return
        rows, columns, components, tiles = size
        # A frame of another size could not fill the header's Rows × Columns anyway. A height of
        # 0 (to be given later by a DNL marker) makes libjpeg wait for it forever, and more than
        # 65535 JPEG 2000 tiles is outside the standard, tiny tiles a decoder loops over for long.
        if ((rows, columns) != (self.header.rows, self.header.columns) or not 1 <= components <= 4
                or tiles > 65535):
            raise ScanError(_DAMAGED_PIXELS)


def _decode_with_safe_plugins(ds: Dataset, index: int, transfer_syntax: UID) -> tuple[np.ndarray, dict]:
    """Decode one frame, trying the crash-safe plugins in turn (native data needs none)."""
    decoder = get_decoder(transfer_syntax)
    plugins = _safe_plugins(transfer_syntax) or [""]
    for plugin in plugins:
        try:
            # as_rgb=False: colour conversion is done by the caller, from what the decoder reports.
            return decoder.as_array(ds, index=index, as_rgb=False, decoding_plugin=plugin)
        except _INTERRUPTS:
            raise
        except BaseException as error:  # noqa: BLE001 - includes Rust decoders' PanicException
            log.debug("decoding plugin %r raised %s", plugin, type(error).__name__)
    raise ScanError(_DAMAGED_PIXELS)


def _safe_plugins(transfer_syntax: UID) -> list[str]:
    available = get_decoder(transfer_syntax).available_plugins
    return [plugin for plugin in _DECODING_PLUGINS if plugin in available]


def _is_plain_8_bit(ds: Dataset, header: _PixelHeader) -> bool:
    """8-bit unsigned data with no modality transform is meant to be shown as stored."""
    slope, intercept = _first_number(ds.get("RescaleSlope")), _first_number(ds.get("RescaleIntercept"))
    identity = slope in (None, 1.0) and intercept in (None, 0.0) and not ds.get("ModalityLUTSequence")
    return header.bits_stored == 8 and header.pixel_representation == 0 and identity


def _shown_inverted(photometric: str, ds: Dataset) -> bool:
    """Whether low values are shown bright: MONOCHROME1, or MONOCHROME2 with a Presentation LUT Shape of
    INVERSE (PS3.3 C.11.6.1.2: what a CR or secondary capture may carry). MONOCHROME1 with INVERSE, the
    pairing PS3.3 C.8.11.1.1.1 asks of a DX, is one inversion, not two."""
    shape = str(ds.get("PresentationLUTShape", "") or "").strip().upper()
    return photometric == "MONOCHROME1" or (photometric == "MONOCHROME2" and shape == "INVERSE")


def _padding(stored: np.ndarray, ds: Dataset) -> np.ndarray | None:
    """Where the stored values are the file's Pixel Padding Value, or within the range it and Pixel Padding
    Range Limit bound (PS3.3 C.7.5.1.1.2): True there. None when no pixel is padding, or every one is."""
    value, limit = ds.get("PixelPaddingValue"), ds.get("PixelPaddingRangeLimit")
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        return None
    if np.issubdtype(stored.dtype, np.signedinteger):  # written as unsigned (US) for signed pixels: two's complement
        top = np.iinfo(stored.dtype).max
        value = value - (top + 1) * 2 if value > top else value
        limit = limit - (top + 1) * 2 if isinstance(limit, (int, np.integer)) and limit > top else limit
    if isinstance(limit, (int, np.integer)) and not isinstance(limit, bool):
        low, high = min(value, limit), max(value, limit)
        mask = (stored >= low) & (stored <= high)
    else:
        mask = stored == value
    return mask if mask.any() and not mask.all() else None
