"""What the web app's tests share: a small real literature index, the tiny-profile pipeline that
searches it, the app served on a loopback port, and helpers that drive it through gradio_client.

The app runs in the test process on a free loopback port, serving a tiny-profile pipeline whose
retriever searches a few dozen passages (all-MiniLM-L6-v2, built here) with PubMed-style URLs.
Uploads are pydicom's own test files. The decoder samples (temperature 1) so that the random tiny
model writes several tokens, and each token is slowed a little so that streaming is observable.

The fixtures are module-scoped: a test module imports the ones it uses (tests/test_browser.py gets
them through tests/test_ui.py).
"""

from __future__ import annotations

import copy
import io
import json
import re
import time
from base64 import b64decode
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

from medvqa.pipeline import Pipeline, Token  # noqa: E402

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
    """One of pydicom's own test files (skips the test where they are not installed)."""
    import pydicom.data

    path = pydicom.data.get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"pydicom test file {name} is not installed")
    return str(path)


# ── Fixtures ──────────────────────────────────────────────────────────────────────────────────

@pytest.fixture(scope="module")
def ui_settings(tiny_settings, tmp_path_factory):
    """The tiny profile with retrieval on over the CORPUS above, indexed here."""
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
def ui_app(ui_pipeline, ui_settings, upload_folder):
    """The app served on a free loopback port for the module's tests: (demo, url)."""
    from medvqa.ui import build_app, launch

    demo = build_app(ui_pipeline, ui_settings, max_upload_mb=MAX_UPLOAD_MB)
    _, url, _ = launch(demo, host="127.0.0.1", port=None, max_upload_mb=MAX_UPLOAD_MB, block=False, quiet=True)
    yield demo, url
    demo.close()


@pytest.fixture(scope="module")
def app_url(ui_app):
    return ui_app[1]


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


def assert_still_serving(c: Client) -> None:
    """After an error: the same client can still upload, ask and get an answer with sources."""
    shown = upload(c, dicom_file("CT_small.dcm"))
    assert shown["meta"]["Modality"] == "CT"
    _, chat = ask_streaming(c, QUESTION)
    assert "medvqa-sources" in last_reply(chat)
