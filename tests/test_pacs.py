"""Studies from a real PACS (`pytest -m pacs`): Debian's Orthanc, started by tests/orthanc_helpers.py,
holding a 40-slice synthetic CT with planted patient data stored in shuffled order. The study is
found by Study Instance UID and by accession number, fetched over DICOMweb through medvqa.pacs, the
command line and the web app; its slices come in position order, and neither the planted data nor
the identifier typed appears in the page, the logs, the export or on disk."""

from __future__ import annotations

import io
import json
import logging
import re

import numpy as np
import pytest

from medvqa.imaging import open_study
from medvqa.pacs import ENV_PASSWORD, ENV_USERNAME, Pacs, PacsError

from .imaging_helpers import PLANTED
from .orthanc_helpers import MULTI_ACCESSION, PASSWORD, SHARED_ACCESSION, SLICES, USER, orthanc  # noqa: F401
from .ui_helpers import (QUESTION, client, decoded_image, text_of, ui_pipeline, ui_settings,  # noqa: F401
                         upload_folder)

pytestmark = pytest.mark.pacs

CREDENTIALS = {ENV_USERNAME: USER, ENV_PASSWORD: PASSWORD}


def secrets(running) -> list[str]:
    """What must never leave the archive: the planted patient data and the identifiers typed."""
    parts = [part for value in PLANTED.values() for part in re.split(r"[\s^]+", value)]
    return parts + [running.study_uid, running.accession]


def leaked(running, text: str) -> list[str]:
    return [secret for secret in secrets(running) if secret in text]


