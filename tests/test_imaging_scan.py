"""medvqa.imaging.scan: a ScanSource re-rendered from memory (other window, other frame), the
limits checked before decoding, and windows typed by a user."""

from __future__ import annotations

import io

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
from medvqa.imaging.scan import MIN_SIDE

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


@pytest.mark.parametrize("size, kind", [((1, 1), "PNG"), ((3000, 1), "PNG"), ((1, 3000), "PNG"),
                                        ((7, 200), "JPEG"), ((200, 7), "TIFF")])
def test_an_image_too_small_to_read_is_refused_with_its_size(size, kind):
    columns, rows = size
    data = encode(Image.new("L", size, 90), kind)
    with pytest.raises(ScanError, match=f"^This image is {columns}×{rows} pixels, too small to read; the smallest "
                                        f"accepted is {MIN_SIDE} pixels on each side\\.$"):
        open_scan(data)
    assert load_scan(encode(Image.new("L", (MIN_SIDE, MIN_SIDE), 90), kind)).pixels.shape == (MIN_SIDE, MIN_SIDE, 3)


def test_a_dicom_and_a_frame_too_small_to_read_are_refused_in_the_same_words():
    with pytest.raises(ScanError, match="^This image is 7×64 pixels, too small to read"):
        open_scan(dicom_bytes(make_dicom(np.zeros((64, 7)))))
    with pytest.raises(ScanError, match="^This image is 2×2 pixels, too small to read"):
        open_scan(dicom_bytes(make_dicom(np.zeros((4, 2, 2)))))  # every frame of a multi-frame file
    # TIFF pages may differ in size: a small one is refused when it is shown, the others still open.
    pages = [Image.new("I;16", (16, 16)), Image.new("I;16", (16, 16)), Image.new("I;16", (4, 16))]
    buffer = io.BytesIO()
    pages[0].save(buffer, "TIFF", save_all=True, append_images=pages[1:])
    source = open_scan(buffer.getvalue())
    assert source.render(frame=0).pixels.shape == (16, 16, 3)
    with pytest.raises(ScanError, match="^Frame 3 of this image is 4×16 pixels, too small to read"):
        source.render(frame=2)


def test_scan_type():
    scan = load_scan(encode(Image.new("RGB", (12, 8)), "PNG"))
    assert isinstance(scan, Scan) and scan.pixels.shape == (8, 12, 3)
