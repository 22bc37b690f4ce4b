"""Opening a DICOM upload: everything refused that cannot be shown safely, before decoding.

pydicom 3 reads the upload without `force` (a file that is not Part 10 DICOM is refused). A
deflated dataset is inflated here first under a cap; a file that is not an image, has a damaged
pixel header, is too large or uses an encoding no crash-safe plugin decodes is refused with a
message of its own. Then only the pixel, LUT and palette attributes are copied out, the allowlisted
metadata is taken (deid.py), and the parsed upload, identifying tags and all, is dropped.
"""

from __future__ import annotations

import hashlib
import io
import math
import secrets
import zlib
from dataclasses import dataclass, field
from typing import Any

from pydicom import dcmread
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.filereader import _read_file_meta_info, read_preamble
from pydicom.pixels import get_decoder
from pydicom.uid import UID, DeflatedExplicitVRLittleEndian

from .deid import _TRANSFER_SYNTAX_NAMES, _dicom_safe_meta, _is_known_uid, _value_or_none
from .frames import _MONOCHROME, _DicomFrames, _PixelHeader, _safe_plugins
from .guard import _DAMAGED_DICOM, ScanError, _guarded
from .scan import ScanLimits, ScanSource, _too_large_message


_PIXEL_DATA_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")

# What rendering needs, and all that is copied out of the upload: the Image Pixel module, the
# Modality LUT and VOI LUT modules and the palette. LUT sequences are rebuilt item by item so
# that their free-text explanations stay behind.
_PIXEL_KEYWORDS = (
    "SamplesPerPixel", "PhotometricInterpretation", "PlanarConfiguration", "NumberOfFrames",
    "Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit", "PixelRepresentation",
    "RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth", "VOILUTFunction", "PresentationLUTShape",
    "PixelPaddingValue", "PixelPaddingRangeLimit",
    "RedPaletteColorLookupTableDescriptor", "GreenPaletteColorLookupTableDescriptor",
    "BluePaletteColorLookupTableDescriptor", "RedPaletteColorLookupTableData",
    "GreenPaletteColorLookupTableData", "BluePaletteColorLookupTableData",
    "SegmentedRedPaletteColorLookupTableData", "SegmentedGreenPaletteColorLookupTableData",
    "SegmentedBluePaletteColorLookupTableData",
    "ExtendedOffsetTable", "ExtendedOffsetTableLengths", *_PIXEL_DATA_KEYWORDS,
)
_LUT_SEQUENCES = ("ModalityLUTSequence", "VOILUTSequence")

_SUPPORTED_PHOTOMETRIC = (*_MONOCHROME, "PALETTE COLOR", "RGB", "YBR_FULL", "YBR_FULL_422",
                          "YBR_RCT", "YBR_ICT")
_UNSUPPORTED_PHOTOMETRIC = ("YBR_PARTIAL_420", "YBR_PARTIAL_422", "ARGB", "CMYK", "HSV")


def _open_dicom(raw: bytes, limits: ScanLimits) -> ScanSource:
    return _open_dicom_placed(raw, limits)[0]


def _open_dicom_placed(raw: bytes, limits: ScanLimits) -> tuple[ScanSource, _Placement]:
    """The scan, and where it lies in its series (used by series.py to group and order slices)."""
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
    placement = _placement(ds)
    del ds  # the parsed upload, identifying tags and all, is dropped here
    source = ScanSource(source_format="dicom", frame_count=header.frames, safe_meta=safe_meta,
                        load_frame=frames.load, forget=frames.forget, held=frames.held)
    return source, placement


@dataclass(frozen=True)
class _Placement:
    """Where a slice lies: what grouping and ordering a series needs, and nothing else. The series
    and study keys are UIDs: they are compared inside this package (series.py) and never leave it."""

    series_key: str = field(repr=False)  # SeriesInstanceUID, "" when absent
    study_key: str = field(repr=False)  # StudyInstanceUID, "" when absent
    orientation: tuple[float, ...] | None  # ImageOrientationPatient: row and column direction cosines
    position: tuple[float, ...] | None  # ImagePositionPatient (mm): the first pixel's centre
    instance_number: int | None
    copy_key: bytes | None = field(repr=False)  # a digest of SOPInstanceUID and pixel data, equal for copies
    patient_key: bytes | None = field(default=None, repr=False)  # a keyed digest of PatientID (_patient_key)
    # An enhanced multi-frame file's frames, in stored order: each one's orientation and position from its
    # Plane Orientation and Plane Position functional groups (PS3.3 C.7.6.16.2.1-2); None for other files.
    frames: tuple[tuple[tuple[float, ...] | None, tuple[float, ...] | None], ...] | None = None


def _placement(ds: Dataset) -> _Placement:
    instance = _value_or_none(ds, "InstanceNumber")
    return _Placement(
        series_key=str(_value_or_none(ds, "SeriesInstanceUID") or ""),
        study_key=str(_value_or_none(ds, "StudyInstanceUID") or ""),
        orientation=_numbers(_value_or_none(ds, "ImageOrientationPatient"), 6),
        position=_numbers(_value_or_none(ds, "ImagePositionPatient"), 3),
        instance_number=int(instance) if isinstance(instance, int) and not isinstance(instance, bool) else None,
        copy_key=_copy_key(ds),
        patient_key=_patient_key(ds),
        frames=_frame_planes(ds),
    )


