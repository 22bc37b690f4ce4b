"""What a slow, huge or hostile archive may cost (medvqa/pacs.py), against scripts/fake_archive.py on
loopback: bounded requests and bytes, deadlines and cancellation that end with a clear message, no
redirect to another server, and no lock shared with anyone's decoding while the network is waited on.
Behaviour only: the time figures are scripts/bench_pacs.py's."""

from __future__ import annotations

import io
import threading

import pydicom.data
import pytest
from PIL import Image

from medvqa.imaging import ScanLimits, open_scan
from medvqa.pacs import Pacs, PacsError, PacsLimits

from .conftest import load_script
from .imaging_helpers import encode
from .ui_helpers import client, ui_pipeline, ui_settings, upload_folder  # noqa: F401 - fixtures

FAKE = load_script("fake_archive")
CT = open(pydicom.data.get_testdata_file("CT_small.dcm"), "rb").read()


def ct_instances(count: int, **attributes) -> list[bytes]:
    """`count` instances of CT_small.dcm (with `attributes` set), each with its own SOP Instance UID:
    copies of one file would open as one slice (an upload skips them)."""
    files = []
    for _ in range(count):
        ds = pydicom.dcmread(io.BytesIO(CT))
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
        for keyword, value in attributes.items():
            setattr(ds, keyword, value)
        buffer = io.BytesIO()
        ds.save_as(buffer)
        files.append(buffer.getvalue())
    return files


@pytest.fixture
def archive():
    with FAKE.FakeArchive(FAKE.Behaviour(instances=ct_instances(3))) as running:
        yield running


def wait_for_requests(archive, count: int) -> None:
    for _ in range(600):
        if len(archive.requests) >= count:
            return
        threading.Event().wait(0.05)
    pytest.fail(f"the archive saw {len(archive.requests)} request(s), expected {count}")


def test_a_reply_listing_one_study_600000_times_costs_two_requests(archive):
    archive.behaviour.study_copies = 600_000
    found = Pacs(archive.url).find_series("ACC-1")
    assert [item.describe() for item in found] == ["Series 1: CT, 3 slices"] and found.capped
    assert len(archive.requests) == 2  # the study query, one series query for the one distinct study
    assert archive.sent_bytes < 64 * 2**20  # the answer was not read to its end (it is about 40 MB)
    study = Pacs(archive.url).fetch(found[0])
    assert study.series[0].frame_count == 3


def test_an_answer_naming_several_studies_is_counted_up_to_the_cap_and_refused(archive):
    archive.behaviour.study_copies, archive.behaviour.distinct_studies = 5_000, 50
    with pytest.raises(PacsError, match="^More than 4 studies have this accession number"):
        Pacs(archive.url, limits=PacsLimits(max_studies=4)).find_series("ACC-1")
    archive.behaviour.distinct_studies = 3
    with pytest.raises(PacsError, match="^3 studies have this accession number"):
        Pacs(archive.url).find_series("ACC-1")
    assert len(archive.requests) == 2  # no series query: the studies' series are never listed together


def test_an_address_that_is_no_dicomweb_server_is_not_taken_for_a_missing_study(archive):
    """An empty search (204 here, 200 with [] from Orthanc) is "no such study"; a 404 on the study
    search itself is a wrong address, for the administrator to fix."""
    archive.behaviour.study_copies = 0
    for identifier in ("ACC-1", FAKE.STUDY_UID):
        with pytest.raises(PacsError, match="^No study with that identifier was found"):
            Pacs(archive.url).find_series(identifier)
        with pytest.raises(PacsError, match="^The PACS address does not answer as a DICOMweb server"):
            Pacs(archive.url.replace("/dicom-web", "/not-dicomweb")).find_series(identifier)


