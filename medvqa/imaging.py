"""Uploads → the RGB image the vision encoder sees, rendered the way a DICOM viewer would.

    open_scan(bytes | path) ─▶ ScanSource (pixels only, identifying tags dropped, held in memory)
                                   │ render(window, frame)      (re-windowing never re-reads the file)
                                   ▼
                                  Scan(pixels (H, W, 3) uint8, window, frame, safe_meta)

DICOM goes through pydicom 3 (no `force`: a file that is not Part 10 DICOM is refused) and its own
LUT functions, in the order a viewer applies them: modality LUT (rescale slope/intercept or
Modality LUT Sequence) → VOI LUT or window centre/width (the file's, a preset or the user's) →
MONOCHROME1 inversion → 8 bit → RGB. PNG, JPEG and TIFF go through Pillow.

Patient data never leaves this module: the scan keeps only an allowlist of coded and numeric
attributes (see `_SAFE_CODED` and `_SAFE_NUMERIC`), library loggers and warnings are silenced
while an upload is parsed (their messages can quote tag values), and every failure becomes a
`ScanError` whose message is written here, never a library message or traceback. Nothing of the
upload is written to disk.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import logging
import math
import os
import re
import sys
import threading
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
# The plugins are imported here, not on first use, so that their loggers exist before the first
# upload and get silenced with the rest (Pillow's TIFF plugin logs tag values at debug level).
from PIL import Image, ImageFile, ImageOps, JpegImagePlugin, PngImagePlugin, TiffImagePlugin  # noqa: F401
from pydicom import dcmread
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import get_frame
from pydicom.filereader import _read_file_meta_info, read_preamble
from pydicom.multival import MultiValue
from pydicom.pixels import (
    apply_color_lut,
    apply_modality_lut,
    apply_voi,
    apply_windowing,
    convert_color_space,
    get_decoder,
)
from pydicom.uid import UID, DeflatedExplicitVRLittleEndian
from pydicom.valuerep import DSfloat

log = logging.getLogger(__name__)


# ── Public types ─────────────────────────────────────────────────────────────────────────────

class ScanError(Exception):
    """Any upload that cannot be shown. The message is for a clinician and never quotes the file."""


@dataclass(frozen=True)
class Window:
    center: float  # in modality units (HU for CT), or stored values where there is no modality LUT
    width: float
    name: str  # preset key, "file", "file-lut", "user", "auto-percentile" or "none" (8-bit as stored)
    function: str = "LINEAR"  # VOI LUT function, PS3.3 C.11.2.1.2: LINEAR, LINEAR_EXACT or SIGMOID

    def describe(self) -> str:
        center_width = f"C {_format_number(self.center)} / W {_format_number(self.width)}"
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
class ScanLimits:
    """Checked against the file and its header before anything is decoded."""

    max_bytes: int = 100 * 1024 * 1024  # size of the upload itself (and of a deflated DICOM once inflated)
    max_pixels: int = 2**28  # Rows × Columns × frames, ≈ 268 M (1024 slices of 512 × 512)
    max_frame_pixels: int = 6000 * 6000  # Rows × Columns of one frame: bounds the float64 working copies
    max_decoded_bytes: int = 1024**3  # Rows × Columns × frames × samples × bytes per sample
    max_frames: int = 10_000  # frames (or TIFF pages) in one file


@dataclass
class Scan:
    pixels: np.ndarray  # (H, W, 3) uint8, what the model sees and the viewer shows
    window: Window | None  # window applied (None for colour images shown as stored)
    frame_index: int
    frame_count: int
    safe_meta: dict[str, str]  # allowlisted, e.g. {"Modality": "CT", "Rows": "512", ...}
    source_format: str  # "dicom" | "png" | "jpeg" | "tiff"

    def describe_window(self) -> str:
        if self.window is None:
            return "no window (colour image shown as stored)"
        return self.window.describe()

    def __repr__(self) -> str:
        return (f"Scan({self.source_format}, pixels={self.pixels.shape}, window={self.window}, "
                f"frame={self.frame_index}/{self.frame_count}, safe_meta={self.safe_meta})")


@dataclass
class _Frame:
    """One decoded frame, after the modality LUT and before any window."""

    values: np.ndarray  # (H, W) modality values, or (H, W, 3) RGB
    is_color: bool
    invert: bool = False  # MONOCHROME1: low values are bright
    white: float = 255.0  # colour only: the stored value shown as full intensity
    file_window: Window | None = None  # the file's own VOI for this frame, if any
    voi_lut: Dataset | None = None  # holds the VOI LUT Sequence when file_window is "file-lut"
    # Integer data spanning under 65536 levels (nearly all images) is also kept as level indexes,
    # so that a window is computed once per level rather than once per pixel (see _to_rgb8).
    levels: np.ndarray | None = field(init=False, default=None)  # values - lowest, uint16
    lowest: int = field(init=False, default=0)
    level_count: int = field(init=False, default=0)

    def __post_init__(self):
        values = self.values
        if values.size == 0 or not np.issubdtype(values.dtype, np.number):
            return
        if not np.issubdtype(values.dtype, np.integer) and not (values == np.rint(values)).all():
            return  # fractional (or NaN) values: windowed pixel by pixel
        lowest, highest = int(values.min()), int(values.max())
        if highest - lowest < 2**16:
            self.levels = (values - lowest).astype(np.uint16)
            self.lowest, self.level_count = lowest, highest - lowest + 1


class ScanSource:
    """A decoded upload held in memory, identifying tags already dropped. Render it as often as
    needed (new window, other frame) without reading the file again."""

    def __init__(self, *, source_format: str, frame_count: int, safe_meta: dict[str, str],
                 load_frame: Callable[[int], _Frame]):
        self.source_format = source_format
        self.is_dicom = source_format == "dicom"
        self.frame_count = frame_count
        self.default_frame = frame_count // 2  # the middle slice of a stack, as viewers open it
        self.safe_meta = safe_meta
        self._load_frame = load_frame
        # Decode the default frame now, so that a damaged upload is refused when it is opened.
        self.default_window = _default_window(self._load_frame(self.default_frame))

    def render(self, window: Window | str | None = None, frame: int | None = None) -> Scan:
        """`window`: a Window, a WINDOW_PRESETS key, "file" (the file's own), "auto" (0.5-99.5
        percentile of this frame), or None for the file's own window where it has one, else the
        automatic window of the default frame (so a stack keeps one window while scrolling).
        `frame`: 0-based, None for the middle one."""
        return _run_public(self._render, window, frame)

    def _render(self, window: Window | str | None, frame: int | None) -> Scan:
        index = self.default_frame if frame is None else _check_frame(frame, self.frame_count)
        decoded = self._load_frame(index)
        window = self._resolve_window(window, decoded)
        pixels = _to_rgb8(decoded, window)  # (H, W, 3) uint8
        return Scan(pixels=pixels, window=window, frame_index=index, frame_count=self.frame_count,
                    safe_meta=dict(self.safe_meta), source_format=self.source_format)

    def _resolve_window(self, window: Window | str | None, decoded: _Frame) -> Window | None:
        if isinstance(window, str):
            if window == "auto":
                return None if decoded.is_color else _auto_window(decoded.values)
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


def open_scan(data: bytes | str | os.PathLike, limits: ScanLimits | None = None) -> ScanSource:
    """Read an upload (raw bytes, or a path read into memory) and decode its default frame.
    The format is chosen by content, not by file name. Raises ScanError for anything unusable."""
    return _run_public(_open_scan, data, limits or ScanLimits())


def load_scan(data: bytes | str | os.PathLike, window: Window | str | None = None,
              frame: int | None = None, limits: ScanLimits | None = None) -> Scan:
    return open_scan(data, limits).render(window=window, frame=frame)


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


def cli_scan(path: str) -> int:
    """`python -m medvqa scan FILE`: print what the model would be told about the scan."""
    try:
        source = open_scan(path)
        scan = source.render()
    except ScanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"format: {scan.source_format}")
    for key, value in scan.safe_meta.items():
        print(f"{key}: {value}")
    print(f"window: {scan.describe_window()}")
    print(f"frames: {scan.frame_count} (showing frame {scan.frame_index})")
    return 0


# ── Upload → format ──────────────────────────────────────────────────────────────────────────

_SUPPORTED = "Please upload a DICOM, PNG, JPEG or TIFF image."

# Formats recognised only to say clearly what the file is: (signature at offset 0, description).
_UNSUPPORTED_SIGNATURES = [
    (b"\xff\x0a", "compressed as JPEG-XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "compressed as JPEG-XL"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "a JPEG 2000 image"),
    (b"\xff\x4f\xff\x51", "a JPEG 2000 image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"BM", "a BMP image"),
    (b"PK\x03\x04", "a ZIP archive"),
    (b"PK\x05\x06", "an empty ZIP archive"),
    (b"\x1f\x8b", "gzip-compressed"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!", "a RAR archive"),
    (b"%PDF", "a PDF document"),
    (b"NRRD", "an NRRD volume"),
    (b"8BPS", "a Photoshop document"),
]


def _open_scan(data: bytes | str | os.PathLike, limits: ScanLimits) -> ScanSource:
    raw = _read_upload(data, limits)
    kind = _sniff_format(raw)
    log.debug("opening a %s upload of %d bytes", kind, len(raw))
    if kind == "dicom":
        return _open_dicom(raw, limits)
    return _open_picture(raw, kind, limits)


def _read_upload(data: bytes | str | os.PathLike, limits: ScanLimits) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    elif isinstance(data, (str, os.PathLike)):
        raw = _guarded("The file could not be opened.", _read_path, data, limits.max_bytes)
    else:
        raise ScanError("The upload is not a file.")
    if not raw:
        raise ScanError("The file is empty.")
    if len(raw) > limits.max_bytes:
        raise ScanError(f"The file is larger than the {limits.max_bytes / 2**20:.0f} MB upload limit.")
    return raw


def _read_path(path: str | os.PathLike, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(max_bytes + 1)  # one byte over is enough to refuse it


def _sniff_format(raw: bytes) -> str:
    # Checked first: a DICOM preamble may itself hold a TIFF header (dual-format files).
    if raw[128:132] == b"DICM":
        return "dicom"
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if raw.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if raw[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "tiff"
    raise ScanError(_not_an_image_message(raw))


def _not_an_image_message(raw: bytes) -> str:
    what = next((name for signature, name in _UNSUPPORTED_SIGNATURES if raw.startswith(signature)), None)
    if what is None and raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        what = "a WebP image"
    if what is None and raw[4:8] == b"ftyp":
        brand = raw[8:12]
        what = ("a HEIC image" if brand in (b"heic", b"heix", b"hevc", b"mif1", b"msf1")
                else "an AVIF image" if brand in (b"avif", b"avis") else "a video")
    if what is None and len(raw) >= 348 and raw[344:348] in (b"n+1\x00", b"ni1\x00"):
        what = "a NIfTI volume"
    if what is None and _looks_like_headerless_dicom(raw):
        return ("This looks like DICOM data without the standard file header (the 128-byte preamble "
                "and 'DICM' marker). Please export it from the PACS or viewer as a DICOM file.")
    if what is None:
        text = raw[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
        if text.startswith((b"<!doctype html", b"<html", b"<head", b"<body")):
            what = "a web page (HTML)"
        elif text.startswith(b"<?xml"):
            what = "an XML document"
        elif text and all(32 <= byte < 127 or byte in b"\t\r\n" for byte in text[:512]):
            what = "a text file"
    if what is None:
        return f"This file is not a recognised image. {_SUPPORTED}"
    return f"This file is {what}, which is not supported. {_SUPPORTED}"


def _looks_like_headerless_dicom(raw: bytes) -> bool:
    # A raw dataset starts with a group 0002 or 0008 tag, then (explicit VR) two letters.
    little, big = raw[:2] in (b"\x02\x00", b"\x08\x00"), raw[:2] in (b"\x00\x02", b"\x00\x08")
    return (little or big) and len(raw) >= 8 and (raw[4:6].isalpha() or raw[6:8] == b"\x00\x00")


# ── DICOM ────────────────────────────────────────────────────────────────────────────────────

_DAMAGED_DICOM = "This DICOM file is damaged or incomplete and could not be read."
_DAMAGED_PIXELS = "The image data in this DICOM file is damaged or incomplete and could not be decoded."

_PIXEL_DATA_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")

# What rendering needs, and all that is copied out of the upload: the Image Pixel module, the
# Modality LUT and VOI LUT modules and the palette. LUT sequences are rebuilt item by item so
# that their free-text explanations stay behind.
_PIXEL_KEYWORDS = (
    "SamplesPerPixel", "PhotometricInterpretation", "PlanarConfiguration", "NumberOfFrames",
    "Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit", "PixelRepresentation",
    "RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth", "VOILUTFunction",
    "RedPaletteColorLookupTableDescriptor", "GreenPaletteColorLookupTableDescriptor",
    "BluePaletteColorLookupTableDescriptor", "RedPaletteColorLookupTableData",
    "GreenPaletteColorLookupTableData", "BluePaletteColorLookupTableData",
    "SegmentedRedPaletteColorLookupTableData", "SegmentedGreenPaletteColorLookupTableData",
    "SegmentedBluePaletteColorLookupTableData",
    "ExtendedOffsetTable", "ExtendedOffsetTableLengths", *_PIXEL_DATA_KEYWORDS,
)
_LUT_SEQUENCES = ("ModalityLUTSequence", "VOILUTSequence")

# Attributes a scan may carry past this module: coded values (checked against the CS character
# set, so no free text slips through) and numbers. None of them is in the PS3.15 Annex E Basic
# Profile. Left out on purpose: every name, ID, date, time, age, UID, institution, station or
# device identifier, and all free text (StudyDescription, SeriesDescription, ImageComments,
# ProtocolName, even Manufacturer), since sites type patient names into free-text fields.
_SAFE_CODED = (
    "Modality", "BodyPartExamined", "ImageType", "PatientPosition", "ViewPosition", "Laterality",
    "ImageLaterality", "PhotometricInterpretation", "RescaleType", "MRAcquisitionType",
    "ScanningSequence", "SequenceVariant", "BurnedInAnnotation", "LossyImageCompression",
)
_SAFE_NUMERIC = (
    "Rows", "Columns", "NumberOfFrames", "SamplesPerPixel", "BitsAllocated", "BitsStored",
    "PixelRepresentation", "PixelSpacing", "ImagerPixelSpacing", "SliceThickness",
    "SpacingBetweenSlices", "RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth",
    "KVP", "MagneticFieldStrength", "EchoTime", "RepetitionTime", "InversionTime", "FlipAngle",
)
_CODE_STRING = re.compile(r"[A-Z0-9 _]{0,16}")

_MONOCHROME = ("MONOCHROME1", "MONOCHROME2")
_SUPPORTED_PHOTOMETRIC = (*_MONOCHROME, "PALETTE COLOR", "RGB", "YBR_FULL", "YBR_FULL_422",
                          "YBR_RCT", "YBR_ICT")
_UNSUPPORTED_PHOTOMETRIC = ("YBR_PARTIAL_420", "YBR_PARTIAL_422", "ARGB", "CMYK", "HSV")

# Transfer syntaxes newer than pydicom's UID dictionary, named for the error message.
_TRANSFER_SYNTAX_NAMES = {
    "1.2.840.10008.1.2.4.110": "JPEG-XL",
    "1.2.840.10008.1.2.4.111": "JPEG-XL",
    "1.2.840.10008.1.2.4.112": "JPEG-XL",
}
# pydicom's decoding plugins, in the order tried. GDCM is left out on purpose: on a corrupt JPEG
# or JPEG-LS frame it throws a C++ exception that its Python binding does not translate, and the
# whole process aborts (found by scripts/fuzz_imaging.py). pylibjpeg decodes every syntax GDCM
# would, and Pillow backs it up for JPEG and JPEG 2000.
_DECODING_PLUGINS = ("pylibjpeg", "pydicom", "pillow")
_JPEG_SYNTAXES = ("1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51", "1.2.840.10008.1.2.4.57",
                  "1.2.840.10008.1.2.4.70", "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.81")
_J2K_SYNTAXES = ("1.2.840.10008.1.2.4.90", "1.2.840.10008.1.2.4.91", "1.2.840.10008.1.2.4.201",
                 "1.2.840.10008.1.2.4.202", "1.2.840.10008.1.2.4.203")


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


def _open_dicom(raw: bytes, limits: ScanLimits) -> ScanSource:
    _refuse_deflate_bomb(raw, limits)
    # No `force`: a file without the DICOM preamble and file meta is refused, not guessed at.
    ds = _guarded(_DAMAGED_DICOM, dcmread, io.BytesIO(raw))
    if not (getattr(ds, "file_meta", None) or {}).get("TransferSyntaxUID"):
        raise ScanError("This DICOM file is damaged or incomplete: its header does not say how it is encoded.")
    _refuse_non_image(ds)
    header = _guarded(_DAMAGED_DICOM, _read_pixel_header, ds)
    _check_dicom_limits(header, limits)
    _check_decodable(header)
    frames = _DicomFrames(
        pixel_ds=_guarded(_DAMAGED_DICOM, _copy_pixel_dataset, ds, header),
        header=header,
        per_frame=_guarded(_DAMAGED_DICOM, _functional_group_values, ds, header.frames),
    )
    safe_meta = _dicom_safe_meta(ds, header)
    del ds  # the parsed upload, identifying tags and all, is dropped here
    return ScanSource(source_format="dicom", frame_count=header.frames, safe_meta=safe_meta,
                      load_frame=frames.load)


def _refuse_deflate_bomb(raw: bytes, limits: ScanLimits) -> None:
    """pydicom inflates a Deflated transfer syntax dataset in one unbounded zlib call; inflate it
    here first with a cap, so a small file cannot expand into gigabytes."""
    fp = io.BytesIO(raw)
    meta = _guarded(_DAMAGED_DICOM, _read_file_meta, fp)  # pydicom's reader, private but stable in 3.x
    if meta.get("TransferSyntaxUID") != DeflatedExplicitVRLittleEndian:
        return
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    compressed = memoryview(raw)[fp.tell():]
    inflated = 0
    for start in range(0, len(compressed), 2**20):
        # max_length stops the output one byte past the limit, however well the chunk compresses.
        chunk = compressed[start:start + 2**20]
        inflated += len(_guarded(_DAMAGED_DICOM, inflater.decompress, chunk, limits.max_bytes + 1 - inflated))
        if inflated > limits.max_bytes:
            raise ScanError(f"This DICOM file expands to more than the {limits.max_bytes / 2**20:.0f} MB "
                            "limit when decompressed.")


def _read_file_meta(fp: io.BytesIO) -> FileMetaDataset:
    read_preamble(fp, False)
    return _read_file_meta_info(fp)


def _refuse_non_image(ds: Dataset) -> None:
    if any(keyword in ds for keyword in _PIXEL_DATA_KEYWORDS):
        return
    sop = str(_value_or_none(ds, "SOPClassUID") or _value_or_none(ds.file_meta, "MediaStorageSOPClassUID") or "")
    if sop == "1.2.840.10008.1.3.10" or "DirectoryRecordSequence" in ds:
        raise ScanError("This file is a DICOMDIR (the index of a DICOM disc) and holds no image. "
                        "Please upload one of the image files it lists.")
    if sop == "1.2.840.10008.5.1.4.1.1.88.59":
        what = "a Key Object Selection document"
    elif sop.startswith("1.2.840.10008.5.1.4.1.1.88."):
        what = "a Structured Report"
    elif sop.startswith("1.2.840.10008.5.1.4.1.1.104."):
        what = "an encapsulated document (such as a PDF report)"
    elif sop.startswith("1.2.840.10008.5.1.4.1.1.11."):
        what = "a Presentation State (display settings for other images)"
    elif sop.startswith("1.2.840.10008.5.1.4.1.1.9."):
        what = "a waveform recording (such as an ECG)"
    elif sop.startswith("1.2.840.10008.5.1.4.1.1.481."):
        what = "a radiotherapy object"
    elif _is_known_uid(sop):
        what = f"a '{UID(sop).name}' object"
    else:
        raise ScanError("This DICOM file holds no image (it has no pixel data).")
    raise ScanError(f"This DICOM file is {what} and holds no image.")


def _read_pixel_header(ds: Dataset) -> _PixelHeader:
    transfer_syntax = ds.file_meta.TransferSyntaxUID
    bits_allocated = _header_int(ds, "BitsAllocated")
    frames = _header_int(ds, "NumberOfFrames", default=1, minimum=0) or 1  # 0 means 1, as in pydicom
    photometric = ds.get("PhotometricInterpretation")
    if not isinstance(photometric, str):
        raise ScanError(_DAMAGED_DICOM)
    photometric = photometric.strip().upper()
    if photometric not in _SUPPORTED_PHOTOMETRIC:
        # Only defined terms are echoed back; anything else in the field stays unquoted.
        what = f"the {photometric}" if photometric in _UNSUPPORTED_PHOTOMETRIC else "an unknown"
        raise ScanError(f"This DICOM file uses {what} colour encoding, which is not supported.")
    return _PixelHeader(
        rows=_header_int(ds, "Rows"),
        columns=_header_int(ds, "Columns"),
        frames=frames,
        samples=_header_int(ds, "SamplesPerPixel", default=1),
        bits_allocated=bits_allocated,
        bits_stored=_header_int(ds, "BitsStored", default=bits_allocated),
        pixel_representation=_header_int(ds, "PixelRepresentation", default=0, minimum=0),
        photometric=photometric,
        transfer_syntax=UID(str(transfer_syntax)),
    )


def _header_int(ds: Dataset, keyword: str, default: int | None = None, minimum: int = 1) -> int:
    value = ds.get(keyword)
    if value is None or value == "":
        if default is None:
            raise ScanError(_DAMAGED_DICOM)
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ScanError(_DAMAGED_DICOM)
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ScanError(_DAMAGED_DICOM)
    return number


def _check_dicom_limits(header: _PixelHeader, limits: ScanLimits) -> None:
    if header.samples not in (1, 3) or header.bits_allocated not in (1, 8, 16, 32, 64):
        raise ScanError(_DAMAGED_DICOM)
    if not 1 <= header.bits_stored <= header.bits_allocated:
        raise ScanError(_DAMAGED_DICOM)
    frame_pixels = header.rows * header.columns
    total_pixels = frame_pixels * header.frames
    decoded_bytes = total_pixels * header.samples * math.ceil(header.bits_allocated / 8)
    if (header.frames > limits.max_frames or frame_pixels > limits.max_frame_pixels
            or total_pixels > limits.max_pixels or decoded_bytes > limits.max_decoded_bytes):
        raise ScanError(_too_large_message(header.rows, header.columns, header.frames, limits))


def _too_large_message(rows: int, columns: int, frames: int, limits: ScanLimits) -> str:
    size = f"{columns} × {rows} pixels" + (f" × {frames} frames" if frames > 1 else "")
    return (f"This image is too large to open safely ({size}; the limit is "
            f"{limits.max_frame_pixels / 1e6:.0f} million pixels a frame and "
            f"{limits.max_pixels / 1e6:.0f} million in all).")


def _check_decodable(header: _PixelHeader) -> None:
    syntax = header.transfer_syntax
    name = _TRANSFER_SYNTAX_NAMES.get(syntax) or (syntax.name if _is_known_uid(syntax) else None)
    if name is None:
        raise ScanError("This DICOM file uses an unrecognised encoding (transfer syntax) and cannot be shown.")
    try:
        decoder = get_decoder(syntax)
    except NotImplementedError:
        decoder = None
    if decoder is None or (syntax.is_compressed and not _safe_plugins(syntax)):
        raise ScanError(f"This DICOM file is compressed as {name}, which is not supported.")


def _copy_pixel_dataset(ds: Dataset, header: _PixelHeader) -> Dataset:
    """A new dataset with only the pixel, modality LUT, VOI LUT and palette attributes."""
    pixel_ds = Dataset()
    pixel_ds.file_meta = FileMetaDataset()
    pixel_ds.file_meta.TransferSyntaxUID = header.transfer_syntax
    pixel_ds.set_original_encoding(*ds.original_encoding)
    for keyword in _PIXEL_KEYWORDS:
        if keyword in ds:
            pixel_ds[keyword] = ds[keyword]
    for keyword in _LUT_SEQUENCES:
        items = ds.get(keyword)
        if items:
            lut = Dataset()
            for lut_keyword in ("LUTDescriptor", "LUTData"):
                if lut_keyword in items[0]:
                    lut[lut_keyword] = items[0][lut_keyword]
            setattr(pixel_ds, keyword, [lut])
    return pixel_ds


def _functional_group_values(ds: Dataset, frame_count: int) -> list[dict[str, Any]] | None:
    """Enhanced multi-frame files keep rescale and window per frame in functional groups, which
    pydicom's LUT functions do not read. Pull out just those numbers, frame by frame."""
    shared = ds.get("SharedFunctionalGroupsSequence")
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if not shared and not per_frame:
        return None

    def values_in(group: Dataset) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for sequence, keywords in (("PixelValueTransformationSequence", ("RescaleSlope", "RescaleIntercept")),
                                   ("FrameVOILUTSequence", ("WindowCenter", "WindowWidth", "VOILUTFunction"))):
            items = group.get(sequence)
            if items:
                found.update({k: items[0][k] for k in keywords if k in items[0]})
        return found

    common = values_in(shared[0]) if shared else {}
    return [{**common, **(values_in(per_frame[i]) if per_frame and i < len(per_frame) else {})}
            for i in range(frame_count)]


