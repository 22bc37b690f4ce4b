"""De-identification by allowlist: the only DICOM attributes that travel with a scan.

Rather than removing known identifying tags (a list that can never be complete: private tags,
free text typed by staff), the scan keeps a short list of coded and numeric attributes, each
checked for form, and drops everything else. A coded value must also be one of the standard's
defined terms for its attribute (defined_terms.py): the code-string form alone lets free text such
as a name typed into BodyPartExamined through. A value that does not fit, or that pydicom cannot
even convert, is left out rather than refusing the scan.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydicom.dataset import Dataset
from pydicom.multival import MultiValue
from pydicom.uid import UID

from .defined_terms import DEFINED_TERMS, IMAGE_TYPE_EXAMINATION, IMAGE_TYPE_FURTHER, IMAGE_TYPE_PIXEL_DATA
from .frames import _PixelHeader
from .guard import _INTERRUPTS
from .windowing import _format_number


# Attributes a scan may carry past this package: coded values (checked against the CS character
# set and their defined terms, so no free text slips through) and numbers. None of them is in the
# PS3.15 Annex E Basic Profile. Left out on purpose: every name, ID, date, time, age, UID,
# institution, station or device identifier, and all free text (StudyDescription,
# SeriesDescription, ImageComments, ProtocolName, even Manufacturer), since sites type patient names
# into free-text fields.
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

# Transfer syntaxes newer than pydicom's UID dictionary, named for the error message (dicom.py)
# and for the scan's TransferSyntax entry.
_TRANSFER_SYNTAX_NAMES = {
    "1.2.840.10008.1.2.4.110": "JPEG-XL",
    "1.2.840.10008.1.2.4.111": "JPEG-XL",
    "1.2.840.10008.1.2.4.112": "JPEG-XL",
}


def _dicom_safe_meta(ds: Dataset, header: _PixelHeader) -> dict[str, str]:
    meta: dict[str, str] = {}
    for keyword in (*_SAFE_CODED, *_SAFE_NUMERIC):
        value = _value_or_none(ds, keyword)
        text = _safe_code(value, keyword) if keyword in _SAFE_CODED else _safe_number(value)
        if text:
            meta[keyword] = text
    if "PixelSpacing" not in meta:  # an enhanced multi-frame file keeps it in its functional groups
        spacing = _safe_number(_grouped_pixel_spacing(ds))
        if spacing:
            meta["PixelSpacing"] = spacing
    sop = str(_value_or_none(ds, "SOPClassUID") or "")
    if _is_known_uid(sop):
        meta["SOPClass"] = UID(sop).name
    meta["TransferSyntax"] = _TRANSFER_SYNTAX_NAMES.get(header.transfer_syntax) or header.transfer_syntax.name
    return meta


def _grouped_pixel_spacing(ds: Dataset) -> Any:
    """Pixel Spacing from an enhanced multi-frame file's Pixel Measures: the shared one, else the frames'
    own when every frame gives the same (None where they differ or give none)."""
    def spacing_in(group: Any) -> Any:
        try:
            return group.PixelMeasuresSequence[0].PixelSpacing
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            return None

    try:
        shared = ds.get("SharedFunctionalGroupsSequence")
        found = spacing_in(shared[0]) if shared else None
        if found is None:
            frames = [spacing_in(group) for group in ds.get("PerFrameFunctionalGroupsSequence") or []]
            if frames and frames[0] is not None and all(frame == frames[0] for frame in frames):
                found = frames[0]
    except Exception:  # noqa: BLE001 - a malformed group: no spacing, as for a malformed attribute
        return None
    return found


def _value_or_none(ds: Dataset, keyword: str) -> Any:
    """An optional attribute's value; a malformed one is left out rather than refusing the scan."""
    try:
        return ds.get(keyword)
    except _INTERRUPTS:
        raise
    except BaseException:  # noqa: BLE001 - pydicom may raise anything converting a hostile value
        return None


def _safe_code(value: Any, keyword: str) -> str | None:
    """The value when every part of it is a code string and one of the attribute's defined terms."""
    values = list(value) if isinstance(value, (list, tuple, MultiValue)) else [value]
    if not values or not all(isinstance(v, str) and _CODE_STRING.fullmatch(v.strip()) for v in values):
        return None
    values = [v.strip() for v in values]
    if keyword == "ImageType":
        values = _image_type(values)
    elif not all(v in DEFINED_TERMS[keyword] for v in values):
        return None
    return "\\".join(values) or None


def _image_type(values: list[str]) -> list[str]:
    """ImageType's values as far as they are defined terms: value 1 ORIGINAL or DERIVED, value 2
    PRIMARY or SECONDARY, then known modality-specific terms up to the first unknown one (later
    values are positional, so nothing after an unknown value is kept); nothing when value 1 is not one."""
    if values[0] not in IMAGE_TYPE_PIXEL_DATA:
        return []
    if len(values) < 2 or values[1] not in IMAGE_TYPE_EXAMINATION:
        return values[:1]
    kept = values[:2]
    for value in values[2:]:
        if value not in IMAGE_TYPE_FURTHER:
            break
        kept.append(value)
    return kept


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
