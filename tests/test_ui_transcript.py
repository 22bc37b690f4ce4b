"""The conversation download (medvqa/ui/transcript.py): what a turn's record keeps, and that the
Markdown keeps model text inert and links only to the passages' http(s) URLs.

The download through the app (/export after a real conversation) is tested end to end in
tests/test_ui.py; these build the record by hand, without a model.
"""

from __future__ import annotations

import json
import re
from base64 import b64decode
from types import SimpleNamespace

from medvqa.retrieval import Passage
from medvqa.ui import export_markdown
from medvqa.ui.session import _Answer
from medvqa.ui.transcript import _download_links, _transcript_json, _transcript_record


def test_transcript_keeps_turns_and_citations_and_model_text_makes_no_links():
    passages = [Passage("p1", "Effusion text", "https://pubmed.ncbi.nlm.nih.gov/1/", "Effusion [review]", "PubMed",
                        "abstract", 1.0),
                Passage("p2", "Other text", "javascript:alert(1)", "", "", "", 0.5)]
    scan = SimpleNamespace(frame_index=2, describe_window=lambda: "lung window (C -600 / W 1500)")
    answered = _Answer("Is there an effusion? https://evil.example/q", scan, passages=passages,
                       text="Yes [1]. [click](https://evil.example/a) <b>bold</b>")
    stopped = _Answer("And the heart?", scan, text="The heart ")
    source = SimpleNamespace(source_format="dicom", frame_count=3, safe_meta={"Modality": "CT"})
    session = SimpleNamespace(source=source, turns=[answered.record(), stopped.record(stopped=True)])

    record = _transcript_record(session, SimpleNamespace(profile="tiny"))
    assert record["scan"] == {"format": "dicom", "frames": 3, "modality": "CT"} and record["profile"] == "tiny"
    first, second = record["turns"]
    assert [c["url"] for c in first["citations"]] == ["https://pubmed.ncbi.nlm.nih.gov/1/", ""]  # no javascript:
    assert first["frame"] == 3 and first["window"] == "lung window (C -600 / W 1500)" and not first["stopped"]
    assert second["stopped"] and second["citations"] == [] and second["answer"] == "The heart"

    markdown = export_markdown(record)
    assert "https://evil" not in markdown and "<b>" not in markdown  # what the model or user wrote stays text
    assert "1. [Effusion \\[review\\]](<https://pubmed.ncbi.nlm.nih.gov/1/>) (p1)" in markdown
    assert "\n2. p2\n" in markdown  # a source without an http(s) URL is not linked
    assert "_(stopped by the user before the answer was complete)_" in markdown

    as_json = _transcript_json(record)
    links = _download_links(markdown, as_json)
    embedded = {mime: b64decode(data).decode("utf-8")
                for mime, data in re.findall(r'href="data:([^;]+);charset=utf-8;base64,([^"]+)"', links)}
    assert embedded == {"text/markdown": markdown, "application/json": as_json}
    assert json.loads(as_json) == record
