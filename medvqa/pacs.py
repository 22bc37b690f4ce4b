"""Opening a study from a PACS over DICOMweb: QIDO-RS to find its series, WADO-RS to fetch one.

    Pacs(url).find_series(identifier, cancel) ─▶ [RemoteSeries(number, modality, instances, frames)] (allow-listed)
    Pacs(url).fetch(series, progress, cancel)  ─▶ RemoteStudy (medvqa.imaging: the same allow-list as an upload)

The identifier a clinician types (a Study Instance UID or an accession number) is used for the query
only: it is never logged, shown back, kept or exported. urllib3 logs request URLs (which hold it), so
its log records are dropped while a query or a fetch runs (imaging.guard._quiet_logs, which takes no
lock: the network never waits on, or holds up, anyone's decoding). The UIDs needed to fetch a series
stay inside `RemoteSeries` in server memory and are never shown. Each instance arrives as the bytes
of a DICOM file and is opened by medvqa.imaging like an uploaded file. Nothing is written to disk.

A slow or hostile archive costs its own user time, no one else's, and a bounded amount of it:

- every request has a connect timeout, and each *Find* and each *Open* an overall deadline that
  covers all the requests it makes (`PacsLimits`); at the deadline the transfer is cut, a request
  waiting for its answer gives up, and the clinician reads what happened;
- one answer is read as it arrives and never past its limit: a QIDO answer is taken entry by entry up
  to `max_answer_entries` / `max_answer_bytes`, at most `max_series` distinct series are taken from a
  Find (of one study: at most 2 requests), and an instance or a series past the upload limits
  (ScanLimits.max_bytes, max_total_bytes, max_files) is refused while it arrives, not after it was
  read whole;
- a redirect is followed only to the archive's own origin (scheme, host and port), three at most;
- `cancel` (a threading.Event, set when the tab goes away) stops the transfer: no request starts
  after it is set, and the one in progress is cut;
- an Open that has received nothing for `stall_note_s` says so once (`stalled`), so that the
  clinician reads that the archive is not answering rather than watch the time count.

Why not dicomweb-client: it reads a QIDO answer whole, retries a timed-out request five times, parses
every instance with pydicom while it reads (so the parse would run outside the decode guard, or the
network inside it), and offers no hook for a deadline, a size cap or cancellation.

Credentials come from the environment: MEDVQA_PACS_USERNAME and MEDVQA_PACS_PASSWORD (HTTP basic),
or MEDVQA_PACS_TOKEN (a bearer token).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator
from urllib.parse import quote, urljoin, urlsplit

from .imaging import ScanError, ScanLimits, Study, open_study
from .imaging.defined_terms import MODALITY
from .imaging.dicom import patient_id_key
from .imaging.guard import _quiet_logs
from .pacs_stream import PacsError, multipart_bodies, multipart_boundary, read_whole, utf8_chunks

ENV_USERNAME, ENV_PASSWORD, ENV_TOKEN = "MEDVQA_PACS_USERNAME", "MEDVQA_PACS_PASSWORD", "MEDVQA_PACS_TOKEN"
_UID = re.compile(r"[0-9]+(\.[0-9]+)+")
_MODALITY, _STUDY_UID, _SERIES_UID, _COUNT, _FRAMES = "00080060", "0020000D", "0020000E", "00201209", "00280008"
_PATIENT_ID = "00100020"  # read only to tell two patients under one study apart, as keyed digests
_ACCESSION = re.compile(r"[A-Za-z0-9 ._/-]{1,16}")  # DICOM SH: 16 characters
_CHUNK = 64 * 1024
_MAX_REDIRECTS = 3


@dataclass(frozen=True)
class PacsLimits:
    """What one Find and one Open may cost. The sizes of instances and series are the upload's
    (ScanLimits), so a study from the PACS is held to what an uploaded one is."""

    connect_s: float = 5.0  # to open a connection to the archive
    find_s: float = 40.0  # one Find, all its queries together
    open_s: float = 300.0  # one Open: every instance of the series
    stall_note_s: float = 15.0  # an Open that has received nothing for this long says so (it goes on waiting)
    max_studies: int = 10  # distinct studies counted in an accession number's answer (more than one is refused)
    max_series: int = 200  # distinct series listed for one Find
    max_answer_entries: int = 5_000  # entries read from one QIDO answer (copies of one study included)
    max_answer_bytes: int = 4 * 2**20  # bytes read from one QIDO answer


@dataclass
class RemoteSeries:
    number: int  # 1, 2, ...: as an upload of the study numbers its series (the most slices first), kept once loaded
    modality: str  # a defined term, else ""
    instances: int  # its images (DICOM instances): what a Load fetches
    frames: int = 1  # frames of an image, where the archive reports NumberOfFrames (of one of them); else 1
    _uids: tuple[str, str] = field(repr=False, default=("", ""))  # (study, series): to fetch, never shown

    @property
    def slices(self) -> int:
        """What the viewer scrolls once the series is loaded: one multi-frame image's frames, else its images."""
        return self.frames if self.instances == 1 else self.instances

    def describe(self) -> str:
        if self.instances > 1 and self.frames > 1:  # they open as a series each, as uploaded ones do
            return f"Series {self.number}: {self.modality or 'unknown modality'}, {self.instances} multi-frame images"
        return f"Series {self.number}: {self.modality or 'unknown modality'}, {self.slices} " \
               f"slice{'s' if self.slices != 1 else ''}"