def _dicom_safe_meta(ds: Dataset, header: _PixelHeader) -> dict[str, str]:
    meta: dict[str, str] = {}
    for keyword in (*_SAFE_CODED, *_SAFE_NUMERIC):
        value = _value_or_none(ds, keyword)
        text = _safe_code(value) if keyword in _SAFE_CODED else _safe_number(value)
        if text:
            meta[keyword] = text
    sop = str(_value_or_none(ds, "SOPClassUID") or "")
    if _is_known_uid(sop):
        meta["SOPClass"] = UID(sop).name
    meta["TransferSyntax"] = _TRANSFER_SYNTAX_NAMES.get(header.transfer_syntax) or header.transfer_syntax.name
    return meta


def _value_or_none(ds: Dataset, keyword: str) -> Any:
    """An optional attribute's value; a malformed one is left out rather than refusing the scan."""
    try:
        return ds.get(keyword)
    except _INTERRUPTS:
        raise
    except BaseException:  # noqa: BLE001 - pydicom may raise anything converting a hostile value
        return None


def _safe_code(value: Any) -> str | None:
    values = list(value) if isinstance(value, (list, tuple, MultiValue)) else [value]
    if not values or not all(isinstance(v, str) and _CODE_STRING.fullmatch(v.strip()) for v in values):
        return None
    return "\\".join(v.strip() for v in values) or None