def test_series_of_multi_frame_images_are_listed_as_images():
    """The frames an archive reports (NumberOfFrames, of one image) count for an image alone; several
    multi-frame images open as a series each, as uploaded ones do, and are listed as images."""
    from medvqa.pacs import RemoteSeries

    assert RemoteSeries(2, "US", 1, 30).describe() == "Series 2: US, 30 slices"
    assert RemoteSeries(3, "US", 4, 30).describe() == "Series 3: US, 4 multi-frame images"
    assert RemoteSeries(4, "CT", 1).describe() == "Series 4: CT, 1 slice"


def test_an_instance_past_the_limit_is_refused_while_it_arrives(archive):
    archive.behaviour.instances, archive.behaviour.instance_padding = [CT] * 40, 8 * 2**20  # 40 × 8 MB
    (series,) = Pacs(archive.url).find_series(FAKE.STUDY_UID)
    with pytest.raises(PacsError, match="larger than the 2.0 MB upload limit"):
        Pacs(archive.url).fetch(series, limits=ScanLimits(max_bytes=2 * 2**20))
    assert archive.sent_bytes < 64 * 2**20  # of 320 MB


def test_a_stalled_load_says_so_once_and_goes_on_when_the_archive_answers(archive):
    (series,) = Pacs(archive.url).find_series("ACC-1")
    archive.behaviour.hold, said = threading.Event(), []
    threading.Timer(1.5, archive.behaviour.hold.set).start()  # the archive answers after 1.5 s
    study = Pacs(archive.url, limits=PacsLimits(stall_note_s=0.5)).fetch(series, stalled=said.append)
    assert len(said) == 1 and 0.5 <= said[0] < 1.5 and study.series[0].frame_count == 3
    said.clear()
    Pacs(archive.url, limits=PacsLimits(stall_note_s=0.5)).fetch(series, stalled=said.append)
    assert said == []  # an archive that answers at once is not said to stall


def test_the_page_shows_the_stall_note_in_the_load_s_progress(archive, ui_pipeline, ui_settings,  # noqa: F811
                                                              upload_folder):  # noqa: F811
    """The note is given from the transfer's watchdog thread, which must see the handler's context
    for Gradio to find its progress bar."""
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=1,
                     pacs=Pacs(archive.url, env={}, limits=PacsLimits(stall_note_s=0.5)))
    _, url, _ = launch(demo, port=None, max_upload_mb=1, block=False, quiet=True)
    try:
        c = client(url)
        c.predict("ACC-1", api_name="/pacs_find")
        archive.behaviour.hold = threading.Event()
        job = c.submit(1, api_name="/pacs_load")
        notes = []
        for _ in range(100):
            notes = [unit.desc for unit in job.status().progress_data or [] if unit.desc]
            if notes:
                break
            threading.Event().wait(0.1)
        archive.behaviour.hold.set()
        assert "series 1 · slice 2 of 3" in job.result()[0]
        assert notes and notes[0].startswith("The PACS has sent nothing for ") and "Still waiting" in notes[0]
    finally:
        archive.behaviour.hold.set()
        demo.close()


def test_a_redirect_to_another_server_is_not_followed(archive):
    with FAKE.FakeArchive() as elsewhere:
        archive.behaviour.redirect_to = elsewhere.url.replace("127.0.0.1", "localhost")
        with pytest.raises(PacsError, match="redirected the request to another server"):
            Pacs(archive.url).find_series(FAKE.STUDY_UID)
        assert elsewhere.requests == []


def test_a_silent_archive_ends_at_the_deadline_with_a_message(archive):
    archive.behaviour.hold = threading.Event()  # never answers
    try:
        with pytest.raises(PacsError, match="did not finish the search within 1 s"):
            Pacs(archive.url, limits=PacsLimits(find_s=1)).find_series("ACC-1")
    finally:
        archive.behaviour.hold.set()