@dataclass
class RemoteStudy(Study):
    """A study from the PACS: the series loaded from it so far, each under the PACS list's number."""

    _uid: str = field(default="", repr=False)  # its Study Instance UID: to tell another study's series, never shown

    def is_study_of(self, other: RemoteStudy) -> bool:
        """Whether `other` was loaded from the same study (the UID is compared here and goes no further)."""
        return bool(self._uid) and self._uid == other._uid

    def names_other_patients(self, other: RemoteStudy) -> bool:
        """Whether `other` names a patient ID this study's files do not (compared as keyed digests): an
        archive that files two patients under one Study Instance UID."""
        return bool(self.patients and other.patients and other.patients - self.patients)

    def with_series(self, series: list, notes: list[str], patients: frozenset[bytes] | None = None) -> RemoteStudy:
        """The same study holding `series` (a list of its series) and `notes`, and the keys of the patients
        they name (`patients`; by default this study's)."""
        return RemoteStudy(series, notes, self.patients if patients is None else patients, _uid=self._uid)


class FoundSeries(list):
    """The series of a Find (a list of RemoteSeries); `capped` when the caps left some out."""

    capped = False


class Pacs:
    """A DICOMweb endpoint (e.g. Orthanc's http://host:8042/dicom-web). Shared by every session of the
    app: each Find or Open makes its own HTTP session, so none waits on another's."""

    def __init__(self, url: str, env: dict[str, str] | None = None, limits: PacsLimits | None = None):
        env = os.environ if env is None else env
        user, password, token = env.get(ENV_USERNAME, ""), env.get(ENV_PASSWORD, ""), env.get(ENV_TOKEN, "")
        if bool(user) != bool(password):
            raise ValueError(f"Set both {ENV_USERNAME} and {ENV_PASSWORD} for the PACS, or neither.")
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("The PACS URL must be an http:// or https:// address, e.g. http://pacs:8042/dicom-web.")
        self.url = url.strip().rstrip("/")
        self.limits = limits or PacsLimits()
        self._auth = (user, password) if user else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def find_series(self, identifier: str, cancel: threading.Event | None = None) -> FoundSeries:
        """The series of the study named by `identifier` (a Study Instance UID, or else an accession
        number). Raises PacsError when nothing is found, when an accession number names several studies
        or the study is filed under several patients (their series are never listed as one study's), when
        the archive cannot be reached, or when the Find runs past its deadline or is cancelled."""
        identifier = (identifier or "").strip()
        limits = self.limits
        if _UID.fullmatch(identifier) and len(identifier) <= 64:
            by_uid = True
        elif _ACCESSION.fullmatch(identifier):
            by_uid = False
        else:
            raise PacsError("Please type a Study Instance UID (digits and dots) or an accession number "
                            "(up to 16 letters and digits).")
        with _Transfer(self, limits.find_s, cancel, "search") as transfer:
            study, capped = self._one_study(transfer, identifier, by_uid)
            listed, seen = FoundSeries(), set()
            answer = transfer.json_entries(f"/studies/{quote(study)}/series",
                                           [("includefield", "Modality"),
                                            ("includefield", "NumberOfSeriesRelatedInstances"),
                                            ("includefield", "NumberOfFrames"),  # else a cine counts as 1
                                            ("limit", str(limits.max_answer_entries))]) if study else _Answer()
            for item in answer:
                series_uid = _value(item, _SERIES_UID)
                if not isinstance(series_uid, str) or not _UID.fullmatch(series_uid) or series_uid in seen:
                    continue
                if len(listed) == limits.max_series:
                    capped = True
                    break
                seen.add(series_uid)
                modality = str(_value(item, _MODALITY) or "")
                listed.append(RemoteSeries(len(listed) + 1, modality if modality in MODALITY else "",
                                           _count(_value(item, _COUNT), 0), max(1, _count(_value(item, _FRAMES), 1)),
                                           (study, series_uid)))
        if not listed:
            raise PacsError("No study with that identifier was found in the PACS.")
        # Listed and numbered as an upload of the study lists them (medvqa.imaging.series), so that a
        # series has one number whichever way the study was opened.
        listed.sort(key=lambda item: -item.slices)  # stable: else in the archive's order
        for number, item in enumerate(listed, start=1):
            item.number = number
        listed.capped = capped or answer.capped
        return listed

    def _one_study(self, transfer: _Transfer, identifier: str, by_uid: bool) -> tuple[str | None, bool]:
        """The Study Instance UID of the one study the identifier names (None when there is none), and
        whether the answer was left unread past its caps. A Study Instance UID is searched for too,
        not only taken as given: an empty answer is the archive's "no such study", while a 404 on its
        study search means the address is not a DICOMweb server's (see `_status_message`). Several
        studies with one accession number are refused: their series are never listed as one study's,
        since they may be different patients'."""
        limits = self.limits
        key = "StudyInstanceUID" if by_uid else "AccessionNumber"
        answer = transfer.json_entries("/studies", [(key, identifier), ("includefield", "StudyInstanceUID"),
                                                    ("includefield", "PatientID"),
                                                    ("limit", str(limits.max_answer_entries))])
        studies: list[str] = []
        patients: set[bytes] = set()  # keyed digests of the patient IDs the entries name, never the IDs
        for entry in answer:
            uid = _value(entry, _STUDY_UID)
            if not isinstance(uid, str) or not _UID.fullmatch(uid):
                continue
            if by_uid and uid != identifier:  # an archive that ignored the key: not the study asked for
                continue
            if (patient := patient_id_key(_value(entry, _PATIENT_ID))) is not None:
                patients.add(patient)
            if uid in studies:
                continue
            studies.append(uid)
            if len(studies) > limits.max_studies:
                break
        if len(studies) > 1:
            raise PacsError(_several_studies(len(studies), limits.max_studies))
        if len(patients) > 1:  # one study UID filed under several patients (an archive data error; Orthanc
            # keeps such a study once per patient): its series are never listed as one study's
            raise PacsError(f"The PACS files this study under {len(patients)} different patients (an archive data "
                            "error), so its series were not listed: they may be different patients'. Ask the "
                            "archive's administrator to correct the study.")
        return (studies[0] if studies else None), answer.capped

    def fetch(self, series: RemoteSeries, progress: Callable[[int, int], None] | None = None,
              limits: ScanLimits | None = None, cancel: threading.Event | None = None,
              stalled: Callable[[float], None] | None = None) -> RemoteStudy:
        """Fetch the series' instances as they arrive (`progress(done, total)` after each) and open them
        as a study of that one series, numbered as the PACS list numbers it, through the same allow-list
        as an upload. An instance past `limits.max_bytes`, or a series past `limits.max_total_bytes` or
        `limits.max_files`, is refused while it arrives. `stalled(seconds)` is called, from another
        thread, once nothing has arrived for `PacsLimits.stall_note_s` (again after data resumes and
        stalls anew)."""
        limits = limits or ScanLimits()
        study, series_uid = series._uids
        files: list[bytes] = []
        with _Transfer(self, self.limits.open_s, cancel, "download", stalled) as transfer:
            for part in transfer.dicom_parts(f"/studies/{quote(study)}/series/{quote(series_uid)}", limits):
                files.append(part)
                if progress is not None:
                    progress(len(files), max(series.instances, len(files)))
        if not files:
            raise PacsError("The PACS returned no instances for that series.")
        try:
            opened = open_study(files, limits)  # decoded under imaging's guard, after the network is done
        except ScanError as error:
            raise PacsError(f"The series could not be opened: {error}") from None
        # The viewer, the chat and the export name it by the PACS list's number. Multi-frame images open
        # as a series each (as uploaded ones do); they have no number of their own there, so one is shown.
        shown, *others = opened.series
        shown.number = series.number
        notes = opened.notes + ([f"This series of the PACS holds {len(opened.series)} multi-frame images; the "
                                 "longest is shown. To see the others, open their files."] if others else [])
        return RemoteStudy([shown], notes, opened.patients, _uid=study)