def _frame_planes(ds: Dataset) -> tuple[tuple[tuple[float, ...] | None, tuple[float, ...] | None], ...] | None:
    """(orientation, position) of each frame of an enhanced multi-frame file, a per-frame group's over the
    shared one's; None where the file has no functional groups."""
    shared = ds.get("SharedFunctionalGroupsSequence")
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if not per_frame:
        return None

    def plane(group: Dataset | None, sequence: str, keyword: str, count: int) -> tuple[float, ...] | None:
        items = group.get(sequence) if group is not None else None
        return _numbers(_value_or_none(items[0], keyword), count) if items else None

    common = shared[0] if shared else None
    return tuple((plane(group, "PlaneOrientationSequence", "ImageOrientationPatient", 6)
                  or plane(common, "PlaneOrientationSequence", "ImageOrientationPatient", 6),
                  plane(group, "PlanePositionSequence", "ImagePositionPatient", 3)
                  or plane(common, "PlanePositionSequence", "ImagePositionPatient", 3))
                 for group in per_frame)


def _copy_key(ds: Dataset) -> bytes | None:
    """Equal for two files of one image (the same SOP Instance UID and pixel data) whatever their other
    attributes: a copy exported again with other tags is still a copy, while an instance whose pixels
    differ shows something else and is kept. A digest, so that no UID is kept; None without a UID."""
    uid = str(_value_or_none(ds, "SOPInstanceUID") or "")
    pixels = next((_value_or_none(ds, keyword) for keyword in _PIXEL_DATA_KEYWORDS if keyword in ds), None)
    if not uid or not isinstance(pixels, bytes):
        return None
    return hashlib.sha256(uid.encode() + b"\0" + pixels).digest()


# A key of this process's own: a patient key matches only another made by the same process, and no
# list of known IDs can be hashed to find out whose it is.
_PATIENT_KEY_SECRET = secrets.token_bytes(32)


def _patient_key(ds: Dataset) -> bytes | None:
    """Equal for two files naming the same patient ID: to tell files of different patients apart (one
    study's files mixed up, an archive filing two patients under one study) without keeping the ID."""
    return patient_id_key(_value_or_none(ds, "PatientID"))


def patient_id_key(patient_id) -> bytes | None:
    """A patient ID as a digest keyed with a secret of this process (equal for equal IDs, and nothing
    else can be learnt from it); None when there is no ID. A PACS answer's IDs are compared this way too."""
    patient = str(patient_id or "").strip(" \t\r\n\0")  # (DICOM pads values with spaces, some writers with NUL)
    if not patient:
        return None
    return hashlib.blake2b(patient.encode("utf-8", "replace"), key=_PATIENT_KEY_SECRET, digest_size=16).digest()


def _numbers(value: Any, count: int) -> tuple[float, ...] | None:
    """`count` finite numbers, or None for anything else (absent, short, malformed)."""
    try:
        numbers = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        return None
    return numbers if len(numbers) == count and all(math.isfinite(n) for n in numbers) else None


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


class _NoImage(ScanError):
    """A DICOM object that holds no image (a report, a presentation state, ...): an error for a
    single upload, a note in a series (series.py). `what` names the kind, never the file."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what


def _refuse_non_image(ds: Dataset) -> None:
    if any(keyword in ds for keyword in _PIXEL_DATA_KEYWORDS):
        return
    sop = str(_value_or_none(ds, "SOPClassUID") or _value_or_none(ds.file_meta, "MediaStorageSOPClassUID") or "")
    if sop == "1.2.840.10008.1.3.10" or "DirectoryRecordSequence" in ds:
        raise _NoImage("a DICOMDIR", "This file is a DICOMDIR (the index of a DICOM disc) and holds no image. "
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
    elif _is_known_uid(sop) and "Image Storage" in UID(sop).name:
        # An image object without its pixels: cut short in transfer or on disk, not a kind without images
        # (in a series, noted as a file that could not be read).
        raise ScanError(f"This DICOM file is a '{UID(sop).name}' object whose pixel data is missing: the file "
                        "is damaged or incomplete.")
    elif _is_known_uid(sop):
        what = f"a '{UID(sop).name}' object"
    else:
        raise _NoImage("an object without pixel data", "This DICOM file holds no image (it has no pixel data).")
    raise _NoImage(what, f"This DICOM file is {what} and holds no image.")


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
    # Rescale Slope and Intercept come together (PS3.3 C.11.1.1.2); pydicom applies neither where one is
    # missing, so a CT that carries its intercept alone, as some exporters write it, would be 1024 off.
    # The missing one is taken as its identity value, as viewers do.
    if "RescaleIntercept" in pixel_ds and "RescaleSlope" not in pixel_ds:
        pixel_ds.RescaleSlope = 1
    elif "RescaleSlope" in pixel_ds and "RescaleIntercept" not in pixel_ds:
        pixel_ds.RescaleIntercept = 0
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
