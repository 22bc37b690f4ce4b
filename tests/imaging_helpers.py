"""Builders shared by the tests of medvqa.imaging: synthetic DICOM and pictures, and a window
computed independently of pydicom to check rendered grey levels against."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian

from .conftest import SHARED_DATA

CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"


def require_data(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: real-image tests need ../shared/data")
    return path


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


# Twelve known HU values, tiled to 9 × 8 pixels (each value six times: the histogram, and so any
# automatic window, is the 3 × 4 block's) since an image under MIN_SIDE (8) pixels a side is refused.
HU = np.tile([[-1024, -1000, -600, -100],
              [0, 40, 80, 150],
              [400, 1000, 1300, 3000]], (3, 2))


def ct_from_hu(hu: np.ndarray = HU, **attributes) -> bytes:
    # Stored values are HU + 1024, as a scanner with intercept -1024 writes them.
    return dicom_bytes(make_dicom(hu + 1024, RescaleSlope=1, RescaleIntercept=-1024, RescaleType="HU",
                                  **attributes))


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


# Patient data planted in the synthetic series: no test may find any of it past the imaging package.
PLANTED = {"PatientName": "Plantedsurname^Plantedgiven", "PatientID": "PLANTED-ID-7731",
           "PatientBirthDate": "19410203", "AccessionNumber": "ACCPLANT5512",
           "InstitutionName": "Planted Memorial Hospital", "ReferringPhysicianName": "Planteddoctor^Referrer",
           "StudyDescription": "PLANTEDSTUDYDESC", "SeriesDescription": "PLANTEDSERIESDESC"}


def slice_hu(index: int, size: int = 64) -> np.ndarray:
    """Slice `index` of the synthetic CT: air around a disc of soft tissue whose value tells the slice
    (index × 10 HU above 0), so a test can read back which slice it was shown."""
    y, x = np.mgrid[:size, :size]
    disc = (x - size / 2) ** 2 + (y - size / 2) ** 2 < (size / 3) ** 2
    hu = np.where(disc, index * 10, -1000)
    hu[0, 0] = 1000  # one bright pixel: the same automatic window on every slice
    return hu


def ct_series(count: int = 40, *, spacing: float = 2.5, first: float = -50.0, shuffle_seed: int | None = 0,
              orientation=(1, 0, 0, 0, 1, 0), series_uid: str | None = None, study_uid: str | None = None,
              placed: bool = True, **attributes) -> list[bytes]:
    """`count` single-frame CT slices of one series with PLANTED patient data, as file bytes, in a
    shuffled order (`shuffle_seed` None: in position order). Slice i lies at `first` + i × `spacing` mm
    along the normal and has InstanceNumber i + 1 (`placed` False: no position or orientation). Each
    call makes a new study unless `study_uid` is given."""
    study_uid, series_uid = study_uid or pydicom.uid.generate_uid(), series_uid or pydicom.uid.generate_uid()
    normal = np.cross(orientation[:3], orientation[3:])
    files = []
    for i in range(count):
        position = normal * (first + i * spacing)
        where = {"ImageOrientationPatient": [float(v) for v in orientation],
                 "ImagePositionPatient": [float(v) for v in position]} if placed else {}
        ds = make_dicom(slice_hu(i) + 1024, RescaleSlope=1, RescaleIntercept=-1024, RescaleType="HU",
                        StudyInstanceUID=study_uid, SeriesInstanceUID=series_uid, InstanceNumber=i + 1,
                        BodyPartExamined="CHEST", **where, **{**PLANTED, **attributes})
        files.append(dicom_bytes(ds))
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(count)
        files = [files[i] for i in order]
    return files


def zip_bytes(files: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()
