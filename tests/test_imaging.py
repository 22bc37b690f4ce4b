"""medvqa.imaging: uploads rendered as a DICOM viewer would, patient data never let through."""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import struct
import subprocess
import sys
import time
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pydicom
import pytest
from PIL import Image, PngImagePlugin, TiffImagePlugin
from pydicom.data import get_testdata_file
from pydicom.data.data_manager import DATA_ROOT, get_url_map
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian

from medvqa.imaging import (
    WINDOW_PRESETS,
    Scan,
    ScanError,
    ScanLimits,
    ScanSource,
    Window,
    cli_scan,
    load_scan,
    open_scan,
    parse_window,
)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"


def require_data(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: real-image tests need ../shared/data")
    return path


# ── Synthetic DICOM ──────────────────────────────────────────────────────────────────────────

def make_dicom(stored: np.ndarray, *, photometric: str = "MONOCHROME2", bits_stored: int = 12,
               signed: bool = False, **attributes) -> Dataset:
    """A CT dataset holding `stored` ((H, W) or (frames, H, W)) as 16-bit pixels."""
    ds = Dataset()
    ds.SOPClassUID = CT_IMAGE_STORAGE
    ds.SOPInstanceUID = pydicom.uid.generate_uid()
    ds.Modality = "CT"
    ds.Rows, ds.Columns = stored.shape[-2:]
    if stored.ndim == 3:
        ds.NumberOfFrames = stored.shape[0]
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, bits_stored, bits_stored - 1
    ds.PixelRepresentation = int(signed)
    ds.PixelData = stored.astype("<i2" if signed else "<u2").tobytes()
    for keyword, value in attributes.items():
        setattr(ds, keyword, value)
    return ds


def dicom_bytes(ds: Dataset, transfer_syntax: str = ExplicitVRLittleEndian) -> bytes:
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = transfer_syntax
    ds.file_meta.MediaStorageSOPClassUID = ds.get("SOPClassUID", CT_IMAGE_STORAGE)
    ds.file_meta.MediaStorageSOPInstanceUID = ds.get("SOPInstanceUID", pydicom.uid.generate_uid())
    buffer = io.BytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    return buffer.getvalue()


def linear_window(values: np.ndarray, center: float, width: float) -> np.ndarray:
    """PS3.3 C.11.2.1.2.1, written out independently of pydicom."""
    gray = ((values - (center - 0.5)) / (width - 1) + 0.5) * 255
    return np.clip(np.rint(gray), 0, 255).astype(np.uint8)


HU = np.array([[-1024, -1000, -600, -100],
               [0, 40, 80, 150],
               [400, 1000, 1300, 3000]])


def ct_from_hu(hu: np.ndarray = HU, **attributes) -> bytes:
    # Stored values are HU + 1024, as a scanner with intercept -1024 writes them.
    return dicom_bytes(make_dicom(hu + 1024, RescaleSlope=1, RescaleIntercept=-1024, RescaleType="HU",
                                  **attributes))


# ── Windowing ────────────────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("preset", sorted(WINDOW_PRESETS))
def test_ct_hu_values_give_known_gray_levels_under_each_preset(preset):
    window = WINDOW_PRESETS[preset]
    scan = load_scan(ct_from_hu(), window=preset)
    assert scan.pixels.shape == (3, 4, 3) and scan.pixels.dtype == np.uint8
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


def test_parse_window():
    assert parse_window("lung") == WINDOW_PRESETS["lung"]
    assert parse_window("Soft tissue") == WINDOW_PRESETS["soft_tissue"]
    assert parse_window("40,400") == Window(40, 400, "user")
    assert parse_window("file") == "file" and parse_window("auto") == "auto"
    for bad in ("liver", "40", "a,b", "40,0"):
        with pytest.raises(ScanError):
            parse_window(bad)


# ── PNG / JPEG / TIFF ────────────────────────────────────────────────────────────────────────

def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


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

    rgba = np.dstack([rgb, np.full((8, 8), 255, np.uint8)])
    rgba[:4, :, 3] = 0  # transparent half is shown black, as on a viewer's background
    pixels = load_scan(encode(Image.fromarray(rgba), "PNG")).pixels
    assert (pixels[:4] == 0).all() and (pixels[4:] == rgb[4:]).all()

    palette = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE)
    np.testing.assert_array_equal(load_scan(encode(palette, "PNG")).pixels, rgb)

    jpeg = load_scan(encode(Image.fromarray(rgb), "JPEG", quality=95))
    assert jpeg.source_format == "jpeg" and np.abs(jpeg.pixels.astype(int) - rgb).max() <= 3

    pages = [Image.fromarray(np.full((4, 4), 1000 * (k + 1), np.uint16)) for k in range(3)]
    buffer = io.BytesIO()
    pages[0].save(buffer, "TIFF", save_all=True, append_images=pages[1:])
    source = open_scan(buffer.getvalue())
    assert source.source_format == "tiff" and source.frame_count == 3
    assert source.render(window=Window(2000, 1000, "user"), frame=2).pixels.min() == 255


