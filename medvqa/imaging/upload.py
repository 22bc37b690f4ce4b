"""An upload → its format → that format's opener: the entry points open_scan, load_scan and cli_scan.

The upload is read into memory (nothing of it is written to disk) and its format is chosen by
content, never by file name. Anything other than DICOM, PNG, JPEG or TIFF is refused with a
message that says what the file is, if that can be told, without quoting it.
"""

from __future__ import annotations

import logging
import os
import sys

from .dicom import _open_dicom
from .guard import ScanError, _guarded, _run_public
from .picture import _open_picture
from .scan import BURNED_IN_NOTE, Scan, ScanLimits, ScanSource, burned_in
from .windowing import Window

log = logging.getLogger(__name__)


def open_scan(data: bytes | str | os.PathLike, limits: ScanLimits | None = None) -> ScanSource:
    """Read an upload (raw bytes, or a path read into memory) and decode its default frame.
    The format is chosen by content, not by file name. Raises ScanError for anything unusable."""
    return _run_public(_open_scan, data, limits or ScanLimits())


def load_scan(data: bytes | str | os.PathLike, window: Window | str | None = None,
              frame: int | None = None, limits: ScanLimits | None = None) -> Scan:
    return open_scan(data, limits).render(window=window, frame=frame)


def cli_scan(path: str) -> int:
    """`python -m medvqa scan FILE`: print what the model would be told about the scan."""
    try:
        source = open_scan(path)
        scan = source.render()
    except ScanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    meta = dict(scan.safe_meta)
    print(f"format: {meta.pop('Format', scan.source_format)}")  # a picture's metadata names its format too
    for key, value in meta.items():
        print(f"{key}: {value}")
    print(f"window: {scan.describe_window()}")
    print(f"frames: {scan.frame_count} (showing frame {scan.frame_index + 1} of {scan.frame_count})")  # as --slice
    if burned_in(scan.safe_meta):
        print(f"warning: {BURNED_IN_NOTE}")
    return 0


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


def _read_upload(data: bytes | str | os.PathLike, limits: ScanLimits, allow_empty: bool = False) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    elif isinstance(data, (str, os.PathLike)):
        raw = _guarded("The file could not be opened.", _read_path, data, limits.max_bytes)
    else:
        raise ScanError("The upload is not a file.")
    if not raw and not allow_empty:  # (in a folder or an archive, an empty file is only skipped)
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
    if raw[:4] == b"DICM" and raw[4:6] == b"\x02\x00":  # the marker and file meta, but no preamble before them
        return True
    # A raw dataset starts with a group 0002 or 0008 tag, then (explicit VR) two letters.
    little, big = raw[:2] in (b"\x02\x00", b"\x08\x00"), raw[:2] in (b"\x00\x02", b"\x00\x08")
    return (little or big) and len(raw) >= 8 and (raw[4:6].isalpha() or raw[6:8] == b"\x00\x00")