class _Answer(list):
    """The entries read from one QIDO answer, and whether more were left unread."""

    capped = False


class _Transfer:
    """One Find or one Open: its HTTP session, deadline and cancellation. A watchdog thread shuts the
    transfer's sockets at the deadline or on cancellation, so that a read blocked on a silent archive
    (waiting for an answer, or for the rest of one) ends at once."""

    def __init__(self, pacs: Pacs, budget_s: float, cancel: threading.Event | None, what: str,
                 stalled: Callable[[float], None] | None = None):
        import requests

        self.pacs = pacs
        self.what = what  # "search" | "download", for the messages
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.cancel = cancel or threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._done = threading.Event()
        self._stalled = stalled
        self._last_data = time.monotonic()  # when a request was sent or a piece of an answer arrived
        self._stall_said = False
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy or .netrc from the environment: the URL given is the archive
        for scheme in ("http://", "https://"):
            self.session.mount(scheme, _TrackingAdapter(self._opened))
        if pacs._auth:
            self.session.auth = pacs._auth
        self.session.headers.update(pacs._headers)
        self._origin = _origin(pacs.url)
        # In a copy of the caller's context: `stalled` may need it (Gradio finds a handler's progress bar there).
        self._watchdog = threading.Thread(target=contextvars.copy_context().run, args=(self._watch,), daemon=True,
                                          name="medvqa-pacs-watchdog")

    def __enter__(self) -> _Transfer:
        self._watchdog.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.session.close()

    # --- limits --------------------------------------------------------------------------

    def _opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self._cut:
                _shut(sock)

    def _watch(self) -> None:
        while not self._done.is_set():
            if self.cancel.is_set() or time.monotonic() >= self.deadline:
                with self._lock:
                    self._cut = True
                    for sock in self._sockets:
                        _shut(sock)
                return
            silent_s = time.monotonic() - self._last_data
            if self._stalled is not None and not self._stall_said and silent_s >= self.pacs.limits.stall_note_s:
                self._stall_said = True
                with contextlib.suppress(Exception):  # a note only: it must not end the watch over the deadline
                    self._stalled(silent_s)
            self.cancel.wait(min(0.2, max(0.0, self.deadline - time.monotonic())))

    def check(self) -> None:
        """Raise the right PacsError once the transfer was cancelled or its deadline has passed."""
        if self.cancel.is_set():
            raise PacsError(f"The PACS {self.what} was stopped.")
        if self._cut or time.monotonic() >= self.deadline:
            raise PacsError(f"The PACS did not finish the {self.what} within {self.budget_s:.0f} s; it may be "
                            "busy. Try again later, or ask its administrator.")

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    # --- requests ------------------------------------------------------------------------

    @contextlib.contextmanager
    def get(self, path: str, params: list | None, accept: str):
        """A GET to the archive (a redirect followed only within its origin), its body not yet read."""
        import requests

        url = self.pacs.url + path
        for _ in range(_MAX_REDIRECTS + 1):
            self.check()  # no request starts once the transfer is cancelled or out of time
            timeout = (max(0.01, min(self.pacs.limits.connect_s, self._left())), max(0.01, self._left()))
            try:
                with _quiet_logs():
                    response = self.session.get(url, params=params, headers={"Accept": accept}, stream=True,
                                                allow_redirects=False, timeout=timeout)
            except requests.RequestException:
                self.check()
                raise PacsError("The PACS could not be reached or did not answer as a DICOMweb server does.") \
                    from None
            if not response.is_redirect:
                break
            target = urljoin(url, response.headers.get("location", ""))
            response.close()
            if _origin(target) != self._origin:
                raise PacsError("The PACS redirected the request to another server; it was not followed.")
            url, params = target, None
        else:
            raise PacsError("The PACS redirected the request too many times.")
        try:
            if response.status_code >= 400:
                raise PacsError(_status_message(response.status_code, path))
            yield response
        finally:
            response.close()

    def _chunks(self, response) -> Iterator[bytes]:
        """The body as it arrives; a cut or broken connection becomes the right PacsError."""
        try:
            with _quiet_logs():
                for chunk in response.iter_content(_CHUNK):
                    self.check()
                    self._last_data, self._stall_said = time.monotonic(), False
                    yield chunk
        except PacsError:
            raise
        except Exception:  # noqa: BLE001 - requests/urllib3 raise many kinds for a cut or broken body
            self.check()
            raise PacsError("The PACS connection broke off during the transfer.") from None
        self.check()

    def json_entries(self, path: str, params: list) -> _Answer:
        """The objects of a QIDO-RS answer (a JSON array), decoded as they arrive: at most
        `max_answer_entries` of them from at most `max_answer_bytes`; `capped` when some were left."""
        limits = self.pacs.limits
        entries, bad = _Answer(), "The PACS answer was not a DICOMweb search result."
        with self.get(path, params, "application/dicom+json, application/json") as response:
            decoder, buffer, position, expecting, read = json.JSONDecoder(), "", 0, "[", 0
            for piece in utf8_chunks(self._chunks(response)):
                read += len(piece)
                buffer, position = buffer[position:] + piece, 0
                while True:
                    while position < len(buffer) and buffer[position].isspace():
                        position += 1
                    if position >= len(buffer):
                        break
                    character = buffer[position]
                    if expecting == "[":
                        if character != "[":
                            raise PacsError(bad)
                        position, expecting = position + 1, "first"
                    elif character == "]" and expecting in ("first", ","):
                        return entries
                    elif expecting == ",":
                        if character != ",":
                            raise PacsError(bad)
                        position, expecting = position + 1, "entry"
                    else:
                        try:
                            entry, position = decoder.raw_decode(buffer, position)
                        except json.JSONDecodeError:
                            break  # the entry has not all arrived yet
                        if not isinstance(entry, dict):
                            raise PacsError(bad)
                        entries.append(entry)
                        expecting = ","
                        if len(entries) >= limits.max_answer_entries:
                            entries.capped = True
                            return entries
                if read > limits.max_answer_bytes:
                    if not entries:
                        raise PacsError("The PACS answer was too large to read.")
                    entries.capped = True
                    return entries
            if expecting == "[":
                return entries  # an empty body (some archives answer "nothing found" so)
            raise PacsError("The PACS answer was cut short.")

    def dicom_parts(self, path: str, limits: ScanLimits) -> Iterator[bytes]:
        """The DICOM files of a WADO-RS answer (multipart/related; type="application/dicom"), each as
        it completes; an instance, or the series, past the limits is refused while it arrives."""
        with self.get(path, None, 'multipart/related; type="application/dicom"') as response:
            content_type = response.headers.get("content-type", "")
            boundary = multipart_boundary(content_type)
            chunks = self._chunks(response)
            if boundary is not None:
                yield from multipart_bodies(chunks, boundary, limits)
            elif content_type.lower().startswith("application/dicom"):
                yield read_whole(chunks, limits.max_bytes)  # one instance, not wrapped (some servers do)
            else:
                raise PacsError("The PACS did not answer as a DICOMweb server does.")