def test_format_is_chosen_by_content_not_name(tmp_path):
    path = tmp_path / "scan.dcm"
    path.write_bytes(encode(Image.new("L", (4, 4), 7), "PNG"))
    assert load_scan(path).source_format == "png"


def test_real_vqa_rad_and_slake_images():
    vqa_rad = sorted(require_data("vqa_rad", "images").glob("synpic*.jpg"))[:4]
    slake = sorted(require_data("slake", "imgs").glob("xmlab*/source.jpg"))[:4]
    assert vqa_rad and slake, "expected images in ../shared/data"
    for path in vqa_rad + slake:
        scan = load_scan(path)
        assert scan.pixels.ndim == 3 and scan.pixels.shape[2] == 3 and scan.pixels.dtype == np.uint8
        assert scan.pixels.std() > 5, path.name
        assert scan.source_format == "jpeg" and scan.frame_count == 1


# ── Every bundled pydicom test file ──────────────────────────────────────────────────────────

def _bundled_names() -> list[str]:
    local = {p.name for p in (Path(DATA_ROOT) / "test_files").rglob("*") if p.is_file() and p.suffix != ".py"}
    return sorted(local | set(get_url_map()))


@pytest.mark.parametrize("name", _bundled_names())
def test_pydicom_test_file_decodes_or_raises_scan_error(name):
    path = get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"{name} is downloaded on demand and not present offline")
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


# ── Patient data ─────────────────────────────────────────────────────────────────────────────

# Every value carries a marker: a scan, log line, warning or message holding one has leaked.
MARKERS = ("ZQSECRET", "19230405", "424242", "112233", "077Y")
PLANTED = {
    "PatientName": "ZQSECRET^PATIENT", "PatientID": "ZQSECRET-PID", "PatientBirthDate": "19230405",
    "PatientBirthTime": "112233", "PatientAge": "077Y", "PatientAddress": "ZQSECRET road",
    "PatientTelephoneNumbers": "ZQSECRET-555", "OtherPatientIDs": "ZQSECRET-OTHER",
    "PatientMotherBirthName": "ZQSECRET^MOTHER", "MilitaryRank": "ZQSECRET rank",
    "AccessionNumber": "ZQSECRET-ACC", "StudyID": "ZQSECRET", "InstitutionName": "ZQSECRET Hospital",
    "InstitutionAddress": "ZQSECRET 1 Main St", "InstitutionalDepartmentName": "ZQSECRET radiology",
    "ReferringPhysicianName": "ZQSECRET^REFERRER", "PerformingPhysicianName": "ZQSECRET^PERFORMER",
    "NameOfPhysiciansReadingStudy": "ZQSECRET^READER", "OperatorsName": "ZQSECRET^OPERATOR",
    "RequestingPhysician": "ZQSECRET^REQUESTER", "StationName": "ZQSECRET-ST",
    "DeviceSerialNumber": "ZQSECRET-SN", "StudyDescription": "ZQSECRET study of Mr Doe",
    "SeriesDescription": "ZQSECRET series", "ProtocolName": "ZQSECRET protocol",
    "ImageComments": "ZQSECRET comment", "AdditionalPatientHistory": "ZQSECRET history",
    "Manufacturer": "ZQSECRET maker", "StudyDate": "19230405", "SeriesDate": "19230405",
    "AcquisitionDate": "19230405", "ContentDate": "19230405", "StudyTime": "112233",
    "SeriesTime": "112233", "AcquisitionDateTime": "19230405112233",
    "StudyInstanceUID": "1.2.826.0.1.3680043.10.424242.1",
    "SeriesInstanceUID": "1.2.826.0.1.3680043.10.424242.2",
    "FrameOfReferenceUID": "1.2.826.0.1.3680043.10.424242.4",
    "WindowCenterWidthExplanation": "ZQSECRET window",
}


