"""The web app end to end through gradio_client, on the tiny profile with a small real index.

The app runs in this process on a free loopback port, serving a tiny-profile pipeline whose
retriever searches a few dozen passages (all-MiniLM-L6-v2, built here) with PubMed-style URLs.
Uploads are pydicom's own test files. The decoder samples (temperature 1) so that the random tiny
model writes several tokens, and each token is slowed a little so that streaming is observable.
"""

from __future__ import annotations

import copy
import io
import json
import re
import threading
import time
from base64 import b64decode
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

from medvqa.pipeline import Pipeline, Token  # noqa: E402

from .conftest import prompt_gate  # noqa: E402

PUBMED = "https://pubmed.ncbi.nlm.nih.gov/{}/"
CORPUS = [
    ("31001001", "Pleural effusion on chest CT", "Computed tomography of the chest shows a moderate right pleural "
     "effusion with compressive atelectasis of the adjacent lower lobe."),
    ("31001002", "Ultrasound of pleural effusions", "Thoracic ultrasound detects small pleural effusions more "
     "sensitively than the supine chest radiograph and guides thoracentesis."),
    ("31001003", "Malignant pleural effusion", "Malignant pleural effusion is a frequent complication of lung and "
     "breast cancer; CT may show pleural nodularity and thickening."),
    ("31001004", "Pneumothorax after biopsy", "Pneumothorax is the most common complication of CT-guided lung "
     "biopsy; most are small and resolve without a chest tube."),
    ("31001005", "Pulmonary embolism on CT angiography", "CT pulmonary angiography shows filling defects in the "
     "segmental pulmonary arteries in acute pulmonary embolism."),
    ("31001006", "Cardiomegaly on radiographs", "A cardiothoracic ratio above 0.5 on a posteroanterior chest "
     "radiograph suggests cardiomegaly."),
    ("31001007", "Lung nodules", "Solid pulmonary nodules smaller than 6 mm in low-risk patients need no routine "
     "follow-up CT according to the Fleischner Society guidelines."),
    ("31001008", "Consolidation in pneumonia", "Lobar consolidation with air bronchograms on chest CT is typical "
     "of bacterial pneumonia."),
    ("31001009", "Emphysema quantification", "Low attenuation areas below -950 HU on inspiratory CT quantify "
     "emphysema in chronic obstructive pulmonary disease."),
    ("31001010", "Lung window settings", "A lung window of level -600 HU and width 1500 HU shows the pulmonary "
     "parenchyma, while a mediastinal window shows soft tissue."),
    ("31001011", "Acute appendicitis", "Abdominal CT in acute appendicitis shows a dilated appendix with "
     "periappendiceal fat stranding."),
    ("31001012", "Liver metastases", "Contrast-enhanced CT of the liver shows multiple hypodense metastases in "
     "colorectal cancer."),
    ("31001013", "Kidney stones", "Non-contrast CT detects urinary tract calculi with high sensitivity."),
    ("31001014", "Splenic injury", "CT grades splenic laceration after blunt abdominal trauma."),
    ("31001015", "Brain MRI in multiple sclerosis", "T2-weighted MRI of the brain shows periventricular "
     "hyperintense lesions in multiple sclerosis."),
    ("31001016", "Glioblastoma", "Glioblastoma appears as a ring-enhancing mass with central necrosis on "
     "contrast-enhanced T1-weighted MRI."),
    ("31001017", "Acute ischaemic stroke", "Non-contrast head CT excludes haemorrhage before thrombolysis in acute "
     "ischaemic stroke."),
    ("31001018", "Subdural haematoma", "A crescent-shaped hyperdense extra-axial collection on head CT indicates "
     "an acute subdural haematoma."),
    ("31001019", "Tibial plateau fracture", "CT characterises depressed tibial plateau fractures before surgery."),
    ("31001020", "Scaphoid fracture", "MRI detects occult scaphoid fractures missed on initial radiographs."),
    ("31001021", "Knee meniscal tear", "MRI shows meniscal tears as intrameniscal signal reaching the articular "
     "surface."),
    ("31001022", "Osteoporotic vertebral fracture", "Vertebral compression fractures are a hallmark of "
     "osteoporosis on spine radiographs."),
    ("31001023", "Breast mass on mammography", "A spiculated mass on mammography is highly suspicious of "
     "malignancy."),
    ("31001024", "Thyroid nodule ultrasound", "Microcalcifications in a hypoechoic thyroid nodule raise the "
     "suspicion of papillary carcinoma."),
    ("31001025", "Aortic dissection", "CT angiography shows an intimal flap separating true and false lumen in "
     "aortic dissection."),
    ("31001026", "Abdominal aortic aneurysm", "An infrarenal aortic diameter above 3 cm defines an abdominal "
     "aortic aneurysm."),
    ("31001027", "Diabetic retinopathy", "Fundus photographs show microaneurysms and hard exudates in diabetic "
     "retinopathy."),
    ("31001028", "Pericardial effusion", "Echocardiography shows a circumferential pericardial effusion with "
     "diastolic collapse of the right ventricle in tamponade."),
    ("31001029", "Hepatic steatosis", "Liver attenuation lower than the spleen on non-contrast CT indicates "
     "hepatic steatosis."),
    ("31001030", "Small bowel obstruction", "Dilated small bowel loops with a transition point on CT indicate "
     "small bowel obstruction."),
]
CORPUS_URLS = {PUBMED.format(pmid) for pmid, _, _ in CORPUS}
QUESTION = "Is there a pleural effusion?"
EFFUSION_URLS = {PUBMED.format(pmid) for pmid in ("31001001", "31001002", "31001003")}
MAX_UPLOAD_MB = 1


