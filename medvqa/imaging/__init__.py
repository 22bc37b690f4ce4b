"""Uploads → the RGB image the vision encoder sees, rendered the way a DICOM viewer would.

This package is the privacy boundary: no identifying DICOM tag passes beyond it. A scan carries
only its pixels and an allowlist of coded and numeric attributes (deid.py); library loggers and
warnings are silenced while an upload is parsed, since their messages can quote tag values, and
every failure becomes a `ScanError` whose message is written here, never a library message or
traceback (guard.py). Nothing of the upload is written to disk.

    open_scan(bytes | path) ─▶ ScanSource (pixels only, identifying tags dropped, held in memory)
                                   │ render(window, frame)      (re-windowing never re-reads the file)
                                   ▼
                                  Scan(pixels (H, W, 3) uint8, window, frame, safe_meta)

DICOM goes through pydicom 3 (no `force`: a file that is not Part 10 DICOM is refused) and its own
LUT functions, in the order a viewer applies them: modality LUT (rescale slope/intercept or
Modality LUT Sequence) → VOI LUT or window centre/width (the file's, a preset or the user's) →
MONOCHROME1 inversion → 8 bit → RGB. PNG, JPEG and TIFF go through Pillow.

Modules, each importing only those listed before it:

    guard       ScanError; library logs and warnings silenced; one upload at a time
    windowing   Window, WINDOW_PRESETS; a decoded frame (_Frame) through a window to uint8 RGB
    scan        ScanLimits, Scan, ScanSource (re-rendering held pixels), parse_window, check_preset
    codestream  the size a JPEG / JPEG 2000 frame claims, read before a decoder allocates for it
    frames      DICOM frames decoded on demand through crash-safe plugins
    deid        the allowlisted DICOM metadata a scan may carry
    dicom       opening a DICOM upload: refusals, pixel header, limits, the copied pixel dataset
    picture     PNG, JPEG and TIFF through Pillow
    upload      open_scan, load_scan, cli_scan: an upload read, its format sniffed, its opener run
    archive     several files at once (a folder, a .zip, a list) read into memory under caps
    series      open_study: files grouped into series, slices ordered along the slice normal
"""

from .guard import ScanError
from .scan import (BURNED_IN_NOTE, Scan, ScanLimits, ScanSource, burned_in, check_preset, in_hounsfield_units,
                   parse_window)
from .series import Series, Study, cli_scan_study, open_study
from .upload import cli_scan, load_scan, open_scan
from .windowing import WINDOW_PRESETS, Window

__all__ = [
    "BURNED_IN_NOTE",
    "WINDOW_PRESETS",
    "Scan",
    "ScanError",
    "ScanLimits",
    "ScanSource",
    "Series",
    "Study",
    "Window",
    "burned_in",
    "check_preset",
    "cli_scan",
    "cli_scan_study",
    "in_hounsfield_units",
    "load_scan",
    "open_scan",
    "open_study",
    "parse_window",
]
