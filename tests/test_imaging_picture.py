"""medvqa.imaging.picture: PNG, JPEG and TIFF through Pillow, grey and colour, one frame per TIFF
page, and the real VQA-RAD and SLAKE images."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from medvqa.imaging import Window, load_scan, open_scan

from .imaging_helpers import encode, linear_window, require_data


def test_16_bit_png_is_windowed_to_a_robust_percentile_range():
    rng = np.random.default_rng(0)
    values = rng.integers(1000, 3000, size=(64, 64)).astype(np.uint16)
    values[0, :5] = 65535  # a few hot pixels must not flatten the image
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    scan = load_scan(encode(image, "PNG"))
    assert scan.source_format == "png" and scan.window.name == "auto-percentile"
    assert 2900 < scan.window.center + scan.window.width / 2 < 3000  # hot pixels ignored
    assert scan.pixels.min() == 0 and scan.pixels.max() == 255
    assert 100 < np.median(scan.pixels) < 156
    user = load_scan(encode(image, "PNG"), window=Window(2000, 1000, "user"))
    np.testing.assert_array_equal(user.pixels[..., 0], linear_window(values.astype(float), 2000, 1000))


def test_a_picture_gives_the_value_range_its_window_controls_span():
    values = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 9 + 1000  # 1000 .. 37855
    assert open_scan(encode(Image.fromarray(values), "PNG")).value_range == (1000.0, 37855.0)
    ramp = np.linspace(0.25, 0.75, 256, dtype=np.float32).reshape(16, 16)
    ramp[0, 0] = np.nan  # NaN is no value: left out of the range
    assert open_scan(encode(Image.fromarray(ramp, "F"), "TIFF")).value_range == (float(ramp[0, 1]), 0.75)
    gray = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert open_scan(encode(Image.fromarray(gray[2:14]), "PNG")).value_range == (32.0, 223.0)
    assert open_scan(encode(Image.new("RGB", (8, 8)), "PNG")).value_range is None


def test_8_bit_grayscale_png_is_shown_as_stored():
    values = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scan = load_scan(encode(Image.fromarray(values), "PNG"))
    np.testing.assert_array_equal(scan.pixels[..., 0], values)
    assert scan.window.name == "none" and "as stored" in scan.describe_window()
    assert scan.safe_meta == {"Format": "PNG", "Rows": "16", "Columns": "16", "PixelFormat": "L"}


def test_rgb_rgba_palette_jpeg_and_tiff():
    rgb = np.zeros((8, 8, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 100, 50
    scan = load_scan(encode(Image.fromarray(rgb), "PNG"))
    assert scan.window is None and scan.describe_window() == "no window (colour image shown as stored)"
    np.testing.assert_array_equal(scan.pixels, rgb)
    # A grey radiograph saved as an RGB JPEG (its channels alike but for compression) is said to be grey.
    ramp = np.repeat(np.linspace(0, 255, 64, dtype=np.uint8)[None, :], 64, axis=0)
    grey_rgb = load_scan(encode(Image.fromarray(np.dstack([ramp] * 3)), "JPEG"))
    assert grey_rgb.window is None and grey_rgb.grey_in_colour
    assert grey_rgb.describe_window() == "no window (grey image stored as colour, shown as stored)"

    rgba = np.dstack([rgb, np.full((8, 8), 255, np.uint8)])
    rgba[:4, :, 3] = 0  # transparent half is shown black, as on a viewer's background
    pixels = load_scan(encode(Image.fromarray(rgba), "PNG")).pixels
    assert (pixels[:4] == 0).all() and (pixels[4:] == rgb[4:]).all()

    palette = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE)
    np.testing.assert_array_equal(load_scan(encode(palette, "PNG")).pixels, rgb)

    jpeg = load_scan(encode(Image.fromarray(rgb), "JPEG", quality=95))
    assert jpeg.source_format == "jpeg" and np.abs(jpeg.pixels.astype(int) - rgb).max() <= 3

    pages = [Image.fromarray(np.full((8, 8), 1000 * (k + 1), np.uint16)) for k in range(3)]
    buffer = io.BytesIO()
    pages[0].save(buffer, "TIFF", save_all=True, append_images=pages[1:])
    source = open_scan(buffer.getvalue())
    assert source.source_format == "tiff" and source.frame_count == 3
    assert source.render(window=Window(2000, 1000, "user"), frame=2).pixels.min() == 255
    # The window sliders span every page's values, not only the middle page's (2000).
    assert source.value_range == (1000.0, 3000.0)


def test_real_vqa_rad_and_slake_images():
    vqa_rad = sorted(require_data("vqa_rad", "images").glob("synpic*.jpg"))[:4]
    slake = sorted(require_data("slake", "imgs").glob("xmlab*/source.jpg"))[:4]
    assert vqa_rad and slake, "expected images in ../shared/data"
    for path in vqa_rad + slake:
        scan = load_scan(path)
        assert scan.pixels.ndim == 3 and scan.pixels.shape[2] == 3 and scan.pixels.dtype == np.uint8
        assert scan.pixels.std() > 5, path.name
        assert scan.source_format == "jpeg" and scan.frame_count == 1


def test_a_16_bit_white_is_zero_tiff_shows_its_highest_value_black():
    """TIFF 6.0 PhotometricInterpretation 0 (WhiteIsZero): Pillow inverts an 8-bit page itself but not a
    16-bit one, which the app inverts (after the window, as for a DICOM's MONOCHROME1)."""
    gray = np.tile((np.arange(90) * 700).astype(np.uint16), (60, 1))
    gray[:15, :15] = 65535
    white_is_zero = load_scan(encode(Image.fromarray(gray), "TIFF", tiffinfo={262: 0})).pixels
    black_is_zero = load_scan(encode(Image.fromarray(gray), "TIFF")).pixels
    assert white_is_zero[0, 0, 0] == 0 and black_is_zero[0, 0, 0] == 255
    np.testing.assert_array_equal(white_is_zero, 255 - black_is_zero)


def test_a_png_with_an_exif_orientation_is_turned_as_a_jpeg_is():
    """A browser honours a PNG's eXIf orientation (a photographed film saved as PNG), as the app does a JPEG's."""
    rgb = np.zeros((60, 90, 3), np.uint8)
    rgb[:15, :15] = 255
    image = Image.fromarray(rgb)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to view
    for fmt in ("JPEG", "PNG"):
        shown = load_scan(encode(image, fmt, exif=exif.tobytes())).pixels
        assert shown.shape == (90, 60, 3), fmt
        assert shown[:15, -15:].mean() > 200 and shown[:15, :15].mean() < 50, fmt  # the white corner turned right