def test_waiting_on_the_archive_holds_up_no_one_s_decoding(archive):
    """The decode guard's lock is not held while a Find waits: an upload decodes meanwhile."""
    archive.behaviour.hold = threading.Event()
    outcome = {}
    finder = threading.Thread(target=lambda: outcome.update(found=Pacs(archive.url).find_series("ACC-1")))
    finder.start()
    try:
        wait_for_requests(archive, 1)
        png = encode(Image.new("RGB", (64, 64), (90, 20, 200)), "PNG")
        scan = open_scan(png).render()  # would wait for the archive if the lock were held
        assert scan.pixels.shape == (64, 64, 3) and finder.is_alive()
    finally:
        archive.behaviour.hold.set()
        finder.join(60)
    assert len(outcome["found"]) == 1


def test_cancelling_stops_the_transfer_and_no_request_follows(archive):
    archive.behaviour.study_copies = 10  # one study: a series query would follow the first
    archive.behaviour.hold, cancel, outcome = threading.Event(), threading.Event(), {}

    def find():
        try:
            Pacs(archive.url).find_series("ACC-1", cancel=cancel)
        except PacsError as error:
            outcome["error"] = str(error)

    finder = threading.Thread(target=find)
    finder.start()
    wait_for_requests(archive, 1)
    cancel.set()  # the tab went away while the first query waited for its answer
    finder.join(60)
    archive.behaviour.hold.set()
    assert outcome["error"] == "The PACS search was stopped." and len(archive.requests) == 1


def test_closing_a_tab_stops_its_own_finds_only(archive):
    """The page's unload handler (medvqa/ui/remote.py) cancels the closed tab's Find; another tab's, or
    a call without a session (no tab to close), goes on."""
    from types import SimpleNamespace

    from medvqa.ui.remote import _PacsHandlers

    archive.behaviour.hold = threading.Event()
    remote, outcome = _PacsHandlers(Pacs(archive.url), handlers=None), {}

    def find(name: str, request) -> None:
        outcome[name] = remote.find("ACC-1", None, request)[2]

    tabs = {"closed": SimpleNamespace(session_hash="tab-1"), "open": SimpleNamespace(session_hash="tab-2"),
            "no session": None}
    finders = [threading.Thread(target=find, args=item) for item in tabs.items()]
    for finder in finders:
        finder.start()
    wait_for_requests(archive, 3)
    remote.tab_closed(None)  # no tab: nothing to cancel
    remote.tab_closed(tabs["closed"])
    finders[0].join(60)
    assert not finders[0].is_alive()  # ended while the archive still held its answer
    archive.behaviour.hold.set()
    for finder in finders[1:]:
        finder.join(60)
    assert outcome["closed"] == {"__type__": "update"}  # stopped: the status line is left to Cancel's
    assert "Found 1 series." in outcome["open"] and "Found 1 series." in outcome["no session"]


def test_a_second_load_stops_the_one_running_and_clears_an_old_status(archive):
    """The panel's Load while a Find or Load of the tab runs: that one is stopped (the new choice replaces
    it; Gradio would drop the second press, so the layout runs this first, then the load behind it), and
    a status left by an earlier Cancel goes."""
    from types import SimpleNamespace

    from medvqa.ui.remote import _PacsHandlers

    archive.behaviour.hold = threading.Event()
    remote, outcome = _PacsHandlers(Pacs(archive.url), handlers=None), {}
    tab, other = SimpleNamespace(session_hash="tab-1"), SimpleNamespace(session_hash="tab-2")
    assert remote.load_starts(tab) == ""  # nothing running: the status line is cleared
    finders = [threading.Thread(target=lambda name=name, request=request: outcome.__setitem__(
        name, remote.find("ACC-1", None, request)[2])) for name, request in (("mine", tab), ("other", other))]
    for finder in finders:
        finder.start()
    wait_for_requests(archive, 2)
    assert "stopped" in remote.load_starts(tab)
    finders[0].join(60)
    assert not finders[0].is_alive() and outcome["mine"] == {"__type__": "update"}
    archive.behaviour.hold.set()
    finders[1].join(60)
    assert "Found 1 series." in outcome["other"]  # another tab's goes on