class SlowPipeline(Pipeline):
    """The real pipeline with each streamed token slowed, so a client can watch the stream."""

    token_delay_s = 0.03

    def ask(self, *args, **kwargs):
        for event in super().ask(*args, **kwargs):
            if isinstance(event, Token):
                time.sleep(self.token_delay_s)
            yield event


def dicom_file(name: str) -> str:
    import pydicom.data

    path = pydicom.data.get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"pydicom test file {name} is not installed")
    return str(path)


# ── Fixtures (imported by test_browser.py too) ─────────────────────────────────────────────────

@pytest.fixture(scope="module")
def ui_settings(tiny_settings, tmp_path_factory):
    from medvqa.retrieval import build_index

    settings = copy.deepcopy(tiny_settings)
    settings.decoder.temperature = 1.0  # a random model sampled writes several tokens before EOS
    settings.decoder.max_new_tokens = 16
    settings.decoder.constrained_closed = False  # stream free text for yes/no questions too
    root = tmp_path_factory.mktemp("ui-index")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"pmid{pmid}", "text": text, "title": title,
                                          "url": PUBMED.format(pmid), "source": "PubMed",
                                          "license": "abstract"}) + "\n" for pmid, title, text in CORPUS))
    build_index([str(corpus)], root / "ui", settings.retrieval.embedder, progress=False, device="cpu")
    settings.retrieval.enabled = True
    settings.retrieval.index_dir = str(root)
    settings.retrieval.index_name = "ui"
    settings.retrieval.corpus = [str(corpus)]
    settings.retrieval.device = "cpu"
    settings.retrieval.min_dense_score = 0.3
    return settings


@pytest.fixture(scope="module")
def ui_pipeline(ui_settings):
    return SlowPipeline.load(ui_settings, with_retrieval=True, progress=False)


@pytest.fixture(scope="module")
def upload_folder(tmp_path_factory):
    """Gradio's upload folder for this module's app, so the test can check what is left in it."""
    import os

    folder = tmp_path_factory.mktemp("gradio-uploads")
    previous = os.environ.get("GRADIO_TEMP_DIR")
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("GRADIO_TEMP_DIR", None)
    else:
        os.environ["GRADIO_TEMP_DIR"] = previous


@pytest.fixture(scope="module")
def app_url(ui_pipeline, ui_settings, upload_folder):
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=MAX_UPLOAD_MB)
    _, url, _ = launch(demo, host="127.0.0.1", port=None, max_upload_mb=MAX_UPLOAD_MB, block=False, quiet=True)
    yield url
    demo.close()


def client(url: str) -> Client:
    return Client(url, verbose=False)


# ── Helpers ────────────────────────────────────────────────────────────────────────────────────

def text_of(message: dict) -> str:
    content = message["content"]
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def plain(text: str) -> str:
    """A user message as the chat shows it (the app escapes Markdown and HTML in it)."""
    import html

    return html.unescape(re.sub(r"\\(.)", r"\1", text))


def last_reply(chat: list[dict]) -> str:
    assert chat and chat[-1]["role"] == "assistant", chat
    return text_of(chat[-1])


