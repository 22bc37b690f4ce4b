"""A study in the web app through gradio_client: a shuffled .zip of a CT series opens as one series in
position order, the slice slider moves through it in one window, the model is asked about the slice
shown, and the export names series, slice and window; hostile uploads get a message and the app
keeps serving. The fixtures are tests/ui_helpers.py's."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import handle_file  # noqa: E402

from medvqa.imaging import open_study  # noqa: E402

from .imaging_helpers import PLANTED, ct_series, zip_bytes  # noqa: E402
from .ui_helpers import (QUESTION, app_url, assert_still_serving, client, decoded_image,  # noqa: E402, F401
                         text_of, ui_app, ui_pipeline, ui_settings, upload, upload_folder)


def planted_parts() -> list[str]:
    return [part for value in PLANTED.values() for part in value.replace("^", " ").split()]


@pytest.fixture(scope="module")
def series_zip(tmp_path_factory):
    """40 slices in shuffled order, in a folder named after the patient, zipped."""
    path = tmp_path_factory.mktemp("study") / "study.zip"
    path.write_bytes(zip_bytes({f"{PLANTED['PatientName']}/{n:03d}.dcm": f for n, f in enumerate(ct_series(40))}))
    return path


def test_a_zipped_series_scrolls_and_each_question_records_its_slice(app_url, series_zip, ui_pipeline,  # noqa: F811
                                                                     upload_folder, monkeypatch, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    series = open_study(series_zip).series[0]
    asked_on = []
    real_ask = ui_pipeline.ask

    def ask(conversation, *args, **kwargs):
        asked_on.append(conversation.image)
        yield from real_ask(conversation, *args, **kwargs)

    monkeypatch.setattr(ui_pipeline, "ask", ask)
    c = client(app_url)
    shown = upload(c, series_zip)
    assert "series 1 · slice 21 of 40 · 0 mm" in shown["viewer"]
    assert shown["frame"]["visible"] and shown["frame"]["maximum"] == 40 and shown["frame"]["label"] == "Slice (of 40)"
    assert np.array_equal(np.asarray(decoded_image(shown["viewer"]).convert("RGB")), series.render().pixels)

    viewer, preset, *_ = c.predict("lung", 21, api_name="/set_preset")
    viewer, *_ = c.predict(30, api_name="/set_frame")
    assert "series 1 · slice 30 of 40 · 22.5 mm" in viewer and "lung window (C -600 / W 1500)" in viewer
    on_screen = np.asarray(decoded_image(viewer).convert("RGB"))
    assert np.array_equal(on_screen, series.render("lung", 29).pixels)

    job = c.submit(QUESTION, api_name="/ask")
    job.result()
    assert len(asked_on) == 1 and np.array_equal(asked_on[0], on_screen)  # the model saw the slice on screen

    _, markdown, as_json = c.predict(api_name="/export")
    record = json.loads(as_json)
    (turn,) = record["turns"]
    assert (turn["series"], turn["slice"], turn["slices"], turn["position_mm"]) == (1, 30, 40, 22.5)
    assert turn["window"].startswith("lung window")
    assert record["scan"]["series"] == [{"series": 1, "modality": "CT", "slices": 40}]
    assert "series 1, slice 30 of 40 (22.5 mm)" in markdown and "lung window" in markdown
    everything = " ".join([markdown, as_json, viewer, json.dumps(shown["meta"]), caplog.text])
    assert not [part for part in planted_parts() if part in everything]
    assert not [p for p in upload_folder.rglob("*") if p.is_file()], "the upload must be deleted once read"


def test_several_files_open_as_one_series(app_url, tmp_path):  # noqa: F811
    paths = []
    for n, data in enumerate(ct_series(6)):
        paths.append(tmp_path / f"IM{n}")
        paths[-1].write_bytes(data)
    c = client(app_url)
    out = c.predict([handle_file(str(p)) for p in paths], api_name="/upload_files")
    assert "series 1 · slice 4 of 6" in out[1]


@pytest.mark.parametrize("name, files, message", [
    ("bomb.zip", lambda: zip_bytes({"slice.dcm": bytes(60 * 2**20)}), "zip bomb"),
    ("escape.zip", lambda: zip_bytes({"../../escape.dcm": ct_series(1)[0]}), "point outside it"),
    ("many.zip", lambda: zip_bytes({f"f{n}": b"x" for n in range(10_000)}, compression=0), "at most 4,096"),
    ("text.zip", lambda: zip_bytes({f"note{n}.txt": b"hello" for n in range(3)}), "None of the 3 files"),
])
def test_hostile_uploads_get_a_message_and_the_app_keeps_serving(app_url, tmp_path, name, files, message):  # noqa: F811
    path = tmp_path / name
    path.write_bytes(files())
    assert path.stat().st_size < 2**20  # under the test app's 1 MB upload limit
    c = client(app_url)
    chat = upload(c, path)["chat"]
    assert message in text_of(chat[-1]) and "could not be opened" in text_of(chat[-1])
    assert_still_serving(c)


def test_the_series_picker_switches_series_and_refuses_unknown_ones(app_url, tmp_path):  # noqa: F811
    path = tmp_path / "two.zip"
    path.write_bytes(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(3) + ct_series(5, first=100))}))
    c = client(app_url)
    assert "series 1 · slice 3 of 5 · 105 mm" in upload(c, path)["viewer"]
    viewer, *_ = c.predict(2, api_name="/set_series")
    assert "series 2 · slice 2 of 3 · -47.5 mm" in viewer
    *_, chat = c.predict(7, api_name="/set_series")
    assert "There is no such series in this upload." in text_of(chat[-1])
    assert_still_serving(c)
