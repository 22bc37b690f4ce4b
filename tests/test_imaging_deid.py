"""medvqa.imaging.deid and guard: patient data never passes the package, whether in a scan, its
metadata, a log line, a warning, printed output or an error message."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import warnings

import pydicom
import pytest
from PIL import Image, PngImagePlugin, TiffImagePlugin
from pydicom.dataset import Dataset

from medvqa.imaging import ScanError, cli_scan, load_scan, open_scan

from .conftest import REPO
from .imaging_helpers import HU, dicom_bytes, encode, make_dicom


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


PLANTED_CODES = {  # free text in coded attributes: the code-string form (A-Z, 0-9, space, _) lets it through
    "BodyPartExamined": "ZZPHI_BODYPART", "PatientPosition": "ZZPHI", "ViewPosition": "ZZPHI DOE",
    "Laterality": "Z", "ImageLaterality": "ZZ", "RescaleType": "ZZPHI", "MRAcquisitionType": "ZZPHI",
    "ScanningSequence": ["SE", "ZZPHI"], "SequenceVariant": "ZZPHI_SMITH", "BurnedInAnnotation": "ZZPHI",
    "LossyImageCompression": "ZZ",
}


def test_coded_attributes_keep_only_their_defined_terms(tmp_path, capsys):
    """A coded attribute shows only the standard's defined terms for it; anything else (a name typed
    into BodyPartExamined, a site's own ImageType value) is dropped, in the scan, the metadata panel
    and the CLI."""
    ds = make_dicom(HU + 1024, RescaleSlope=1, RescaleIntercept=-1024, ImageType=["ORIGINAL", "ZZPHI_NAME"],
                    **PLANTED_CODES)
    ds.Modality = "ZZPHI"
    meta = load_scan(dicom_bytes(ds)).safe_meta
    assert "ZZPHI" not in " ".join(f"{k}={v}" for k, v in meta.items()), meta
    assert not set(PLANTED_CODES) & set(meta) and "Modality" not in meta
    assert meta["ImageType"] == "ORIGINAL"  # value 2 is not PRIMARY/SECONDARY: nothing after value 1

    ds = make_dicom(HU + 1024, ImageType=["DERIVED", "SECONDARY", "AXIAL", "ZZPHI_NAME", "LOCALIZER"],
                    BodyPartExamined="CHEST", PatientPosition="HFS", ViewPosition="PA", Laterality="R",
                    ScanningSequence=["SE", "IR"], BurnedInAnnotation="NO", LossyImageCompression="00")
    path = tmp_path / "scan.dcm"
    path.write_bytes(dicom_bytes(ds))
    meta = load_scan(path).safe_meta
    assert meta["ImageType"] == "DERIVED\\SECONDARY\\AXIAL"  # up to the first unknown value
    assert {k: meta[k] for k in ("Modality", "BodyPartExamined", "PatientPosition", "ViewPosition", "Laterality",
                                 "ScanningSequence", "BurnedInAnnotation", "LossyImageCompression")} == {
        "Modality": "CT", "BodyPartExamined": "CHEST", "PatientPosition": "HFS", "ViewPosition": "PA",
        "Laterality": "R", "ScanningSequence": "SE\\IR", "BurnedInAnnotation": "NO", "LossyImageCompression": "00"}

    planted = tmp_path / "planted.dcm"
    ds = make_dicom(HU + 1024, ImageType=["ZZPHI_NAME", "PRIMARY"], **PLANTED_CODES)
    planted.write_bytes(dicom_bytes(ds))
    assert cli_scan(str(planted)) == 0
    printed = capsys.readouterr().out
    assert "ZZPHI" not in printed and "ImageType" not in printed and "Modality: CT" in printed


def test_the_defined_terms_are_code_strings():
    from medvqa.imaging.defined_terms import DEFINED_TERMS, IMAGE_TYPE_FURTHER
    from medvqa.imaging.deid import _CODE_STRING, _SAFE_CODED

    assert set(DEFINED_TERMS) | {"ImageType"} == set(_SAFE_CODED)
    for terms in (*DEFINED_TERMS.values(), IMAGE_TYPE_FURTHER):
        assert all(_CODE_STRING.fullmatch(term) for term in terms)
    assert {"ABDOMEN", "CHEST", "HEAD", "BRAIN", "SKULL", "KNEE"} <= DEFINED_TERMS["BodyPartExamined"]
    assert {"CT", "MR", "CR", "DX", "US", "MG", "NM", "PT", "XA", "OT"} <= DEFINED_TERMS["Modality"]