def planted_dicom(*, malformed: bool = False) -> bytes:
    ds = make_dicom(HU + 1024, RescaleSlope=1, RescaleIntercept=-1024, WindowCenter=40, WindowWidth=400,
                    BodyPartExamined="CHEST", **PLANTED)
    ds.SOPInstanceUID = "1.2.826.0.1.3680043.10.424242.3"
    block = ds.private_block(0x0009, "ZQSECRET CREATOR", create=True)
    block.add_new(0x01, "LO", "ZQSECRET private value")
    referenced = Dataset()
    referenced.ReferencedSOPInstanceUID = "1.2.826.0.1.3680043.10.424242.9"
    ds.ReferencedStudySequence = [referenced]
    # Enhanced-image functional groups: rescale is read from them, the dates next to it are not.
    shared, transform, content = Dataset(), Dataset(), Dataset()
    transform.RescaleSlope, transform.RescaleIntercept = 1, -1024
    content.FrameAcquisitionDateTime = "19230405112233"
    content.FrameComments = "ZQSECRET frame comment"
    shared.PixelValueTransformationSequence, shared.FrameContentSequence = [transform], [content]
    ds.SharedFunctionalGroupsSequence = [shared]
    if malformed:  # invalid values make pydicom's validation quote them in warnings, if ever read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.add_new("PatientBirthDate", "DA", "ZQSECRET-DATE")
            ds.add_new("PatientAge", "AS", "ZQSECRET AGE 077Y")
            ds.add_new("StudyTime", "TM", "ZQSECRET 112233")
    return dicom_bytes(ds)


def assert_no_marker(text: str | bytes, where: str) -> None:
    for marker in MARKERS:
        needle = marker.encode() if isinstance(text, bytes) else marker
        assert needle not in text, f"{marker!r} leaked into {where}"


