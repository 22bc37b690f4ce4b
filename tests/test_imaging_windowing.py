"""medvqa.imaging.windowing: modality values through the file's, a preset's, the user's or an
automatic window to the grey levels a DICOM viewer shows."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from pydicom.dataset import Dataset

from medvqa.imaging import WINDOW_PRESETS, Window, load_scan, open_scan

from .imaging_helpers import HU, ct_from_hu, dicom_bytes, linear_window, make_dicom


@pytest.mark.parametrize("preset", sorted(WINDOW_PRESETS))
def test_ct_hu_values_give_known_gray_levels_under_each_preset(preset):
    window = WINDOW_PRESETS[preset]
    scan = load_scan(ct_from_hu(), window=preset)
    assert scan.pixels.shape == (*HU.shape, 3) and scan.pixels.dtype == np.uint8
    assert (scan.pixels[..., 0] == scan.pixels[..., 1]).all() and (scan.pixels[..., 1] == scan.pixels[..., 2]).all()
    np.testing.assert_array_equal(scan.pixels[..., 0], linear_window(HU, window.center, window.width))
    assert scan.window == window
    assert scan.describe_window().startswith(preset.replace("_", " ") + " window (C ")


def test_known_anchor_gray_levels():
    lung = load_scan(ct_from_hu(), window="lung").pixels[..., 0]
    assert lung[0, 2] == 128  # -600 HU is the lung window's centre
    assert lung[1, 3] == 255 and lung[2, 3] == 255  # above -600 + 1500/2
    assert lung[0, 0] == 55  # -1024 HU, air, is still inside the lung window
    brain = load_scan(ct_from_hu(), window="brain").pixels[..., 0]
    assert brain[1, 0] == 0 and brain[1, 1] == 129 and brain[1, 2] == 255  # 0, 40 and 80 HU
    assert load_scan(ct_from_hu(), window="lung").describe_window() == "lung window (C -600 / W 1500)"


def test_file_window_first_of_several_values_is_the_default():
    data = ct_from_hu(WindowCenter=[40, 400], WindowWidth=[400, 1800])
    scan = load_scan(data)
    assert scan.window == Window(40, 400, "file")
    assert scan.describe_window() == "the file's own window (C 40 / W 400)"
    np.testing.assert_array_equal(scan.pixels[..., 0], linear_window(HU, 40, 400))


def test_signed_pixels_without_rescale():
    data = dicom_bytes(make_dicom(HU, signed=True, bits_stored=16))
    scan = load_scan(data, window=Window(0, 1000, "user"))
    np.testing.assert_array_equal(scan.pixels[..., 0], linear_window(HU, 0, 1000))
    assert scan.describe_window() == "user window (C 0 / W 1000)"


def test_no_file_window_falls_back_to_a_percentile_window():
    y, x = np.mgrid[0:64, 0:64]
    scan = load_scan(dicom_bytes(make_dicom((x * 60 + y) % 4096)))
    assert scan.window.name == "auto-percentile"
    assert scan.pixels.min() == 0 and scan.pixels.max() == 255
    assert "percentile" in scan.describe_window()


def test_monochrome1_is_inverted_after_the_window():
    normal = load_scan(ct_from_hu(), window="abdomen").pixels
    inverted = load_scan(ct_from_hu(PhotometricInterpretation="MONOCHROME1"), window="abdomen").pixels
    np.testing.assert_array_equal(inverted, 255 - normal)


def test_voi_lut_sequence_is_applied_before_window_center_width():
    stored = np.arange(4096, dtype=np.uint16).reshape(64, 64)
    ds = make_dicom(stored, WindowCenter=2048, WindowWidth=4096)
    lut = Dataset()
    lut.add_new("LUTDescriptor", "US", [4096, 0, 12])
    lut.add_new("LUTData", "US", [4095 - v for v in range(4096)])  # an inverting LUT
    lut.LUTExplanation = "ZQSECRET explanation"  # free text, must not survive
    ds.VOILUTSequence = [lut]
    source = open_scan(dicom_bytes(ds))
    scan = source.render()
    assert scan.window.name == "file-lut"
    expected = np.rint((4095 - stored.astype(np.int64)) * 255 / 4095).astype(np.uint8)
    np.testing.assert_array_equal(scan.pixels[..., 0], expected)
    assert b"ZQSECRET" not in pickle.dumps(source)


@pytest.mark.parametrize("shape", [(40, 50), (40, 50, 3)])
def test_8_bit_pixels_index_the_window_table_themselves(shape):
    """8-bit pixels (a PNG or JPEG, grey or colour) are their own level indexes, no uint16 copy, and
    windowing them through the table gives what windowing each pixel gives."""
    from medvqa.imaging.windowing import _Frame, _to_rgb8, _window_to_uint8

    values = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    frame = _Frame(values=values, is_color=len(shape) == 3)
    assert frame.levels is values
    for window in (Window(100, 80, "user"), WINDOW_PRESETS["lung"], Window(127.5, 255, "none", "LINEAR_EXACT")):
        per_pixel = _window_to_uint8(values.astype(np.int64), window, frame)
        expected = per_pixel if frame.is_color else np.repeat(per_pixel[..., None], 3, axis=2)
        np.testing.assert_array_equal(_to_rgb8(frame, window), expected)


def test_a_centre_that_is_float_noise_beside_the_width_is_said_as_zero():
    from medvqa.imaging.windowing import Window

    assert Window(2.33058e-12, 1.0, "user").describe() == "user window (C 0 / W 1)"
    assert Window(0.25, 1.0, "user").describe() == "user window (C 0.25 / W 1)"


def test_presentation_lut_shape_inverse_inverts_monochrome2_once_and_monochrome1_not_twice():
    """PS3.3 C.11.6.1.2: a MONOCHROME2 image with Presentation LUT Shape INVERSE is shown inverted (a CR or
    secondary capture may be written so); MONOCHROME1 with INVERSE, the pairing a DX must use, is inverted
    once, as MONOCHROME1 alone is; IDENTITY changes nothing."""
    normal = load_scan(ct_from_hu(), window="abdomen").pixels
    inverse = load_scan(ct_from_hu(PresentationLUTShape="INVERSE"), window="abdomen").pixels
    np.testing.assert_array_equal(inverse, 255 - normal)
    identity = load_scan(ct_from_hu(PresentationLUTShape="IDENTITY"), window="abdomen").pixels
    np.testing.assert_array_equal(identity, normal)
    dx_pairing = load_scan(ct_from_hu(PhotometricInterpretation="MONOCHROME1", PresentationLUTShape="INVERSE"),
                           window="abdomen").pixels
    np.testing.assert_array_equal(dx_pairing, 255 - normal)


def test_pixel_padding_is_left_out_of_the_automatic_window():
    """PS3.3 C.7.5.1.1.2: pixels at the Pixel Padding Value (here -2000 HU outside a CT's round field of
    view) are not image data: the automatic window is the one the field of view alone gets."""
    y, x = np.mgrid[0:64, 0:64]
    inside = (y - 32) ** 2 + (x - 32) ** 2 <= 28 ** 2
    hu = np.where(inside, (x * 40 - 1000), -2000)
    stored = hu + 1024
    with_padding = make_dicom(stored, signed=True, bits_stored=16, RescaleSlope=1, RescaleIntercept=-1024,
                              PixelPaddingValue=-2000 + 1024)
    without_tag = make_dicom(stored, signed=True, bits_stored=16, RescaleSlope=1, RescaleIntercept=-1024)
    padded_window = load_scan(dicom_bytes(with_padding)).window
    counted_window = load_scan(dicom_bytes(without_tag)).window
    low, high = np.percentile(hu[inside], [0.5, 99.5])
    assert padded_window.name == "auto-percentile"
    assert padded_window.center == pytest.approx((low + high) / 2, abs=1)
    assert padded_window.width == pytest.approx(high - low, abs=1)
    assert counted_window.width > padded_window.width + 500  # -2000 pulled the unpadded one down
    # A range (Pixel Padding Range Limit) is padding too, from either end.
    ranged = make_dicom(stored, signed=True, bits_stored=16, RescaleSlope=1, RescaleIntercept=-1024,
                        PixelPaddingValue=-2000 + 1024, PixelPaddingRangeLimit=-1500 + 1024)
    assert load_scan(dicom_bytes(ranged)).window == padded_window


def test_a_ct_with_its_rescale_intercept_alone_is_still_in_hounsfield_units():
    """Some exporters write Rescale Intercept without Rescale Slope (PS3.3 makes both Type 1): the slope is
    taken as 1, so the abdomen window shows the same grey levels as for the complete file."""
    complete = load_scan(ct_from_hu(), window="abdomen").pixels
    intercept_only = make_dicom(HU + 1024, RescaleIntercept=-1024)
    np.testing.assert_array_equal(load_scan(dicom_bytes(intercept_only), window="abdomen").pixels, complete)


def test_a_padding_value_written_unsigned_for_signed_pixels_still_marks_the_padding():
    """Pixel Padding Value is US or SS by Pixel Representation; a file writing -2000 as unsigned 63536 for
    signed pixels means the same value."""
    y, x = np.mgrid[0:64, 0:64]
    hu = np.where((y - 32) ** 2 + (x - 32) ** 2 <= 28 ** 2, x * 40 - 1000, -2000)
    signed = make_dicom(hu + 1024, signed=True, bits_stored=16, RescaleSlope=1, RescaleIntercept=-1024,
                        PixelPaddingValue=-976)
    unsigned = make_dicom(hu + 1024, signed=True, bits_stored=16, RescaleSlope=1, RescaleIntercept=-1024)
    unsigned.add_new("PixelPaddingValue", "US", 65536 - 976)
    assert load_scan(dicom_bytes(unsigned)).window == load_scan(dicom_bytes(signed)).window
