"""Opening a study from a PACS over DICOMweb: QIDO-RS to find its series, WADO-RS to fetch one.

    Pacs(url).find_series(identifier) ─▶ [RemoteSeries(number, modality, slices)]   (allow-listed fields)
    Pacs(url).fetch(series, progress)  ─▶ Study (medvqa.imaging: the same allow-list as an upload)

The identifier a clinician types (a Study Instance UID or an accession number) is used for the query
only: it is never logged, shown back, kept or exported. dicomweb-client logs request URLs (which hold
it) and pydicom may quote values while parsing, so their log records are dropped while a query or a
fetch runs (imaging's guard). The UIDs needed to fetch a series stay inside `RemoteSeries` in server
memory and are never shown; what is shown is the modality and the slice count. Each fetched instance
is serialised back to Part 10 bytes and opened by medvqa.imaging like an uploaded file; the parsed
dataset is dropped at once. Nothing is written to disk.

Credentials come from the environment: MEDVQA_PACS_USERNAME and MEDVQA_PACS_PASSWORD (HTTP basic),
or MEDVQA_PACS_TOKEN (a bearer token).
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from typing import Callable

from .imaging import ScanError, ScanLimits, Study, open_study
from .imaging.defined_terms import MODALITY
from .imaging.guard import _quiet_libraries

ENV_USERNAME, ENV_PASSWORD, ENV_TOKEN = "MEDVQA_PACS_USERNAME", "MEDVQA_PACS_PASSWORD", "MEDVQA_PACS_TOKEN"
_UID = re.compile(r"[0-9]+(\.[0-9]+)+")
_MODALITY, _STUDY_UID, _SERIES_UID, _COUNT = "00080060", "0020000D", "0020000E", "00201209"
_ACCESSION = re.compile(r"[A-Za-z0-9 ._/-]{1,16}")  # DICOM SH: 16 characters


class PacsError(Exception):
    """A query or a fetch failed. The message is for a clinician and never quotes the identifier,
    a URL or the archive's own error text."""


@dataclass
class RemoteSeries:
    number: int  # 1, 2, ... in the order listed
    modality: str  # a defined term, else ""
    slices: int
    _uids: tuple[str, str] = field(repr=False, default=("", ""))  # (study, series): to fetch, never shown

    def describe(self) -> str:
        return f"Series {self.number}: {self.modality or 'unknown modality'}, {self.slices} " \
               f"slice{'s' if self.slices != 1 else ''}"


class Pacs:
    """A DICOMweb endpoint (e.g. Orthanc's http://host:8042/dicom-web)."""

    def __init__(self, url: str, env: dict[str, str] | None = None, timeout_s: float = 30):
        from dicomweb_client import DICOMwebClient
        from dicomweb_client.session_utils import create_session_from_auth
        from requests.auth import HTTPBasicAuth

        env = os.environ if env is None else env
        user, password, token = env.get(ENV_USERNAME, ""), env.get(ENV_PASSWORD, ""), env.get(ENV_TOKEN, "")
        if bool(user) != bool(password):
            raise ValueError(f"Set both {ENV_USERNAME} and {ENV_PASSWORD} for the PACS, or neither.")
        session = create_session_from_auth(HTTPBasicAuth(user, password)) if user else None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._client = DICOMwebClient(url.rstrip("/"), session=session, headers=headers, timeout=timeout_s)

    def find_series(self, identifier: str) -> list[RemoteSeries]:
        """The series of the study named by `identifier` (a Study Instance UID, or else an accession
        number). Raises PacsError when nothing is found or the archive cannot be reached."""
        identifier = (identifier or "").strip()
        if _UID.fullmatch(identifier) and len(identifier) <= 64:
            studies = [identifier]
        elif _ACCESSION.fullmatch(identifier):
            found = self._call(self._client.search_for_studies, search_filters={"AccessionNumber": identifier},
                               fields=["StudyInstanceUID"])
            studies = [uid for uid in (_value(study, _STUDY_UID) for study in found) if uid]
        else:
            raise PacsError("Please type a Study Instance UID (digits and dots) or an accession number "
                            "(up to 16 letters and digits).")
        listed = []
        for study in studies:
            for item in self._call(self._client.search_for_series, study_instance_uid=study,
                                   fields=["Modality", "NumberOfSeriesRelatedInstances"]):
                series_uid = _value(item, _SERIES_UID)
                if series_uid:
                    modality = str(_value(item, _MODALITY) or "")
                    count = _value(item, _COUNT)
                    listed.append(RemoteSeries(len(listed) + 1, modality if modality in MODALITY else "",
                                               int(count) if isinstance(count, (int, float)) else 0,
                                               (study, str(series_uid))))
        if not listed:
            raise PacsError("No study with that identifier was found in the PACS.")
        return listed

    def fetch(self, series: RemoteSeries, progress: Callable[[int, int], None] | None = None,
              limits: ScanLimits | None = None) -> Study:
        """Fetch the series' instances one at a time (`progress(done, total)` after each) and open them
        as a study, through the same allow-list as an upload."""
        limits = limits or ScanLimits()
        instances = self._call(self._client.iter_series, *series._uids)
        files: list[bytes] = []
        while True:
            dataset = self._call(next, instances, None)
            if dataset is None:
                break
            if len(files) >= limits.max_files:
                raise PacsError(f"This series has more than {limits.max_files:,} instances; at most that many "
                                "are opened at once.")
            files.append(self._call(_part10, dataset))
            del dataset  # the parsed instance, identifying tags and all, is dropped here
            if progress is not None:
                progress(len(files), max(series.slices, len(files)))
        if not files:
            raise PacsError("The PACS returned no instances for that series.")
        try:
            return open_study(files, limits)
        except ScanError as error:
            raise PacsError(f"The series could not be opened: {error}") from None

    def _call(self, function: Callable, *args, **kwargs):
        """One request (or one parsed instance) with library logs dropped; any failure becomes a
        PacsError of our own words (the library's text can hold the URL, and so the identifier)."""
        failure = None
        try:
            with _quiet_libraries():
                return function(*args, **kwargs)
        except PacsError:
            raise
        except Exception as error:  # noqa: BLE001 - requests, dicomweb-client and pydicom raise many kinds
            status = getattr(getattr(error, "response", None), "status_code", None)
            failure = ("The PACS refused the credentials (set MEDVQA_PACS_USERNAME and MEDVQA_PACS_PASSWORD, "
                       "or MEDVQA_PACS_TOKEN)." if status in (401, 403) else
                       "No study with that identifier was found in the PACS." if status == 404 else
                       "The PACS could not be reached or did not answer as a DICOMweb server does.")
        raise PacsError(failure)


def _value(item: dict, tag: str):
    """The first value of `tag` in a DICOM JSON object, or None."""
    values = (item.get(tag) or {}).get("Value") or []
    return values[0] if values else None


def _part10(dataset) -> bytes:
    """A fetched instance as the bytes of a DICOM file, for medvqa.imaging to open like an upload."""
    buffer = io.BytesIO()
    dataset.save_as(buffer, enforce_file_format=True)
    return buffer.getvalue()
