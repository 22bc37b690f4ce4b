"""The web app end to end through gradio_client, as a client of its API sees it.

A scan is uploaded, questions are asked and streamed, the window and frame change, the transcript is
downloaded (/export), errors show in the chat and the app keeps serving; two sessions at once stay
apart; the served config is private and a login is required when one is set. The fixtures, the
small literature index and the client helpers are in tests/ui_helpers.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
from base64 import b64decode
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

pytest.register_assert_rewrite("tests.ui_helpers")  # so that its asserts explain their failures too

from .threads import join_all  # noqa: E402
from .ui_helpers import (CORPUS_URLS, EFFUSION_URLS, QUESTION, SlowPipeline, answer_part,  # noqa: E402
                         ask_streaming, assert_still_serving, client, decoded_image, image_src, last_reply, plain,
                         text_of, upload)
# tests/test_browser.py imports MAX_UPLOAD_MB, QUESTION, dicom_file and these fixtures from here.
from .ui_helpers import (MAX_UPLOAD_MB, app_url, dicom_file, ui_app, ui_pipeline, ui_settings,  # noqa: E402, F401
                         upload_folder)


# ── End to end ─────────────────────────────────────────────────────────────────────────────────

def test_dicom_question_streams_an_answer_with_linked_sources(app_url, upload_folder):
    c = client(app_url)
    shown = upload(c, dicom_file("CT_small.dcm"))
    assert shown["meta"]["Modality"] == "CT" and shown["meta"]["format"] == "dicom"
    assert decoded_image(shown["viewer"]).size == (128, 128)
    assert shown["preset"]["visible"] and shown["center"]["visible"] and shown["width"]["visible"]
    assert not shown["frame"]["visible"]
    assert not [p for p in upload_folder.rglob("*") if p.is_file()], "the upload must be deleted once decoded"

    seen, chat = ask_streaming(c, QUESTION)
    partial = [answer_part(t) for t in seen if "medvqa-status" not in t and "medvqa-sources" not in t]
    assert len(partial) >= 2, seen  # the answer arrived in pieces
    assert all(b.startswith(a) for a, b in zip(partial, partial[1:]))  # each piece extends the last
    assert [m["role"] for m in chat] == ["user", "assistant"] and plain(text_of(chat[0])) == QUESTION

    reply = last_reply(chat)
    links = re.findall(r'<a class="medvqa-source-link" href="([^"]+)" target="_blank" rel="noopener noreferrer">',
                       reply)
    assert links and set(links) <= CORPUS_URLS and set(links) & EFFUSION_URLS, reply
    assert reply.count("<details>") == len(links) and "<summary>Passage text</summary>" in reply
    assert "pleural effusion" in reply.split("<details>", 1)[1].lower()  # the passage text is in the panel


def test_multi_turn_new_conversation_and_export(app_url):
    c = client(app_url)
    upload(c, dicom_file("CT_small.dcm"))
    ask_streaming(c, QUESTION)
    _, chat = ask_streaming(c, "What is the capital of France?")
    assert [m["role"] for m in chat] == ["user", "assistant"] * 2
    assert "No literature support" in last_reply(chat)  # an off-topic question retrieves nothing

    links, markdown, as_json = c.predict(api_name="/export")
    record = json.loads(as_json)
    assert [t["question"] for t in record["turns"]] == [QUESTION, "What is the capital of France?"]
    first, second = record["turns"]
    assert first["citations"] and {c["url"] for c in first["citations"]} <= CORPUS_URLS
    assert all(set(c) == {"n", "id", "title", "url", "source", "license", "text", "support"} and c["text"]
               for c in first["citations"])
    assert second["citations"] == [] and "relevant" in second["note"]
    assert "window" in first["window"] and first["frame"] == 1
    assert record["scan"] == {"format": "dicom", "frames": 1, "modality": "CT"}
    assert first["citations"][0]["url"] in markdown and QUESTION in markdown and "not a diagnosis" in markdown
    assert 'download="medvqa-conversation.md"' in links and 'download="medvqa-conversation.json"' in links
    embedded = re.search(r'href="data:application/json;charset=utf-8;base64,([^"]+)"', links).group(1)
    assert json.loads(b64decode(embedded)) == record
    for text in (markdown, as_json):  # nothing identifying: no file name, no DICOM identity fields
        assert "CT_small" not in text and "Patient" not in text

    chat, question, export_links = c.predict(api_name="/new_conversation")
    assert chat == [] and question == ""
    _, chat = ask_streaming(c, QUESTION)
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert len(json.loads(c.predict(api_name="/export")[2])["turns"]) == 1


def test_window_controls_change_what_is_shown_and_what_the_model_sees(app_url):
    c = client(app_url)
    shown = upload(c, dicom_file("CT_small.dcm"))
    before = image_src(shown["viewer"])
    viewer, preset, center, width, frame, meta, chat = c.predict("lung", 1, api_name="/set_preset")
    assert image_src(viewer) != before and "lung window (C -600 / W 1500)" in viewer
    assert (center["value"], width["value"]) == (-600, 1500) and preset["value"] == "lung"
    ask_streaming(c, QUESTION)

    viewer2, preset, *_ = c.predict(40, 80, 1, api_name="/set_window")
    assert image_src(viewer2) not in (before, image_src(viewer)) and "user window (C 40 / W 80)" in viewer2
    assert preset["value"] == "custom"
    ask_streaming(c, "Is the liver enlarged?")

    turns = json.loads(c.predict(api_name="/export")[2])["turns"]
    assert "lung window (C -600 / W 1500)" in turns[0]["window"]
    assert turns[1]["window"] == "user window (C 40 / W 80)"
    # Values typed beyond the sliders' ranges are taken as their nearest ends, never an error on the page.
    viewer3, _, center, width, *_ , chat = c.predict(-5000, 0, 1, api_name="/set_window")
    assert f"user window (C {center['minimum']:g} / W 1)" in viewer3 and width["value"] == 1
    assert "medvqa-error" not in last_reply(chat)


def test_multiframe_scan_has_a_frame_slider(app_url):
    c = client(app_url)
    shown = upload(c, dicom_file("rtdose.dcm"))  # 15 frames
    assert shown["frame"]["visible"] and shown["frame"]["maximum"] == 15 and shown["frame"]["value"] == 8
    viewer, *_ = c.predict(3, api_name="/set_frame")
    assert "frame 3 of 15" in viewer and image_src(viewer) != image_src(shown["viewer"])
    ask_streaming(c, QUESTION)
    assert json.loads(c.predict(api_name="/export")[2])["turns"][0]["frame"] == 3


def test_png_upload_has_no_window_controls(app_url, tmp_path):
    from PIL import Image

    path = tmp_path / "xray.png"
    Image.new("L", (96, 64), color=120).save(path)
    shown = upload(client(app_url), path)
    assert shown["meta"]["format"] == "png" and decoded_image(shown["viewer"]).size == (96, 64)
    assert not shown["preset"]["visible"] and not shown["center"]["visible"] and not shown["frame"]["visible"]


def test_16_bit_png_upload_is_windowed_over_its_own_values(app_url, tmp_path):
    import numpy as np
    from PIL import Image

    path = tmp_path / "ct-slice.png"
    Image.fromarray((np.arange(96 * 64).reshape(64, 96) * 10).astype(np.uint16)).save(path)  # 0 .. 61430
    c = client(app_url)
    shown = upload(c, path)
    assert shown["preset"]["visible"] and shown["center"]["visible"] and shown["width"]["visible"]
    assert [value for _, value in shown["preset"]["choices"]] == ["auto", "custom"]
    assert (shown["center"]["minimum"], shown["center"]["maximum"], shown["width"]["maximum"]) == (0, 61430, 61430)
    viewer, *_ = c.predict(20000, 10000, 1, api_name="/set_window")
    assert "user window (C 20000 / W 10000)" in viewer and image_src(viewer) != image_src(shown["viewer"])
    ask_streaming(c, QUESTION)
    assert json.loads(c.predict(api_name="/export")[2])["turns"][0]["window"] == "user window (C 20000 / W 10000)"
    # The CT presets are not offered, so Gradio itself refuses one (the handler would too); a DICOM
    # uploaded next gets them back.
    with pytest.raises(gradio_client.exceptions.AppError, match="lung is not in the list of choices"):
        c.predict("lung", 1, api_name="/set_preset")
    upload(c, dicom_file("CT_small.dcm"))
    assert "lung window" in c.predict("lung", 1, api_name="/set_preset")[0]
    # An MR is a DICOM in no Hounsfield units either: its own window, the automatic one and the sliders.
    shown = upload(c, dicom_file("MR_small.dcm"))
    assert shown["meta"]["Modality"] == "MR" and shown["preset"]["visible"]
    assert [value for _, value in shown["preset"]["choices"]] == ["file", "auto", "custom"]


def test_two_concurrent_sessions_see_only_their_own_scan_and_chat(app_url):
    scans = {"a": dicom_file("CT_small.dcm"), "b": dicom_file("MR_small.dcm")}
    questions = {"a": "Is there a pleural effusion on this CT?", "b": "Is there a lesion in the brain MRI?"}
    results, errors, stages = {}, [], {}
    start = threading.Barrier(2)

    def session(name: str) -> None:
        try:
            stages[name] = "upload"
            c = client(app_url)
            shown = upload(c, scans[name])
            stages[name] = "barrier"
            start.wait(timeout=60)
            stages[name] = "first question"
            ask_streaming(c, questions[name])
            stages[name] = "follow-up"
            _, chat = ask_streaming(c, questions[name] + " Follow-up.")
            stages[name] = "export"
            results[name] = (shown, chat, json.loads(c.predict(api_name="/export")[2]))
            stages[name] = "done"
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=session, args=(name,), name=f"session {name}", daemon=True) for name in scans]
    for thread in threads:
        thread.start()
    join_all(threads, timeout=300, stages=stages)
    assert not errors, errors
    for name, other in (("a", "b"), ("b", "a")):
        shown, chat, record = results[name]
        assert shown["meta"]["Modality"] == {"a": "CT", "b": "MR"}[name]
        users = [plain(text_of(m)) for m in chat if m["role"] == "user"]
        assert users == [questions[name], questions[name] + " Follow-up."]
        assert [t["question"] for t in record["turns"]] == users
        assert record["scan"]["modality"] == shown["meta"]["Modality"]
        assert not any(questions[other] in plain(text_of(m)) for m in chat)



# ── Errors: a message in the chat, and the app keeps serving ───────────────────────────────────

def test_oversize_upload_is_refused(app_url, tmp_path, upload_folder):
    big = tmp_path / "big.dcm"
    big.write_bytes(b"\0" * (MAX_UPLOAD_MB * 2**20 + 4096))
    c = client(app_url)
    with pytest.raises(Exception, match="exceeds the maximum file size"):  # the client checks first
        c.predict(handle_file(str(big)), api_name="/upload")
    import httpx  # and the server refuses it when a client does not

    with open(big, "rb") as handle:
        response = httpx.post(app_url + "gradio_api/upload", files={"files": ("big.dcm", handle)}, timeout=60)
    assert response.status_code == 413 and "maximum allowed size" in response.text
    assert not [p for p in upload_folder.rglob("*") if p.is_file()]
    assert_still_serving(c)

def test_corrupt_dicom_gives_a_message(app_url, tmp_path):
    corrupt = tmp_path / "corrupt.dcm"
    corrupt.write_bytes(Path(dicom_file("CT_small.dcm")).read_bytes()[:20_000])  # cut inside the pixel data
    c = client(app_url)
    shown = upload(c, corrupt)
    reply = last_reply(shown["chat"])
    assert "medvqa-error" in reply and "The scan could not be opened" in reply and "damaged" in reply
    assert "still open" not in reply  # no scan was open
    # With a scan open, the message says it still is, and the questions go on about it.
    upload(c, dicom_file("CT_small.dcm"))
    reply = last_reply(upload(c, corrupt)["chat"])
    assert "The scan shown before is still open, and questions are still about it." in reply
    assert_still_serving(c)


def test_empty_question_and_question_before_upload_give_messages(app_url):
    c = client(app_url)
    chat, _ = c.predict(QUESTION, api_name="/ask")
    assert "Please upload a scan first" in last_reply(chat)
    upload(c, dicom_file("CT_small.dcm"))
    chat, _ = c.predict("   ", api_name="/ask")
    assert "Please type a question" in last_reply(chat)
    assert_still_serving(c)


def test_retrieval_and_model_failures_are_shown_in_the_chat(app_url, ui_pipeline, monkeypatch):
    from medvqa.retrieval import RetrievalError

    c = client(app_url)
    upload(c, dicom_file("CT_small.dcm"))

    def broken_search(*args, **kwargs):
        raise RetrievalError("The index at /somewhere is damaged; rebuild it.")

    monkeypatch.setattr(ui_pipeline, "retrieve", broken_search)
    _, chat = ask_streaming(c, QUESTION)
    reply = last_reply(chat)
    assert "The literature search failed (the server&#x27;s log says why)" in reply and "/somewhere" not in reply
    assert "No literature support" in reply and "medvqa-source-link" not in reply

    def broken_stream(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")
        yield  # a generator, like the real one

    monkeypatch.setattr(ui_pipeline.engine, "stream", broken_stream)
    _, chat = ask_streaming(c, "And now?")
    assert "The model could not answer (RuntimeError)" in last_reply(chat)
    monkeypatch.undo()
    assert_still_serving(c)


def test_stop_ends_the_answer_and_the_app_keeps_serving(app_url, ui_pipeline, monkeypatch):
    monkeypatch.setattr(SlowPipeline, "token_delay_s", 0.5)
    c = client(app_url)
    upload(c, dicom_file("CT_small.dcm"))
    job = c.submit(QUESTION, api_name="/ask")
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until the first token is shown
        outputs = job.outputs()
        if outputs and "medvqa-status" not in last_reply(outputs[-1][0]):
            break
        time.sleep(0.05)
    chat = c.predict(api_name="/stop")
    assert last_reply(chat).endswith("_(stopped)_") and "medvqa-sources" not in last_reply(chat)
    turns = json.loads(c.predict(api_name="/export")[2])["turns"]
    assert len(turns) == 1 and turns[0]["stopped"] and turns[0]["question"] == QUESTION
    monkeypatch.undo()
    _, chat = ask_streaming(c, QUESTION)
    assert "medvqa-sources" in last_reply(chat) and len(chat) == 4


# ── Serving: private config, optional login ──────────────────────────────────────────────────

def test_served_config_is_private(app_url):
    import httpx

    config = httpx.get(app_url + "config", timeout=30).json()
    assert config["analytics_enabled"] is False and config["run_history"] is False
    assert config["max_file_size"] == MAX_UPLOAD_MB * 2**20 and config["show_error"] is False
    assert not config.get("mcp_server")
    named = {d.get("api_name") for d in config["dependencies"]}
    assert {"upload", "set_preset", "set_window", "set_frame", "ask", "stop", "new_conversation", "export"} <= named


def test_login_is_required_when_set(ui_pipeline, ui_settings, upload_folder):
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=MAX_UPLOAD_MB)
    _, url, _ = launch(demo, port=None, auth=("doc", "secret"), block=False, quiet=True)
    try:
        with pytest.raises(Exception):
            Client(url, verbose=False)
        with pytest.raises(Exception):
            Client(url, auth=("doc", "wrong"), verbose=False)
        c = Client(url, auth=("doc", "secret"), verbose=False)
        assert upload(c, dicom_file("CT_small.dcm"))["meta"]["Modality"] == "CT"
    finally:
        demo.close()



# ── Uploads that never reach the handler ───────────────────────────────────────────────────────

def stored_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_stray_upload_is_never_served_and_is_swept_within_a_minute(ui_app, upload_folder):
    """A file posted to Gradio's upload route with no /upload event after it: refused by the file
    route, and deleted by the app's sweeper once a minute old."""
    import httpx

    demo, url = ui_app
    uploads = demo.medvqa_uploads
    assert uploads.root == upload_folder.resolve() and uploads.max_age_s <= 60
    response = httpx.post(url + "gradio_api/upload", files={"files": ("stray.png", b"not read by any handler")},
                          timeout=30)
    (path,) = response.json()
    assert Path(path).is_file() and Path(path).resolve().parent.parent == upload_folder.resolve()
    for route in (f"gradio_api/file={path}", f"gradio_api/file/{path}", "gradio_api/file=" +
                  str(upload_folder / ".." / upload_folder.name / Path(path).relative_to(upload_folder))):
        assert httpx.get(url + route, timeout=30).status_code == 404, route
    uploads.sweep(now=time.time() + 30)
    assert Path(path).is_file(), "younger than a minute: kept (an /upload event may still come for it)"
    uploads.sweep(now=time.time() + uploads.max_age_s + 1)
    assert not Path(path).exists() and not stored_files(upload_folder)


