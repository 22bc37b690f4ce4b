"""Several files in one upload: a folder, a .zip, or a list of files, read into memory with guards.

Every cap is checked before anything is extracted or read: the number of files, their sizes added
up, and (for a .zip) the ratio of extracted to compressed size, per entry and in all (zip bombs).
A .zip is refused outright when an entry's name points outside it (`..`, an absolute path, a
drive letter), is a link, is encrypted, or is itself an archive. Nothing is extracted to disk, and
no file name ever appears in a message or a log (folder names often hold a patient's name).
"""

from __future__ import annotations

import io
import os
import re
import stat
import zipfile
from typing import Sequence

from .guard import ScanError, _guarded
from .scan import ScanLimits
from .upload import _read_upload

_ARCHIVE_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06", b"\x1f\x8b", b"7z\xbc\xaf\x27\x1c", b"Rar!", b"BZh")
_ARCHIVE_SUFFIXES = (".zip", ".gz", ".tgz", ".tar", ".7z", ".rar", ".bz2", ".xz")
_RATIO_FLOOR_BYTES = 2**20  # below this an entry may compress as well as it likes (a blank slice does)
_DAMAGED_ZIP = "This .zip archive is damaged or incomplete and could not be read."


def is_zip(raw: bytes) -> bool:
    return raw.startswith((b"PK\x03\x04", b"PK\x05\x06"))


def _read_files(items: Sequence[bytes | str | os.PathLike], limits: ScanLimits) -> list[bytes]:
    """The bytes of every file in `items` (each raw bytes, a file, a folder or a .zip), in order."""
    if len(items) > limits.max_files:
        raise ScanError(_too_many(len(items), limits))
    files: list[bytes] = []
    for item in items:
        if isinstance(item, (str, os.PathLike)) and os.path.isdir(item):
            found = _read_folder(item, limits)
        else:
            raw = _read_upload(item, limits, allow_empty=True)
            found = _read_zip(raw, limits) if is_zip(raw) else [raw]
        files += found
        _check_totals(len(files), sum(map(len, files)), limits)
    return files


def _read_folder(folder: str | os.PathLike, limits: ScanLimits) -> list[bytes]:
    """Every regular file under `folder` (links are not followed), counted and sized before reading."""
    paths, total = [], 0
    for root, subfolders, names in os.walk(folder, followlinks=False):
        subfolders.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            info = _guarded("A file in the folder could not be opened.", os.lstat, path)
            if not stat.S_ISREG(info.st_mode):
                continue
            if name.lower().endswith(_ARCHIVE_SUFFIXES):
                raise ScanError(_NESTED)
            paths.append(path)
            total += info.st_size
            _check_totals(len(paths), total, limits)
    files = []
    for path in paths:
        raw = _read_upload(path, limits, allow_empty=True)
        if raw.startswith(_ARCHIVE_SIGNATURES):
            raise ScanError(_NESTED)
        files.append(raw)
    return files


def _read_zip(raw: bytes, limits: ScanLimits) -> list[bytes]:
    archive = _guarded(_DAMAGED_ZIP, zipfile.ZipFile, io.BytesIO(raw))
    entries = [info for info in archive.infolist()
               if not info.is_dir() and not info.filename.startswith("__MACOSX/")]  # macOS resource forks
    for info in archive.infolist():
        _check_entry(info, limits)
    extracted = sum(info.file_size for info in entries)
    if extracted > _RATIO_FLOOR_BYTES and extracted > limits.max_zip_ratio * len(raw):
        raise ScanError(_BOMB)
    _check_totals(len(entries), extracted, limits)
    files = []
    for info in entries:
        data = _guarded(_DAMAGED_ZIP, _read_entry, archive, info)
        if len(data) > info.file_size:  # more than the header declared: a forged size
            raise ScanError(_BOMB)
        if data.startswith(_ARCHIVE_SIGNATURES):
            raise ScanError(_NESTED)
        files.append(data)
    return files


def _read_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    with archive.open(info) as entry:
        return entry.read(info.file_size + 1)


def _check_entry(info: zipfile.ZipInfo, limits: ScanLimits) -> None:
    """Refuse the archive for an entry that points outside it, is a link, is encrypted, is an
    archive itself, or inflates too far."""
    name = info.filename.replace("\\", "/")
    if name.startswith("/") or re.match(r"[A-Za-z]:", name) or ".." in name.split("/"):
        raise ScanError("This .zip archive has entries whose names point outside it (with '..' or an "
                        "absolute path), so it was refused. Please zip the folder of DICOM files itself.")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise ScanError("This .zip archive holds links to other files, so it was refused.")
    if info.flag_bits & 0x1:
        raise ScanError("This .zip archive is password-protected; please upload it without a password.")
    if info.is_dir():
        return
    if name.lower().endswith(_ARCHIVE_SUFFIXES):
        raise ScanError(_NESTED)
    if info.file_size > _RATIO_FLOOR_BYTES and info.file_size > limits.max_zip_ratio * max(info.compress_size, 1):
        raise ScanError(_BOMB)
    if info.file_size > limits.max_bytes:
        raise ScanError(f"A file in this .zip archive is larger than the {limits.max_bytes / 2**20:.0f} MB limit.")


def _check_totals(count: int, total_bytes: int, limits: ScanLimits) -> None:
    if count > limits.max_files:
        raise ScanError(_too_many(count, limits))
    if total_bytes > limits.max_total_bytes:
        raise ScanError(f"These files add up to more than the {limits.max_total_bytes / 2**30:.1f} GB limit "
                        "for one upload.")


def _too_many(count: int, limits: ScanLimits) -> str:
    return (f"This upload holds {count:,} files or more; at most {limits.max_files:,} are read at once. "
            "Please upload one series at a time.")


_NESTED = ("This upload holds an archive inside an archive (or inside the folder); nested archives are "
           "not opened. Please upload the DICOM files themselves, or one .zip of them.")
_BOMB = ("This .zip archive expands far more than image files do (a 'zip bomb'), so it was not opened.")