def test_find_by_study_uid_and_accession_and_fetch_in_position_order(orthanc, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    pacs = Pacs(orthanc.dicomweb, env=CREDENTIALS)
    for identifier in (orthanc.study_uid, orthanc.accession):
        (found,) = pacs.find_series(identifier)
        assert (found.number, found.modality, found.slices) == (1, "CT", SLICES)
        assert orthanc.study_uid not in repr(found) and orthanc.study_uid not in found.describe()
    seen = []
    study = pacs.fetch(found, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (SLICES, SLICES) and len(seen) == SLICES
    (series,) = study.series
    assert series.positions_mm == [-50 + 2.5 * i for i in range(SLICES)] and series.warnings == []
    assert not leaked(orthanc, caplog.text + repr(study) + json.dumps(series.summary()))


def test_a_multi_frame_image_is_listed_with_its_frames(orthanc):  # noqa: F811
    found = Pacs(orthanc.dicomweb, env=CREDENTIALS).find_series(MULTI_ACCESSION)
    assert sorted((item.instances, item.slices) for item in found) == [(1, 10), (6, 6), (20, 20)]
    (multi_frame,) = [item for item in found if item.instances == 1]
    assert multi_frame.describe().endswith(": CT, 10 slices")  # as the viewer counts them once it is loaded
    study = Pacs(orthanc.dicomweb, env=CREDENTIALS).fetch(multi_frame)
    assert study.series[0].frame_count == 10


def test_series_are_numbered_as_an_upload_of_the_study_numbers_them(orthanc, monkeypatch, capsys):  # noqa: F811
    """The most slices first, as an upload of the same files lists them (not in the archive's order),
    and the number stays with the series once it is loaded, and from the command line."""
    from medvqa.__main__ import main

    uploaded = [series.describe() for series in open_study(orthanc.multi_series).series]
    assert uploaded == ["Series 1: CT, 20 slices", "Series 2: CT, 10 slices", "Series 3: CT, 6 slices"]
    pacs = Pacs(orthanc.dicomweb, env=CREDENTIALS)
    found = pacs.find_series(MULTI_ACCESSION)
    assert [item.describe() for item in found] == uploaded
    (loaded,) = pacs.fetch(found[2]).series
    assert loaded.describe() == uploaded[2] and loaded.render().series == 3
    monkeypatch.setenv(ENV_USERNAME, USER)
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
    monkeypatch.setattr("sys.stdin", io.StringIO(MULTI_ACCESSION + "\n"))
    assert main(["scan", "--pacs-url", orthanc.dicomweb, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["series"]
    assert [(series["series"], series["slices"]) for series in listed] == [(1, 20), (2, 10), (3, 6)]


def test_refusals_say_what_went_wrong_without_quoting_the_identifier(orthanc, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PacsError, match="refused the credentials") as refused:
        Pacs(orthanc.dicomweb, env={}).find_series(orthanc.study_uid)
    with pytest.raises(PacsError, match="No study with that identifier") as unknown:
        Pacs(orthanc.dicomweb, env=CREDENTIALS).find_series("1.2.3.4.5.6.7")
    with pytest.raises(PacsError, match="could not be reached"):
        Pacs("http://127.0.0.1:9/dicom-web", env=CREDENTIALS).find_series(orthanc.study_uid)
    for identifier in (orthanc.study_uid, orthanc.accession):  # Orthanc itself, but not its DICOMweb root
        with pytest.raises(PacsError, match="does not answer as a DICOMweb server"):
            Pacs(orthanc.url + "/not-dicomweb", env=CREDENTIALS).find_series(identifier)
    with pytest.raises(PacsError, match="Please type a Study Instance UID"):
        Pacs(orthanc.dicomweb, env=CREDENTIALS).find_series("<script>")
    assert not leaked(orthanc, caplog.text + str(refused.value) + str(unknown.value))
    assert "1.2.3.4.5.6.7" not in caplog.text


def test_an_accession_number_of_two_studies_lists_neither_and_asks_for_the_study_uid(orthanc, caplog):  # noqa: F811
    """Accession numbers are unique only per issuer (and Orthanc matches them regardless of case): the
    series of two studies, maybe two patients', are never listed as one study's."""
    caplog.set_level(logging.DEBUG)
    pacs = Pacs(orthanc.dicomweb, env=CREDENTIALS)
    for typed in (SHARED_ACCESSION, SHARED_ACCESSION.lower()):
        with pytest.raises(PacsError, match="^2 studies have this accession number.* Type the Study Instance "
                                            "UID") as refused:
            pacs.find_series(typed)
        said = str(refused.value) + caplog.text
        assert SHARED_ACCESSION not in said.upper() and not [uid for uid in orthanc.shared_study_uids if uid in said]
    for uid, slices in zip(orthanc.shared_study_uids, (5, 7)):
        (found,) = pacs.find_series(uid)
        assert found.slices == slices


def test_a_study_uid_stored_under_two_patients_is_not_listed(orthanc):  # noqa: F811
    """Orthanc keeps a Study Instance UID sent under two patient IDs as two studies; searched for, both
    answer. Their series are not listed as one study's, by UID or by accession number."""
    pacs = Pacs(orthanc.dicomweb, env=CREDENTIALS)
    for identifier in (orthanc.two_patient_uid, "TWOPAT1"):
        with pytest.raises(PacsError, match="files this study under 2 different patients") as refused:
            pacs.find_series(identifier)
        assert "TWO-PATIENT" not in str(refused.value) and orthanc.two_patient_uid not in str(refused.value)


def test_the_command_line_reads_the_identifier_from_stdin(orthanc, monkeypatch, capsys):  # noqa: F811
    from medvqa.__main__ import main

    monkeypatch.setenv(ENV_USERNAME, USER)
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
    monkeypatch.setattr("sys.stdin", io.StringIO(orthanc.accession + "\n"))
    assert main(["scan", "--pacs-url", orthanc.dicomweb, "--json"]) == 0
    out, err = capsys.readouterr()
    (series,) = json.loads(out)["series"]
    assert series["slices"] == SLICES and series["positions_mm"] == [-50 + 2.5 * i for i in range(SLICES)]
    assert not leaked(orthanc, out + err)


def test_the_command_line_tells_a_wrong_address_from_a_missing_study(orthanc, monkeypatch, capsys):  # noqa: F811
    from medvqa.__main__ import main

    monkeypatch.setenv(ENV_USERNAME, USER)
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
    for url, said in ((orthanc.dicomweb, "No study with that identifier"),
                      (orthanc.url + "/not-dicomweb", "does not answer as a DICOMweb server")):
        monkeypatch.setattr("sys.stdin", io.StringIO("NOSUCHACC1\n"))
        assert main(["scan", "--pacs-url", url, "--json"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and said in err and "NOSUCHACC1" not in err


@pytest.fixture(scope="module")
def pacs_app(orthanc, ui_pipeline, ui_settings, upload_folder):  # noqa: F811
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=1, pacs=Pacs(orthanc.dicomweb, env=CREDENTIALS))
    _, url, _ = launch(demo, port=None, max_upload_mb=1, block=False, quiet=True)
    yield url
    demo.close()


@pytest.mark.parametrize("by", ["study_uid", "accession"])
def test_the_app_opens_the_study_and_nothing_identifying_leaves(orthanc, pacs_app, by, caplog,  # noqa: F811
                                                                 upload_folder, tiny_cache):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    c = client(pacs_app)
    identifier = getattr(orthanc, by)
    box, choices, status, *_ = c.predict(identifier, api_name="/pacs_find")
    assert box == "" and "Found 1 series" in status
    assert [choice[0] for choice in choices["choices"]] == ["Series 1: CT, 40 slices"]
    viewer, *_, meta, chat = c.predict(1, api_name="/pacs_load")
    assert "series 1 · slice 21 of 40 · 0 mm" in viewer, chat
    viewer, *_ = c.predict("lung", 21, api_name="/set_preset")
    viewer, *_ = c.predict(8, api_name="/set_frame")
    assert "series 1 · slice 8 of 40 · -32.5 mm" in viewer and "lung window" in viewer
    assert np.asarray(decoded_image(viewer)).std() > 0
    c.predict(QUESTION, api_name="/ask")
    _, markdown, as_json = c.predict(api_name="/export")
    turn = json.loads(as_json)["turns"][0]
    assert (turn["series"], turn["slice"]) == (1, 8) and turn["window"].startswith("lung window")
    page = " ".join([box, json.dumps(choices), status, viewer, json.dumps(meta), json.dumps(chat)])
    assert not leaked(orthanc, page + markdown + as_json + caplog.text)
    written = [path for folder in (upload_folder, tiny_cache) for path in folder.rglob("*") if path.is_file()]
    for path in written:  # nothing of the study on disk where the app writes
        data = path.read_bytes()
        assert not [s for s in secrets(orthanc) if s.encode() in data], path


def test_the_app_names_a_series_by_its_number_in_the_pacs_list(orthanc, pacs_app):  # noqa: F811
    """The number the PACS panel lists a series under is the viewer's, the series picker's, the
    chat's and the export's."""
    c = client(pacs_app)
    _, choices, _ = c.predict(MULTI_ACCESSION, api_name="/pacs_find")
    assert [choice for choice, _ in choices["choices"]] == [series.describe() for series in
                                                            open_study(orthanc.multi_series).series]
    viewer, *_ = c.predict(3, api_name="/pacs_load")
    assert "series 3 · slice 4 of 6" in viewer
    viewer, *_ = c.predict(3, api_name="/set_series")  # the picker holds it under that number
    assert "series 3 · slice 4 of 6" in viewer
    c.predict(QUESTION, api_name="/ask")
    _, markdown, as_json = c.predict(api_name="/export")
    record = json.loads(as_json)
    assert record["scan"]["series"] == [{"series": 3, "modality": "CT", "slices": 6}]
    assert record["turns"][0]["series"] == 3 and "series 3, slice 4 of 6" in markdown


def test_another_series_of_the_study_shown_joins_it_and_the_conversation_goes_on(orthanc, pacs_app):  # noqa: F811
    """As in an upload, where the series picker switches series: a Load from the study shown adds its
    series; a Load from another study starts a new conversation."""
    c = client(pacs_app)
    c.predict(MULTI_ACCESSION, api_name="/pacs_find")
    c.predict(3, api_name="/pacs_load")
    c.predict(QUESTION, api_name="/ask")
    viewer, *_, chat = c.predict(1, api_name="/pacs_load")
    assert "series 1 · slice 11 of 20" in viewer and "new conversation" not in json.dumps(chat)
    c.predict(QUESTION, api_name="/ask")
    viewer, *_ = c.predict(3, api_name="/set_series")
    assert "series 3 · slice 4 of 6" in viewer
    record = json.loads(c.predict(api_name="/export")[2])
    assert [turn["series"] for turn in record["turns"]] == [3, 1]
    assert [series["series"] for series in record["scan"]["series"]] == [1, 3]
    c.predict(orthanc.accession, api_name="/pacs_find")
    *_, chat = c.predict(1, api_name="/pacs_load")
    assert "A new scan starts a new conversation: the previous one (2 answers" in text_of(chat[-1])


def test_the_app_refuses_an_unknown_study_and_keeps_serving(orthanc, pacs_app):  # noqa: F811
    c = client(pacs_app)
    _, choices, status, *_ = c.predict("1.2.3.4.5.6.7", api_name="/pacs_find")
    assert "No study with that identifier" in status and "1.2.3.4.5.6.7" not in status
    *_, chat = c.predict(1, api_name="/pacs_load")
    assert "Find a study in the PACS first" in text_of(chat[-1])
    _, _, status, *_ = c.predict(orthanc.study_uid, api_name="/pacs_find")
    assert "Found 1 series" in status
    _, choices, status = c.predict(SHARED_ACCESSION, api_name="/pacs_find")
    assert "2 studies have this accession number" in status and SHARED_ACCESSION not in status
    assert not choices["choices"]
    *_, chat = c.predict(1, api_name="/pacs_load")  # the series found before are no longer offered
    assert "Find a study in the PACS first" in text_of(chat[-1])