class _TrackingAdapter:
    """requests' HTTPAdapter whose connections report their socket when they connect (urllib3's
    `ConnectionCls`, a documented hook), so the watchdog can shut it. Built on first use."""

    def __new__(cls, opened: Callable[[socket.socket], None]):
        from requests.adapters import HTTPAdapter
        from urllib3.connection import HTTPConnection, HTTPSConnection
        from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

        class Tracked(HTTPConnection):
            def connect(self):
                super().connect()
                opened(self.sock)

        class TrackedTls(HTTPSConnection):
            def connect(self):
                super().connect()
                opened(self.sock)

        class Pool(HTTPConnectionPool):
            ConnectionCls = Tracked

        class TlsPool(HTTPSConnectionPool):
            ConnectionCls = TrackedTls

        class Adapter(HTTPAdapter):
            def init_poolmanager(self, *args, **kwargs):
                super().init_poolmanager(*args, **kwargs)
                self.poolmanager.pool_classes_by_scheme = {"http": Pool, "https": TlsPool}

        return Adapter(max_retries=0)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed: nothing to cut
        sock.shutdown(socket.SHUT_RDWR)


def _several_studies(count: int, counted: int) -> str:
    """The refusal of an accession number that names several studies (accession numbers are unique
    only within the system that issued them, and some archives match them regardless of case). It
    names no study: the clinician knows which one they mean, and types its Study Instance UID."""
    many = f"More than {counted}" if count > counted else str(count)
    return (f"{many} studies have this accession number, so none was listed (they may belong to different "
            "patients). Type the Study Instance UID of the study you mean.")