def test_cancel_stops_the_tab_s_load_and_the_scan_shown_stays(archive, ui_pipeline, ui_settings,  # noqa: F811
                                                              upload_folder):  # noqa: F811
    """The panel's Cancel (a slow archive, a series chosen by mistake) stops the Load as closing the tab
    would, without closing it: no request follows, the chat gets no error, the scan shown stays."""
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=1, pacs=Pacs(archive.url, env={}))
    _, url, _ = launch(demo, port=None, max_upload_mb=1, block=False, quiet=True)
    try:
        c = client(url)
        assert c.predict(api_name="/pacs_cancel") == '<p class="medvqa-caption">Nothing is being found or loaded.</p>'
        c.predict("ACC-1", api_name="/pacs_find")
        archive.behaviour.hold = threading.Event()
        asked = len(archive.requests)
        job = c.submit(1, api_name="/pacs_load")
        wait_for_requests(archive, asked + 1)
        assert "Cancelled. The scan shown before is still open." in c.predict(api_name="/pacs_cancel")
        viewer, *_, chat = job.result(timeout=60)
        archive.behaviour.hold.set()
        threading.Event().wait(1)  # time for a request that should not come
        assert len(archive.requests) == asked + 1 and chat == [] and viewer["__type__"] == "update"  # unchanged
    finally:
        archive.behaviour.hold.set()
        demo.close()


def test_a_series_naming_another_patient_under_the_study_shown_starts_a_new_conversation(
        archive, ui_pipeline, ui_settings, upload_folder):  # noqa: F811
    """Another series of the study shown joins it and the conversation goes on; one the archive files
    under the same Study Instance UID but naming another patient ID does not: a new conversation, said."""
    from medvqa.ui.handlers import _Handlers
    from medvqa.ui.remote import _PacsHandlers

    handlers = _Handlers(ui_pipeline, ui_settings, max_upload_mb=1)
    remote = _PacsHandlers(Pacs(archive.url, env={}), handlers)
    *_, found = remote.find("ACC-1", None)
    *_, session = remote.load(1, found, None)
    list(handlers.ask("Is there a mass?", session))
    archive.behaviour.instances = ct_instances(3)  # the same patient again: the conversation goes on
    *_, chat, joined = remote.load(1, found, session)
    assert joined is session and len(session.turns) == 1
    archive.behaviour.instances = ct_instances(3, PatientID="")  # naming no patient: no other patient either
    *_, chat, joined = remote.load(1, found, session)
    assert joined is session and len(session.study.patients) == 1  # the patient joined so far is still known
    archive.behaviour.instances = ct_instances(3, PatientID="PAT-OTHER-4417")
    *_, chat, other = remote.load(1, found, session)
    assert other is not session and other.turns == []
    assert "A new scan starts a new conversation: the previous one (1 answer" in chat[-1]["content"]
    notes = handlers.study_controls(other)[1]
    assert "This series names another patient than the series shown before" in notes
    assert "PAT-OTHER-4417" not in notes + repr(other.study)
    other.close()


def test_a_study_filed_under_two_patients_is_not_listed(archive):
    """An archive may file one Study Instance UID under two patients (Orthanc keeps it once per patient).
    Its series are never listed as one study's; the refusal names neither patient."""
    archive.behaviour.study_copies, archive.behaviour.patients = 2, 2
    with pytest.raises(PacsError) as refused:
        Pacs(archive.url).find_series(FAKE.STUDY_UID)
    assert "files this study under 2 different patients" in str(refused.value)
    assert "FAKE-PATIENT" not in str(refused.value) and len(archive.requests) == 1  # no series query made
    archive.behaviour.patients = 1  # the same patient twice: one study
    assert len(Pacs(archive.url).find_series(FAKE.STUDY_UID)) == 1