def image_src(viewer_html: str) -> str:
    match = re.search(r'src="(data:image/png;base64,[^"]+)"', viewer_html)
    assert match, viewer_html[:200]
    return match.group(1)


def decoded_image(viewer_html: str):
    from PIL import Image

    return Image.open(io.BytesIO(b64decode(image_src(viewer_html).split(",", 1)[1])))


def upload(c: Client, path: str | Path) -> dict:
    out = c.predict(handle_file(str(path)), api_name="/upload")
    _, viewer, preset, center, width, frame, meta, chat = out
    return {"viewer": viewer, "preset": preset, "center": center, "width": width, "frame": frame,
            "meta": meta, "chat": chat}


def ask_streaming(c: Client, question: str) -> tuple[list[str], list[dict]]:
    """Every assistant text seen while the answer streamed, and the final chat."""
    job = c.submit(question, api_name="/ask")
    seen = []
    for chat, _ in job:
        if chat and chat[-1]["role"] == "assistant":
            text = last_reply(chat)
            if not seen or seen[-1] != text:
                seen.append(text)
    final_chat = job.outputs()[-1][0]
    return seen, final_chat


def answer_part(reply: str) -> str:
    return reply.split('<div class="medvqa-sources', 1)[0].strip()


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
    assert all(set(c) == {"n", "id", "title", "url", "source", "license"} for c in first["citations"])
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


def test_two_concurrent_sessions_see_only_their_own_scan_and_chat(app_url):
    scans = {"a": dicom_file("CT_small.dcm"), "b": dicom_file("MR_small.dcm")}
    questions = {"a": "Is there a pleural effusion on this CT?", "b": "Is there a lesion in the brain MRI?"}
    results, errors = {}, []
    start = threading.Barrier(2)

    def session(name: str) -> None:
        try:
            c = client(app_url)
            shown = upload(c, scans[name])
            start.wait(timeout=60)
            ask_streaming(c, questions[name])
            _, chat = ask_streaming(c, questions[name] + " Follow-up.")
            results[name] = (shown, chat, json.loads(c.predict(api_name="/export")[2]))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=session, args=(name,)) for name in scans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
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

def assert_still_serving(c: Client) -> None:
    shown = upload(c, dicom_file("CT_small.dcm"))
    assert shown["meta"]["Modality"] == "CT"
    _, chat = ask_streaming(c, QUESTION)
    assert "medvqa-sources" in last_reply(chat)


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


def test_oversize_file_reaching_the_handler_is_refused_with_a_message(tmp_path, ui_pipeline, upload_folder):
    """Where Gradio's own limit is off (or larger), the handler still refuses and says why."""
    from medvqa.ui import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)
    folder = upload_folder / "abc123"
    folder.mkdir()
    big = folder / "big.dcm"
    big.write_bytes(b"\0" * (MAX_UPLOAD_MB * 2**20 + 1))
    _, viewer, *_, chat, session = handlers.upload({"path": str(big)}, None)
    assert "larger than the 1 MB upload limit" in last_reply(chat) and session is None
    assert not folder.exists(), "the refused upload is deleted too"


def test_warming_caches_the_prompt_up_to_the_question_and_never_a_replaced_conversation(
        ui_pipeline, upload_folder):
    """What the app runs after a scan is shown (Handlers.warm, chained to upload, window, frame and
    new conversation): the conversation's prompt up to the question is cached; nothing is cached
    while an answer runs or for a conversation replaced while it warmed."""
    import shutil

    from medvqa.ui import _Handlers

    handlers = _Handlers(ui_pipeline, ui_pipeline.settings, max_upload_mb=MAX_UPLOAD_MB)

    def upload_session():
        folder = upload_folder / f"warm{len(list(upload_folder.iterdir()))}"
        folder.mkdir()
        path = shutil.copy(dicom_file("CT_small.dcm"), folder / "scan.dcm")
        *_, session = handlers.upload({"path": str(path)}, None)
        return session

    session = upload_session()
    handlers.warm(session)
    state = ui_pipeline.prefix_cache.get(session.conversation.id)
    assert state is not None and len(state.ids) > ui_pipeline.vision.num_tokens
    # Typing in the question box warms the prompt for the question so far, all but its last token.
    with prompt_gate(ui_pipeline, "never"):  # the offline profile's: the question follows no passages
        handlers.warm(session, "Is there an effusion?")
    typed = ui_pipeline.prefix_cache.get(session.conversation.id)
    window = ui_pipeline._prompt_window(session.conversation)
    prompt = ui_pipeline.prompts.build("Is there an effusion?", (), (), window)
    assert len(typed.ids) == len(prompt) - 1 > len(state.ids)
    session.close()

    busy = upload_session()
    busy.current = object()  # an answer is streaming: it warms its own next turn
    handlers.warm(busy)
    assert ui_pipeline.prefix_cache.get(busy.conversation.id) is None
    busy.current = None

    replaced = upload_session()
    old = replaced.conversation
    original = ui_pipeline.warm_next_turn

    def warm_while_the_window_changes(conversation, draft=""):
        done = original(conversation, draft)
        replaced.look_at(replaced.scan)  # the clinician changed the window meanwhile
        return done

    ui_pipeline.warm_next_turn = warm_while_the_window_changes
    try:
        handlers.warm(replaced)
    finally:
        del ui_pipeline.warm_next_turn
    assert ui_pipeline.prefix_cache.get(old.id) is None and replaced.conversation is not old
    replaced.close()


