"""medvqa.imaging.upload: the format is told by content, anything that is not a supported image
is refused quickly with a message saying what it is, and the `scan` command line."""

from __future__ import annotations

import io
import os
import random
import struct
import subprocess
import sys
import time
import zipfile
import zlib

import numpy as np
import pytest
from PIL import Image
from pydicom.encaps import encapsulate

from medvqa.imaging import ScanError, cli_scan, load_scan, open_scan

from .conftest import REPO
from .imaging_helpers import CT_IMAGE_STORAGE, ct_from_hu, dicom_bytes, encode, make_dicom


def test_format_is_chosen_by_content_not_name(tmp_path):
    path = tmp_path / "scan.dcm"
    path.write_bytes(encode(Image.new("L", (8, 8), 7), "PNG"))
    assert load_scan(path).source_format == "png"


def png_claiming(width: int, height: int, idat: bytes = b"") -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def zlib_bomb_png(side: int) -> bytes:
    """A few hundred kB of PNG that decodes to side² pixels of zeros."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (side + 1)
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    return png_claiming(side, side, idat)


def dicom_claiming(rows: int, columns: int, frames: int = 1) -> bytes:
    ds = make_dicom(np.zeros((2, 2)))
    ds.add_new("Rows", "UL" if rows > 65535 else "US", rows)
    ds.add_new("Columns", "UL" if columns > 65535 else "US", columns)
    ds.NumberOfFrames = frames
    return dicom_bytes(ds)


def zip_of_a_dicom() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("IMG0001.dcm", ct_from_hu())
    return buffer.getvalue()


def dicom_without_pixels(sop_class: str = CT_IMAGE_STORAGE) -> bytes:
    ds = make_dicom(np.zeros((2, 2)), SOPClassUID=sop_class)
    del ds.PixelData
    return dicom_bytes(ds)


def dicom_with_syntax(uid: str) -> bytes:
    ds = make_dicom(np.zeros((2, 2)))
    ds.PixelData = encapsulate([b"\xff\x0a" + b"\x00" * 30])
    # pydicom will not write a transfer syntax newer than its dictionary: write MPEG-2 (a UID of
    # the same length) and patch it.
    data = dicom_bytes(ds, transfer_syntax="1.2.840.10008.1.2.4.100")
    assert len(uid) == 23
    return data.replace(b"1.2.840.10008.1.2.4.100", uid.encode())


def random_bytes(seed: int, size: int, prefix: bytes = b"") -> bytes:
    rng = random.Random(seed)
    return prefix + bytes(rng.randrange(256) for _ in range(size))


BAD_INPUTS = {
    "empty": (lambda: b"", "The file is empty"),
    "random": (lambda: random_bytes(1, 5000), "not a recognised image"),
    "random after a DICOM preamble": (lambda: random_bytes(2, 3000, b"\x00" * 128 + b"DICM"), "DICOM file is damaged"),
    "random after a PNG signature": (lambda: random_bytes(3, 3000, b"\x89PNG\r\n\x1a\n"), "PNG image is damaged"),
    "random after a JPEG marker": (lambda: random_bytes(4, 3000, b"\xff\xd8\xff\xe0"), "JPEG image is damaged"),
    "zip": (zip_of_a_dicom, "This file is a ZIP archive, which is not supported"),
    "html": (lambda: b"\n<!DOCTYPE html><html><body>Sign in</body></html>", "web page"),
    "pdf": (lambda: b"%PDF-1.7\n" + b"\x00" * 100, "PDF document"),
    "gif": (lambda: b"GIF89a" + b"\x00" * 100, "GIF image"),
    "jpeg-xl": (lambda: b"\xff\x0a" + b"\x00" * 100, "This file is compressed as JPEG-XL, which is not supported"),
    "dicom in jpeg-xl": (lambda: dicom_with_syntax("1.2.840.10008.1.2.4.110"),
                         "This DICOM file is compressed as JPEG-XL, which is not supported"),
    "dicom in mpeg-4": (lambda: dicom_with_syntax("1.2.840.10008.1.2.4.102"), "compressed as MPEG-4"),
    "an image without its pixel data": (dicom_without_pixels, "whose pixel data is missing: the file is damaged"),
    "structured report": (lambda: dicom_without_pixels("1.2.840.10008.5.1.4.1.1.88.33"),
                          "This DICOM file is a Structured Report and holds no image"),
    "dicom without preamble": (lambda: ct_from_hu()[132:], "without the standard file header"),
    "dicom with its marker but no preamble": (lambda: ct_from_hu()[128:], "without the standard file header"),
    "png bomb (header)": (lambda: png_claiming(100_000, 100_000), "too large to open safely \\(it declares 10,000 million"),
    "png bomb (zlib)": (lambda: zlib_bomb_png(8000), "too large"),
    "dicom 100000 x 100000": (lambda: dicom_claiming(100_000, 100_000), "too large"),
    "dicom 65535 x 65535 x 3": (lambda: dicom_claiming(65535, 65535, 3), "too large"),
    "dicom 10000 frames of 512 x 512": (lambda: dicom_claiming(512, 512, 10_000), "too large"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_a_scan_error(name):
    make, message = BAD_INPUTS[name]
    data = make()
    started = time.perf_counter()
    with pytest.raises(ScanError, match=message):
        load_scan(data)
    assert time.perf_counter() - started < 5


def test_unreadable_paths(tmp_path):
    with pytest.raises(ScanError, match="could not be opened") as error:
        open_scan(tmp_path / "no_such_patient.dcm")
    assert "no_such_patient" not in str(error.value)
    with pytest.raises(ScanError, match="could not be opened"):
        open_scan(tmp_path)


def test_cli_scan_prints_safe_meta_window_and_frames(tmp_path, capsys):
    path = tmp_path / "ct.dcm"
    path.write_bytes(ct_from_hu(WindowCenter=40, WindowWidth=400))
    assert cli_scan(str(path)) == 0
    out = capsys.readouterr().out
    assert "Modality: CT" in out and "window: the file's own window (C 40 / W 400)" in out
    assert "frames: 1 (showing frame 1 of 1)" in out
    frames = tmp_path / "frames.dcm"
    frames.write_bytes(dicom_bytes(make_dicom(np.tile(np.arange(10)[:, None, None] * 100, (1, 16, 16)))))
    assert cli_scan(str(frames)) == 0
    assert "frames: 10 (showing frame 6 of 10)" in capsys.readouterr().out  # 1-based, as `ask --slice` counts

    (tmp_path / "page.html").write_bytes(b"<html></html>")
    assert cli_scan(str(tmp_path / "page.html")) == 2
    assert "web page" in capsys.readouterr().err


def test_python_m_medvqa_scan(tmp_path):
    if not (REPO / "medvqa" / "__main__.py").exists():
        pytest.skip("medvqa/__main__.py is not there yet")
    path = tmp_path / "image.png"
    path.write_bytes(encode(Image.new("L", (8, 8), 9), "PNG"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "medvqa", "scan", str(path)], capture_output=True,
                            text=True, cwd=REPO, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]
    assert "format: PNG" in result.stdout and "frames: 1" in result.stdout
