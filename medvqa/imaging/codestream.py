"""The size a compressed DICOM frame claims for itself, read before any decoder sees the frame.

A decoder allocates for the size in the codestream, not the one in the DICOM header, so a doctored
JPEG, JPEG-LS or JPEG 2000 frame could claim gigapixels; frames._DicomFrames checks what these
parsers read against the header first.
"""

from __future__ import annotations

import math


_JPEG_SYNTAXES = ("1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51", "1.2.840.10008.1.2.4.57",
                  "1.2.840.10008.1.2.4.70", "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.81")
_J2K_SYNTAXES = ("1.2.840.10008.1.2.4.90", "1.2.840.10008.1.2.4.91", "1.2.840.10008.1.2.4.201",
                 "1.2.840.10008.1.2.4.202", "1.2.840.10008.1.2.4.203")


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