@pytest.mark.parametrize("malformed", [False, True])
def test_patient_data_never_leaves_the_module(tmp_path, caplog, capsys, malformed):
    data = planted_dicom(malformed=malformed)
    path = tmp_path / "ZQSECRET_PATIENT_19230405.dcm"  # names of uploads carry patient data too
    path.write_bytes(data)
    truncated = [data[: len(data) * k // 10] for k in range(1, 10)]
    caplog.clear()  # building the file above logged its own validation warnings
    caplog.set_level(logging.DEBUG)  # root: every library logger propagates here
    caplog.set_level(logging.DEBUG, logger="pydicom")
    pydicom.config.debug(True, default_handler=False)  # pydicom then logs every element it reads
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            source_from_path, source_from_bytes = open_scan(path), open_scan(data)
            scans = [source_from_path.render(), source_from_bytes.render(window="lung"), load_scan(data)]
            exit_code = cli_scan(str(path))
            messages = []
            for damaged in truncated + [b"\x00" * 128 + b"DICM" + data[132:200]]:
                try:
                    open_scan(damaged).render()
                except ScanError as error:
                    messages.append(str(error))
                    assert error.__cause__ is None and error.__context__ is None
            missing = tmp_path / "ZQSECRET_missing.dcm"
            with pytest.raises(ScanError) as missing_error:
                open_scan(missing)
            messages.append(str(missing_error.value))
    finally:
        pydicom.config.debug(False, default_handler=False)
    printed = capsys.readouterr()

    assert exit_code == 0 and len(messages) >= 5
    scan = scans[0]
    assert scan.safe_meta["Modality"] == "CT" and scan.safe_meta["BodyPartExamined"] == "CHEST"
    assert "StudyDescription" not in scan.safe_meta and "Manufacturer" not in scan.safe_meta
    for scan in scans:
        assert_no_marker(repr(scan), "the Scan")
        assert_no_marker(" ".join(f"{k}={v}" for k, v in scan.safe_meta.items()), "safe_meta")
        assert_no_marker(scan.describe_window(), "the window description")
        assert_no_marker(pickle.dumps(scan), "the pickled Scan")
    for source in (source_from_path, source_from_bytes):
        assert_no_marker(repr(source), "the ScanSource")
        assert_no_marker(pickle.dumps(source), "the ScanSource held in memory")
    assert_no_marker(caplog.text, "the log")
    assert all(record.levelno >= logging.DEBUG for record in caplog.records)
    assert_no_marker(" ".join(str(w.message) for w in caught), "warnings")
    assert_no_marker(printed.out + printed.err, "printed output")
    assert_no_marker(" ".join(messages), "ScanError messages")


def test_picture_metadata_is_dropped_and_never_logged():
    """TIFF tags, PNG text chunks and JPEG comments can carry names. The files are read in a fresh
    interpreter with debug logging on, so the very first upload is covered too (Pillow's TIFF
    plugin logs tag values, and its logger only exists once the plugin is imported)."""
    image = Image.new("L", (8, 8), 100)
    tags = TiffImagePlugin.ImageFileDirectory_v2()
    tags[270] = tags[315] = "ZQSECRET^PATIENT 19230405"  # ImageDescription, Artist
    text = PngImagePlugin.PngInfo()
    text.add_text("Author", "ZQSECRET^PATIENT 19230405")
    uploads = [encode(image, "TIFF", tiffinfo=tags), encode(image, "PNG", pnginfo=text),
               encode(image, "JPEG", comment=b"ZQSECRET^PATIENT 19230405")]
    code = ("import logging, pickle, sys\n"
            "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
            "from medvqa.imaging import load_scan\n"
            "for data in pickle.loads(sys.stdin.buffer.read()):\n"
            "    scan = load_scan(data)\n"
            "    print(repr(scan), scan.describe_window())\n")
    result = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(uploads), capture_output=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    output = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, output[-500:]
    assert output.count("Scan(") == 3 and "DEBUG" in output
    assert_no_marker(output, "the output of a fresh interpreter")


def test_private_and_free_text_attributes_are_not_in_safe_meta():
    scan = load_scan(planted_dicom())
    allowed = {"Modality", "BodyPartExamined", "PhotometricInterpretation", "Rows", "Columns", "SamplesPerPixel",
               "BitsAllocated", "BitsStored", "PixelRepresentation", "RescaleSlope", "RescaleIntercept",
               "WindowCenter", "WindowWidth", "SOPClass", "TransferSyntax"}
    assert set(scan.safe_meta) <= allowed
    assert scan.safe_meta["SOPClass"] == "CT Image Storage"


# ── Bad input: each a ScanError, quickly ─────────────────────────────────────────────────────

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


def deflate_bomb_dicom() -> bytes:
    ds = make_dicom(np.zeros((2000, 2000)))  # 8 MB of zeros deflates to a few kB
    return dicom_bytes(ds, transfer_syntax=DeflatedExplicitVRLittleEndian)


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
    "dicom without pixel data": (dicom_without_pixels, "holds no image"),
    "structured report": (lambda: dicom_without_pixels("1.2.840.10008.5.1.4.1.1.88.33"),
                          "This DICOM file is a Structured Report and holds no image"),
    "dicom without preamble": (lambda: ct_from_hu()[132:], "without the standard file header"),
    "png bomb (header)": (lambda: png_claiming(100_000, 100_000), "too large"),
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


def test_deflated_dicom_that_expands_past_the_limit():
    data = deflate_bomb_dicom()
    assert len(data) < 100_000
    with pytest.raises(ScanError, match="expands to more than"):
        load_scan(data, limits=ScanLimits(max_bytes=1_000_000))
    assert load_scan(data).pixels.shape == (2000, 2000, 3)  # within the default limit it opens


def test_limits_are_checked_before_decoding():
    png = encode(Image.new("L", (100, 100)), "PNG")
    with pytest.raises(ScanError, match="larger than"):
        load_scan(png, limits=ScanLimits(max_bytes=10))
    with pytest.raises(ScanError, match="too large"):
        load_scan(png, limits=ScanLimits(max_frame_pixels=5000))
    with pytest.raises(ScanError, match="too large"):
        load_scan(ct_from_hu(), limits=ScanLimits(max_decoded_bytes=10))


@pytest.mark.parametrize("tenths", range(1, 10))
def test_real_dicom_truncated_at_every_tenth(tenths):
    data = Path(get_testdata_file("MR_small.dcm")).read_bytes()
    with pytest.raises(ScanError):
        load_scan(data[: len(data) * tenths // 10])


def test_unreadable_paths(tmp_path):
    with pytest.raises(ScanError, match="could not be opened") as error:
        open_scan(tmp_path / "no_such_patient.dcm")
    assert "no_such_patient" not in str(error.value)
    with pytest.raises(ScanError, match="could not be opened"):
        open_scan(tmp_path)


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


# ── Command line ─────────────────────────────────────────────────────────────────────────────

def test_cli_scan_prints_safe_meta_window_and_frames(tmp_path, capsys):
    path = tmp_path / "ct.dcm"
    path.write_bytes(ct_from_hu(WindowCenter=40, WindowWidth=400))
    assert cli_scan(str(path)) == 0
    out = capsys.readouterr().out
    assert "Modality: CT" in out and "window: the file's own window (C 40 / W 400)" in out
    assert "frames: 1 (showing frame 0)" in out

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
    assert "Format: PNG" in result.stdout and "frames: 1" in result.stdout


def test_scan_type():
    scan = load_scan(encode(Image.new("RGB", (3, 2)), "PNG"))
    assert isinstance(scan, Scan) and scan.pixels.shape == (2, 3, 3)
