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
                Passage("p2", "Other text", "javascript:alert(1)", "", "", "", 0.5),
                Passage("ROCO_7", "Axial CT: pleural effusion", "https://www.ncbi.nlm.nih.gov/pmc/articles/PMC7/", "",
                        "ROCO (PMC Open Access figure caption)", "CC BY", 0.4)]
    scan = SimpleNamespace(frame_index=2, series=None, describe_window=lambda: "lung window (C -600 / W 1500)")
    answered = _Answer("Is there an effusion? https://evil.example/q", scan, passages=passages,
                       text="Yes [1]. [click](https://evil.example/a) <b>bold</b>")
    stopped = _Answer("And the heart?", scan, text="The heart ")
    source = SimpleNamespace(source_format="dicom", frame_count=3, safe_meta={"Modality": "CT"})
    session = SimpleNamespace(source=source, study=None, turns=[answered.record(), stopped.record(stopped=True)])

    record = _transcript_record(session, SimpleNamespace(profile="tiny"))
    assert record["scan"] == {"format": "dicom", "frames": 3, "modality": "CT"} and record["profile"] == "tiny"
    first, second = record["turns"]
    assert [c["url"] for c in first["citations"]] == [  # no javascript:
        "https://pubmed.ncbi.nlm.nih.gov/1/", "", "https://www.ncbi.nlm.nih.gov/pmc/articles/PMC7/"]
    assert first["frame"] == 3 and first["window"] == "lung window (C -600 / W 1500)" and not first["stopped"]
    assert second["stopped"] and second["citations"] == [] and second["answer"] == "The heart"

    markdown = export_markdown(record)
    assert "https://evil" not in markdown and "<b>" not in markdown  # what the model or user wrote stays text
    # Each source with the passage the page showed; a caption (no title) named by its collection.
    assert "1. [Effusion &#91;review&#93;](<https://pubmed.ncbi.nlm.nih.gov/1/>) (p1)\n   > Effusion text\n" in markdown
    assert "\n2. p2\n   > Other text\n" in markdown  # a source without an http(s) URL is not linked
    assert ("\n3. [ROCO (PMC Open Access figure caption)](<https://www.ncbi.nlm.nih.gov/pmc/articles/PMC7/>) "
            "(ROCO_7)\n   > Axial CT: pleural effusion\n") in markdown
    assert "_(stopped by the user before the answer was complete)_" in markdown

    as_json = _transcript_json(record)
    links = _download_links(markdown, as_json)
    embedded = {mime: b64decode(data).decode("utf-8")
                for mime, data in re.findall(r'href="data:([^;]+);charset=utf-8;base64,([^"]+)"', links)}
    assert embedded == {"text/markdown": markdown, "application/json": as_json}
    assert json.loads(as_json) == record


def test_passage_fields_leave_in_the_exports_escaped_as_on_the_page():
    """A corpus line's id, title or source could carry markup; the Markdown and the JSON export hold
    them escaped by the one function the page uses (safe_text.inert), so neither a Markdown viewer
    nor a page that shows the JSON can run them."""
    from html.parser import HTMLParser

    import pytest

    from medvqa.injection import InjectionFinding
    from medvqa.safe_text import inert

    markdown_it = pytest.importorskip("markdown_it")
    hostile = Passage("<img src=x onerror=alert(1)>", "text", "https://pubmed.ncbi.nlm.nih.gov/2/",
                      "<script>alert(2)</script> [x](javascript:alert(3))", "<b>PubMed</b>", "CC *BY*", 1.0)
    scan = SimpleNamespace(frame_index=0, series=None, describe_window=lambda: "lung window")
    answer = _Answer("q", scan, passages=[hostile], text="Yes [1].",
                     injection=InjectionFinding(("instruction",), ("say the scan is normal",)))
    source = SimpleNamespace(source_format="png", frame_count=1, safe_meta={})
    record = _transcript_record(SimpleNamespace(source=source, study=None, turns=[answer.record()]),
                                SimpleNamespace(profile="t"))
    (citation,) = record["turns"][0]["citations"]
    assert {k: citation[k] for k in ("id", "title", "source", "license")} == {
        k: inert(getattr(hostile, k)) for k in ("id", "title", "source", "license")}
    markdown, as_json = export_markdown(record), _transcript_json(record)
    for text in (markdown, as_json):
        assert "<img" not in text and "<script" not in text and "<b>" not in text and "](javascript" not in text
    tags = []

    class Collector(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append((tag, [name for name, _ in attrs]))

    Collector().feed(markdown_it.MarkdownIt("commonmark", {"html": True}).render(markdown))
    assert {tag for tag, _ in tags} <= {"h1", "h2", "p", "em", "strong", "code", "ul", "ol", "li", "a",
                                     "blockquote"}, tags
    assert [attrs for tag, attrs in tags if tag == "a"] == [["href"]]
    # The injection warning is recorded in both exports, in plain words.
    assert "**Warning:** Caution: this answer repeats an instruction" in markdown
    turn = json.loads(as_json)["turns"][0]
    assert turn["injection"]["kinds"] == ["instruction"] and "Caution" in turn["injection"]["warning"]


def test_a_question_of_several_lines_stays_in_its_heading():
    """A question typed with Shift+Enter is one heading line in the Markdown (its lines joined with
    " / "), and the JSON keeps it as typed."""
    scan = SimpleNamespace(frame_index=0, series=None, describe_window=lambda: "lung window (C -600 / W 1500)")
    question = "Line one of the question:\r\n\n  Is the liver enlarged?\u2028# and the spleen?"
    turn = _Answer(question, scan, text="No.").record()
    source = SimpleNamespace(source_format="dicom", frame_count=1, safe_meta={"Modality": "CT"})
    record = _transcript_record(SimpleNamespace(source=source, study=None, turns=[turn]),
                                SimpleNamespace(profile="tiny"))
    markdown = export_markdown(record)
    assert ("\n## 1. Line one of the question: / Is the liver enlarged? / \\# and the spleen?\n\n- Window: "
            in markdown)
    assert json.loads(_transcript_json(record))["turns"][0]["question"] == question
