"""medvqa.imaging.dicom, frames and codestream: every bundled pydicom test file renders or is
refused cleanly, per-frame functional groups are honoured, and hostile DICOM (deflate bombs,
truncation, a frame that aborts GDCM) is a ScanError."""

from __future__ import annotations

import functools
import io
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.data.data_manager import DATA_ROOT, get_url_map
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.uid import DeflatedExplicitVRLittleEndian

from medvqa.imaging import ScanError, ScanLimits, Window, load_scan, open_scan

from .conftest import REPO
from .imaging_helpers import dicom_bytes, linear_window, make_dicom


def test_enhanced_multiframe_reads_rescale_and_window_per_frame():
    frames = np.stack([np.full((8, 8), 1024 + 40 * k, dtype=np.uint16) for k in range(3)])
    ds = make_dicom(frames)
    shared, transform = Dataset(), Dataset()
    transform.RescaleSlope, transform.RescaleIntercept = 1, -1024
    shared.PixelValueTransformationSequence = [transform]
    ds.SharedFunctionalGroupsSequence = [shared]
    ds.PerFrameFunctionalGroupsSequence = []
    for center in (0, 40, 80):
        group, voi = Dataset(), Dataset()
        voi.WindowCenter, voi.WindowWidth = center, 80
        group.FrameVOILUTSequence = [voi]
        ds.PerFrameFunctionalGroupsSequence.append(group)
    source = open_scan(dicom_bytes(ds))
    for frame, center in enumerate((0, 40, 80)):
        scan = source.render(frame=frame)
        assert scan.window == Window(center, 80, "file")
        assert scan.pixels[0, 0, 0] == linear_window(np.array(40.0 * frame), center, 80)  # every frame mid-grey


def _test_file_names() -> list[str]:
    """pydicom's test files: those inside pydicom and those it fetches on demand, which the package
    pydicom-data (requirements-dev.txt) ships and pydicom finds through its entry point."""
    local = {p.name for p in (Path(DATA_ROOT) / "test_files").rglob("*") if p.is_file() and p.suffix != ".py"}
    return sorted(local | set(get_url_map()))


@functools.cache
def _offline_path(name: str) -> str | None:
    return get_testdata_file(name, download=False)  # never fetched: the tests run offline


def test_every_pydicom_test_file_is_here_offline():
    names = _test_file_names()
    missing = [name for name in names if _offline_path(name) is None]
    if missing:
        pytest.skip(f"{len(missing)} of pydicom's {len(names)} test files are not installed (pydicom-data 1.0.0 "
                    f"predates them; pydicom would download them): {', '.join(missing)}")


@pytest.mark.parametrize("name", [name for name in _test_file_names() if _offline_path(name) is not None])
def test_pydicom_test_file_decodes_or_raises_scan_error(name):
    path = _offline_path(name)
    started = time.perf_counter()
    try:
        source = open_scan(path)
    except ScanError as error:
        assert str(error)
        return
    scan = source.render()
    assert scan.pixels.ndim == 3 and scan.pixels.shape[2] == 3 and scan.pixels.dtype == np.uint8
    # A plausible image is not all one value, under the file's window or, where that saturates a
    # tiny crop (the 16 × 16 CT samples), under the automatic one.
    assert np.ptp(scan.pixels) > 0 or np.ptp(source.render(window="auto").pixels) > 0
    assert time.perf_counter() - started < 10


def deflate_bomb_dicom() -> bytes:
    ds = make_dicom(np.zeros((2000, 2000)))  # 8 MB of zeros deflates to a few kB
    return dicom_bytes(ds, transfer_syntax=DeflatedExplicitVRLittleEndian)


def test_deflated_dicom_that_expands_past_the_limit():
    data = deflate_bomb_dicom()
    assert len(data) < 100_000
    with pytest.raises(ScanError, match="expands to more than"):
        load_scan(data, limits=ScanLimits(max_bytes=1_000_000))
    assert load_scan(data).pixels.shape == (2000, 2000, 3)  # within the default limit it opens


@pytest.mark.parametrize("tenths", range(1, 10))
def test_real_dicom_truncated_at_every_tenth(tenths):
    data = Path(get_testdata_file("MR_small.dcm")).read_bytes()
    with pytest.raises(ScanError):
        load_scan(data[: len(data) * tenths // 10])


def test_corrupt_jpeg_frame_does_not_abort_the_process():
    """GDCM aborts the interpreter on this frame (26 stray bytes before a Huffman table), which
    is why it is not among the decoding plugins; run it in a child so a regression fails cleanly."""
    ds = pydicom.dcmread(get_testdata_file("SC_rgb_dcmtk_+eb+cy+np.dcm"))
    frame = next(generate_frames(ds.PixelData, number_of_frames=1))
    huffman_table = frame.find(b"\xff\xc4")
    ds.PixelData = encapsulate([frame[:huffman_table] + b"\x13" * 26 + frame[huffman_table:]])
    buffer = io.BytesIO()
    ds.save_as(buffer)
    code = ("import sys; from medvqa.imaging import load_scan, ScanError\n"
            "try: print(load_scan(sys.stdin.buffer.read()).pixels.shape)\n"
            "except ScanError as error: print('refused', error)\n")
    result = subprocess.run([sys.executable, "-c", code], input=buffer.getvalue(), capture_output=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-500:]


def test_an_enhanced_multiframe_file_gives_its_pixel_spacing_from_its_functional_groups():
    frames = np.zeros((3, 8, 8), dtype=np.uint16)

    def with_groups(shared_spacing=None, per_frame=()) -> dict:
        ds = make_dicom(frames)
        if shared_spacing is not None:
            shared, measures = Dataset(), Dataset()
            measures.PixelSpacing = shared_spacing
            shared.PixelMeasuresSequence = [measures]
            ds.SharedFunctionalGroupsSequence = [shared]
        groups = []
        for spacing in per_frame:
            group, measures = Dataset(), Dataset()
            measures.PixelSpacing = spacing
            group.PixelMeasuresSequence = [measures]
            groups.append(group)
        if groups:
            ds.PerFrameFunctionalGroupsSequence = groups
        return open_scan(dicom_bytes(ds)).safe_meta

    assert with_groups([0.5, 0.6])["PixelSpacing"] == "0.5\\0.6"
    assert with_groups(None, [[0.7, 0.7]] * 3)["PixelSpacing"] == "0.7\\0.7"
    assert "PixelSpacing" not in with_groups(None, [[0.7, 0.7], [0.7, 0.7], [0.9, 0.9]])  # frames differ
    assert "PixelSpacing" not in with_groups()
