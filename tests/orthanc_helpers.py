"""A real PACS for the tests: Debian's Orthanc with its DICOMweb plugin (`pytest -m pacs`).

`orthanc` starts /usr/sbin/Orthanc on a free loopback port with a temporary storage folder and a
generated configuration (DICOM networking off, HTTP basic login on), loads the synthetic CT series
of tests/imaging_helpers.py (planted patient data, stored in shuffled order) through its REST API,
two more studies that share another accession number (as studies from two issuers may) and a study
of three series (`multi_series`: 6 slices, a 10-frame image, 20 slices, stored in this order), and
stops it after the module. scripts/install.sh --dev installs `orthanc` and `orthanc-dicomweb`;
without the binary the tests skip and say so.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pydicom
import pytest

from .conftest import stop_process
from .imaging_helpers import PLANTED, ct_series, dicom_bytes, make_dicom, slice_hu

ORTHANC = Path("/usr/sbin/Orthanc")
DICOMWEB_PLUGIN = Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so")  # from `dpkg -L orthanc-dicomweb`
USER, PASSWORD = "pacs-reader", "pacs-test-password"
SLICES = 40
SHARED_ACCESSION = "SHAREDACC7"  # the accession number of two other studies
MULTI_ACCESSION = "MULTIACC3"  # the study of three series


@dataclass
class RunningOrthanc:
    url: str  # REST root
    dicomweb: str  # DICOMweb root (QIDO-RS, WADO-RS)
    study_uid: str
    accession: str
    shared_study_uids: list[str]  # the two studies with SHARED_ACCESSION
    multi_series: list[bytes]  # the files of the study with MULTI_ACCESSION, as an upload of it would hold them
    two_patient_uid: str  # one Study Instance UID stored under two patients (an archive data error)
    storage: Path
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    import httpx

    if not ORTHANC.is_file() or not DICOMWEB_PLUGIN.is_file():
        pytest.skip(f"{ORTHANC} or its DICOMweb plugin is not installed (scripts/install.sh --dev installs "
                    "Debian's orthanc and orthanc-dicomweb)")
    root = tmp_path_factory.mktemp("orthanc")
    port = _free_port()
    config = {
        "Name": "MedVQA test PACS", "StorageDirectory": str(root / "storage"), "IndexDirectory": str(root / "storage"),
        "HttpPort": port, "RemoteAccessAllowed": False, "DicomServerEnabled": False,
        "AuthenticationEnabled": True, "RegisteredUsers": {USER: PASSWORD},
        "Plugins": [str(DICOMWEB_PLUGIN)], "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
    }
    (root / "orthanc.json").write_text(json.dumps(config))
    log = root / "orthanc.log"
    with open(log, "wb") as output:
        process = subprocess.Popen([str(ORTHANC), str(root / "orthanc.json")], stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    auth = (USER, PASSWORD)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{url}/system", auth=auth, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.time() > deadline:
                pytest.fail(f"Orthanc did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

        def store(files: list[bytes]) -> str:
            for data in files:
                response = httpx.post(f"{url}/instances", content=data, auth=auth, timeout=30)
                assert response.status_code == 200, response.text
            return response.json()["ParentStudy"]

        def study_uid(study: str) -> str:
            return httpx.get(f"{url}/studies/{study}", auth=auth).json()["MainDicomTags"]["StudyInstanceUID"]

        planted = store(ct_series(SLICES))  # shuffled: stored in an order other than the slices'
        shared = [store(ct_series(count, AccessionNumber=SHARED_ACCESSION, PatientID=f"OTHER-{count}"))
                  for count in (5, 7)]
        multi_uid = pydicom.uid.generate_uid()
        multi_frame = make_dicom(np.stack([slice_hu(i) + 1024 for i in range(10)]), StudyInstanceUID=multi_uid,
                                 SeriesInstanceUID=pydicom.uid.generate_uid(),
                                 **{**PLANTED, "AccessionNumber": MULTI_ACCESSION})
        multi_series = [*ct_series(6, study_uid=multi_uid, AccessionNumber=MULTI_ACCESSION), dicom_bytes(multi_frame),
                        *ct_series(20, study_uid=multi_uid, AccessionNumber=MULTI_ACCESSION)]
        for data in multi_series:  # one at a time, in this order: the archive's order of the series
            store([data])
        two_patient_uid = pydicom.uid.generate_uid()
        for patient, count in (("TWO-PATIENT-A", 3), ("TWO-PATIENT-B", 4)):
            store(ct_series(count, study_uid=two_patient_uid, PatientID=patient, AccessionNumber="TWOPAT1"))
        yield RunningOrthanc(url, f"{url}/dicom-web", study_uid(planted), PLANTED["AccessionNumber"],
                             [study_uid(study) for study in shared], multi_series, two_patient_uid,
                             root / "storage", log)
    finally:
        stop_process(process)