def test_corrupt_dicom_gives_a_message(app_url, tmp_path):
    corrupt = tmp_path / "corrupt.dcm"
    corrupt.write_bytes(Path(dicom_file("CT_small.dcm")).read_bytes()[:20_000])  # cut inside the pixel data
    c = client(app_url)
    shown = upload(c, corrupt)
    reply = last_reply(shown["chat"])
    assert "medvqa-error" in reply and "The scan could not be opened" in reply and "damaged" in reply
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
    assert "The literature search failed (The index at /somewhere is damaged" in reply
    assert "No literature support" in reply and "medvqa-source-link" not in reply

    def broken_stream(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")
        yield  # a generator, like the real one

    monkeypatch.setattr(ui_pipeline.decoder, "stream", broken_stream)
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


# ── Rendering: model text cannot make links; citations link only to passage URLs ──────────────

def test_model_text_is_inert_and_markers_link_to_passages():
    from medvqa.retrieval import Passage
    from medvqa.ui import _Answer, _render_answer

    passages = [Passage("p1", "Effusion <b>text</b> & more", "https://pubmed.ncbi.nlm.nih.gov/1/", "T1", "PubMed",
                        "", 1.0),
                Passage("p2", "Other", "javascript:alert(1)", "T2", "", "", 0.5)]
    answer = _Answer("q", scan=None, passages=passages, text=(
        "Yes [1], see [2] and [7]. <script>alert(1)</script> [click](https://evil.example/x) "
        "https://evil.example www.evil.example mail@evil.example ![img](https://evil.example/i.png)"))
    rendered = _render_answer(answer, final=True)
    hrefs = re.findall(r'href="([^"]+)"', rendered)
    assert hrefs == ["https://pubmed.ncbi.nlm.nih.gov/1/", "https://pubmed.ncbi.nlm.nih.gov/1/"]
    assert '<a class="medvqa-cite" href="https://pubmed.ncbi.nlm.nih.gov/1/"' in rendered  # the [1] marker
    assert "<script>" not in rendered and "&lt;script&gt;" in rendered
    assert "https://evil" not in rendered and "www.evil" not in rendered and "@evil" not in rendered
    assert "\\[7\\]" in rendered  # a marker with no passage stays text
    assert "javascript:" not in rendered.split("<details>")[0].split("T2")[0] and "T2" in rendered
    assert "Effusion &lt;b&gt;text&lt;/b&gt; &amp; more" in rendered


def test_auth_from_env():
    from medvqa.ui import auth_from_env

    assert auth_from_env({}) is None
    assert auth_from_env({"MEDVQA_USERNAME": "doc", "MEDVQA_PASSWORD": "pw"}) == ("doc", "pw")
    with pytest.raises(ValueError, match="both"):
        auth_from_env({"MEDVQA_USERNAME": "doc"})


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


def test_app_refuses_half_a_login(monkeypatch, capsys):
    import app

    monkeypatch.setenv("MEDVQA_USERNAME", "doc")
    monkeypatch.delenv("MEDVQA_PASSWORD", raising=False)
    assert app.main(["--profile", "tiny"]) == 2
    assert "MEDVQA_PASSWORD" in capsys.readouterr().err