def _safe_number(value: Any) -> str | None:
    values = list(value) if isinstance(value, (list, tuple, MultiValue)) else [value]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                             for v in values):
        return None
    return "\\".join(_format_number(v) for v in values)


def _is_known_uid(uid: str) -> bool:
    # UID.name falls back to the UID itself when pydicom's dictionary does not know it; unknown
    # UIDs are never echoed, since private UIDs can embed dates or accession numbers.
    return bool(uid) and UID(uid).name != uid


class _DicomFrames:
    """Decodes one frame at a time on demand, keeping the last one for re-windowing."""

    def __init__(self, pixel_ds: Dataset, header: _PixelHeader, per_frame: list[dict[str, Any]] | None):
        self.pixel_ds = pixel_ds
        self.header = header
        self.per_frame = per_frame
        self._cached: tuple[int, _Frame] | None = None

    def load(self, index: int) -> _Frame:
        cached = self._cached
        if cached is not None and cached[0] == index:
            return cached[1]
        decoded = self._decode(index)
        self._cached = (index, decoded)
        return decoded

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
            return _Frame(values=values, is_color=False, invert=photometric == "MONOCHROME1",
                          file_window=file_window, voi_lut=voi_lut)
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


def _jpeg_frame_size(frame: bytes) -> tuple[int, int, int, int] | None:
    """(rows, columns, components, 1 tile) from a JPEG or JPEG-LS frame header (SOFn), or None.
    pydicom has a parser for this, but a private one."""
    start_of_frame = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC} | {0xF7}  # SOF0-15 and JPEG-LS SOF55
    if not frame.startswith(b"\xff\xd8"):
        return None
    position = 2
    while position + 9 < len(frame):
        if frame[position] != 0xFF:
            return None
        marker = frame[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in start_of_frame:
            rows = int.from_bytes(frame[position + 5:position + 7], "big")
            columns = int.from_bytes(frame[position + 7:position + 9], "big")
            return rows, columns, frame[position + 9], 1
        if marker == 0xDA:  # scan data before any frame header
            return None
        position += 2 + int.from_bytes(frame[position + 2:position + 4], "big")
    return None


def _j2k_frame_size(frame: bytes) -> tuple[int, int, int, int] | None:
    """(rows, columns, components, tiles) from a JPEG 2000 SIZ segment (ISO/IEC 15444-1 A.5.1),
    or None. pydicom's get_j2k_parameters reads only the bit depth."""
    siz = frame.find(b"\xff\x4f\xff\x51", 0, 65536)
    if siz < 0 or len(frame) < siz + 44:
        return None
    siz += 2
    number = lambda offset, size: int.from_bytes(frame[siz + offset:siz + offset + size], "big")  # noqa: E731
    columns, rows = number(6, 4) - number(14, 4), number(10, 4) - number(18, 4)
    tile_columns, tile_rows = number(22, 4), number(26, 4)
    if columns <= 0 or rows <= 0 or tile_columns == 0 or tile_rows == 0:
        return None
    tiles = math.ceil(columns / tile_columns) * math.ceil(rows / tile_rows)
    return rows, columns, number(38, 2), tiles


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


def _is_plain_8_bit(ds: Dataset, header: _PixelHeader) -> bool:
    """8-bit unsigned data with no modality transform is meant to be shown as stored."""
    slope, intercept = _first_number(ds.get("RescaleSlope")), _first_number(ds.get("RescaleIntercept"))
    identity = slope in (None, 1.0) and intercept in (None, 0.0) and not ds.get("ModalityLUTSequence")
    return header.bits_stored == 8 and header.pixel_representation == 0 and identity


# ── PNG / JPEG / TIFF ────────────────────────────────────────────────────────────────────────

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
    frames, total_pixels, first_mode = [], 0, image.mode
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
        frames.append(_guarded(damaged, _picture_frame, image, kind))
    log.debug("decoded %s with %d frame(s)", kind, count)
    rows, columns = frames[0].values.shape[:2]
    safe_meta = {"Format": _PILLOW_FORMAT[kind], "Rows": str(rows), "Columns": str(columns),
                 "PixelFormat": first_mode}  # Pillow's mode, e.g. "L", "I;16", "RGB"
    return ScanSource(source_format=kind, frame_count=count, safe_meta=safe_meta,
                      load_frame=frames.__getitem__)


def _picture_frame(image: Image.Image, kind: str) -> _Frame:
    if kind in ("jpeg", "tiff"):
        # A viewer honours the EXIF orientation of a photographed film; a damaged tag is ignored.
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - untrusted EXIF; an unrotated image is still correct data
            pass
    mode = image.mode
    if mode in _HIGH_DEPTH_GRAY:
        return _Frame(values=np.asarray(image), is_color=False)
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
    return _Frame(values=np.asarray(image.convert("RGB")), is_color=True)


# ── Rendering ────────────────────────────────────────────────────────────────────────────────

def _default_window(decoded: _Frame) -> Window | None:
    """The window used when none is asked for: the file's own, else a robust automatic one."""
    if decoded.is_color:
        return None
    if decoded.file_window is not None:
        return decoded.file_window
    return _auto_window(decoded.values)


def _auto_window(values: np.ndarray) -> Window:
    """A window over the 0.5-99.5 percentile range: robust to a few hot or dead pixels."""
    # A window needs only the shape of the histogram: a strided sample of at most ~1 M values
    # gives the same percentiles to within a grey level, in a fraction of the time.
    sample = values.ravel()[:: max(1, values.size // 2**20)]
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


def _check_frame(frame: int, frame_count: int) -> int:
    if isinstance(frame, bool) or not isinstance(frame, (int, np.integer)) or not 0 <= frame < frame_count:
        raise ScanError(f"Frame {frame} was requested, but this scan has {frame_count} "
                        f"frame{'s' if frame_count > 1 else ''} (numbered 0 to {frame_count - 1}).")
    return int(frame)


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


# ── Keeping library messages (which can quote tag values) away from users and logs ────────────

_DECODING = contextvars.ContextVar("medvqa_imaging_decoding", default=False)
# catch_warnings swaps process-wide state (until Python 3.14); two threads entering and leaving
# it out of order would leave one's filters behind for good. Uploads are therefore handled one
# at a time per process; a frame decodes in milliseconds, so users hardly wait on each other.
_ONE_AT_A_TIME = threading.RLock()
_LIBRARY_LOGGERS = ("pydicom", "PIL", "pylibjpeg", "libjpeg", "openjpeg", "rle", "gdcm")


class _SilenceWhileDecoding(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _DECODING.get()


_SILENCER = _SilenceWhileDecoding()


@contextlib.contextmanager
def _quiet_libraries():
    """Drop library log records and warnings while an upload is handled. pydicom logs element
    values in debug mode and its warnings quote invalid values; Pillow's TIFF plugin logs tags.
    A logger filter only sees records logged on that very logger, hence one per library logger."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.split(".")[0] in _LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            if _SILENCER not in logger.filters:
                logger.addFilter(_SILENCER)
    token = _DECODING.set(True)
    try:
        with _ONE_AT_A_TIME, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        _DECODING.reset(token)


_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _guarded(message: str, function: Callable, *args, **kwargs):
    """Call a library on untrusted data; any failure becomes ScanError(message). The original
    exception is neither chained nor logged in full, as its text may quote the file."""
    try:
        return function(*args, **kwargs)
    except ScanError:
        raise
    except Image.DecompressionBombError:
        failure = "This image is too large to open safely (it declares more pixels than allowed)."
    except Image.DecompressionBombWarning:
        failure = "This image is too large to open safely (it declares more pixels than allowed)."
    except MemoryError:
        failure = "This image is too large to open with the memory available."
    except _INTERRUPTS:
        raise
    except BaseException as error:  # noqa: BLE001 - hostile input can make a library raise anything,
        # including Rust decoders' PanicException, which derives from BaseException
        log.debug("%s raised %s", getattr(function, "__name__", "decoder"), type(error).__name__)
        failure = message
    raise ScanError(failure)  # outside the except block: no chained library exception


def _run_public(function: Callable, *args):
    """Run a public entry point with libraries quiet; every failure leaves as a fresh ScanError,
    with no chained exception or traceback that could hold the upload's values."""
    with _quiet_libraries():
        try:
            return function(*args)
        except ScanError as error:
            failure = str(error)
        except RecursionError:
            failure = _DAMAGED_DICOM
        except MemoryError:
            failure = "This image is too large to open with the memory available."
        except _INTERRUPTS:
            raise
        except BaseException as error:  # noqa: BLE001 - last line of defence on hostile input
            log.debug("unexpected %s while reading an upload", type(error).__name__)
            failure = "This file could not be read as an image."
    log.info("upload not shown: %s", failure)
    raise ScanError(failure)