def _status_message(status: int, path: str) -> str:
    """What an HTTP error on `path` means. An archive with no such study answers its study search
    with an empty result (200 or 204); a 404 on the search itself means the address is wrong, which
    the administrator must fix and the clinician should not take for a missing study."""
    return ("The PACS refused the credentials (set MEDVQA_PACS_USERNAME and MEDVQA_PACS_PASSWORD, "
            "or MEDVQA_PACS_TOKEN)." if status in (401, 403) else
            "The PACS address does not answer as a DICOMweb server: it has no study search (QIDO-RS "
            "/studies). Ask the administrator to check the PACS URL (--pacs-url)." if status == 404
            and path == "/studies" else
            "No study with that identifier was found in the PACS." if status == 404 else
            "The PACS is busy and did not take the request; try again later." if status in (429, 503) else
            "The PACS could not be reached or did not answer as a DICOMweb server does.")


def _count(value, absent: int) -> int:
    """An IS count from a QIDO answer (an int, or a string some archives send), else `absent`."""
    try:
        count = int(value)
    except (TypeError, ValueError, OverflowError):
        return absent
    return count if count >= 0 else absent


def _value(item: dict, tag: str):
    """The first value of `tag` in a DICOM JSON object, or None."""
    element = item.get(tag) if isinstance(item, dict) else None
    values = element.get("Value") if isinstance(element, dict) else None
    return values[0] if isinstance(values, list) and values else None
