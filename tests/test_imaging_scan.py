"""medvqa.imaging.scan: a ScanSource re-rendered from memory (other window, other frame), the
limits checked before decoding, and windows typed by a user."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from medvqa.imaging import (
    WINDOW_PRESETS,
    Scan,
    ScanError,
    ScanLimits,
    ScanSource,
    Window,
    load_scan,
    open_scan,
    parse_window,
)

from .imaging_helpers import HU, ct_from_hu, dicom_bytes, encode, linear_window, make_dicom


def test_rewindow_and_change_frame_without_rereading_the_file(tmp_path):
    frames = np.stack([HU + 1024 + 100 * k for k in range(5)])  # frame k is HU + 100 k
    path = tmp_path / "stack.dcm"
    path.write_bytes(dicom_bytes(make_dicom(frames, bits_stored=16, RescaleSlope=1, RescaleIntercept=-1024)))
    source = open_scan(path)
    path.unlink()  # everything below works from memory
    assert isinstance(source, ScanSource) and source.is_dicom
    assert source.frame_count == 5
    default = source.render(window="lung")
    assert default.frame_index == 2 and default.frame_count == 5  # the middle frame
    np.testing.assert_array_equal(default.pixels[..., 0], linear_window(HU + 200, -600, 1500))
    for frame in (0, 4):
        for window in (WINDOW_PRESETS["bone"], Window(100, 500, "user")):
            scan = source.render(window=window, frame=frame)
            np.testing.assert_array_equal(scan.pixels[..., 0], linear_window(HU + 100 * frame, window.center,
                                                                             window.width))
            assert scan.frame_index == frame and scan.window == window
    with pytest.raises(ScanError, match="Frame 5 was requested, but this scan has 5 frames"):
        source.render(frame=5)
    with pytest.raises(ScanError, match="window width"):
        source.render(window=Window(0, 0, "user"))
    with pytest.raises(ScanError, match="Unknown window preset"):
        source.render(window="liver")


def test_parse_window():
    assert parse_window("lung") == WINDOW_PRESETS["lung"]
    assert parse_window("Soft tissue") == WINDOW_PRESETS["soft_tissue"]
    assert parse_window("40,400") == Window(40, 400, "user")
    assert parse_window("file") == "file" and parse_window("auto") == "auto"
    for bad in ("liver", "40", "a,b", "40,0"):
        with pytest.raises(ScanError):
            parse_window(bad)


def test_limits_are_checked_before_decoding():
    png = encode(Image.new("L", (100, 100)), "PNG")
    with pytest.raises(ScanError, match="larger than"):
        load_scan(png, limits=ScanLimits(max_bytes=10))
    with pytest.raises(ScanError, match="too large"):
        load_scan(png, limits=ScanLimits(max_frame_pixels=5000))
    with pytest.raises(ScanError, match="too large"):
        load_scan(ct_from_hu(), limits=ScanLimits(max_decoded_bytes=10))


def test_scan_type():
    scan = load_scan(encode(Image.new("RGB", (3, 2)), "PNG"))
    assert isinstance(scan, Scan) and scan.pixels.shape == (2, 3, 3)