def test_a_refused_upload_name_leaves_nothing_behind(app_url, upload_folder):
    import httpx

    response = httpx.post(app_url + "gradio_api/upload", files={"files": ("..", b"payload")}, timeout=30)
    assert response.status_code == 400 and "Invalid file name" in response.text
    assert not stored_files(upload_folder), "the refused upload left its temporary file"
    assert not [p for p in upload_folder.iterdir() if p.is_dir() and not any(p.iterdir())]
    assert_still_serving(client(app_url))


def test_a_closed_tab_is_forgotten_at_once(ui_app, ui_pipeline, monkeypatch):
    """Gradio would keep a closed tab's state an hour and every output it sent (the viewer's scan, the
    chat) until 10,000 newer sessions: the app drops the whole session when the tab goes away."""
    demo, url = ui_app
    ended = []
    monkeypatch.setattr(ui_pipeline, "end_conversation", lambda conversation, **_: ended.append(conversation.id))
    c = client(url)
    upload(c, dicom_file("CT_small.dcm"))
    ask_streaming(c, QUESTION)
    key = demo.medvqa_tabs.key(c.cookies.get("medvqa-browser"), c.session_hash)  # as Gradio sees it (tab_binding.py)
    assert key in demo.state_holder.session_data
    c.close()  # the tab goes away: its heartbeat ends
    deadline = time.time() + 30
    while key in demo.state_holder.session_data and time.time() < deadline:
        time.sleep(0.1)
    assert key not in demo.state_holder.session_data, "the closed tab's session is still held"
    deadline = time.time() + 10
    while not ended and time.time() < deadline:
        time.sleep(0.1)
    assert ended, "the pipeline was not told to forget the conversation"


def test_warming_after_an_upload_is_an_endpoint_for_scripts(app_url, ui_pipeline):
    """/warm (undocumented, what the page chains to an upload): the session's prompt up to the question
    is cached for a client that drives the app without the page."""
    c = client(app_url)
    upload(c, dicom_file("CT_small.dcm"))
    before = set(ui_pipeline.engine.prefixes.keys())
    c.predict("", api_name="/warm")
    added = [key for key in ui_pipeline.engine.prefixes.keys() if key not in before]
    assert len(added) == 1
    assert len(ui_pipeline.engine.prefixes.get(added[0]).ids) > ui_pipeline.model.vision.num_tokens
