"""The conversation download: one record of a session's turns, as Markdown and as JSON.

Called "transcript" here because "export" in this project also names the LLaVA checkpoint export
(medvqa/hf_export.py); the app's button and its API endpoint (`/export`) keep their names.

The record holds questions, answers, citations (with the passage shown) and windows, never patient data or the image, and
the downloads are inline data: links, so nothing is written to disk. A citation's passage fields are
made inert (`safe_text.inert`) once, when the record is built, so the JSON, the Markdown made from
it and the page show them escaped the same way; its URL is kept only when it is a plain http(s) link.
An answer flagged by the injection check (medvqa/injection.py) carries the warning in both.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
from typing import TYPE_CHECKING

from ..confidence import confidence_text
from ..imaging import burned_in
from ..safe_text import inert, other_host, safe_url
from .render import _escape_model_text, dropped_turns_note

if TYPE_CHECKING:
    from ..config import Settings
    from ..retrieval import Passage
    from .session import _Session


def _citation(n: int, passage: Passage) -> dict:
    """Passage `n` of a turn as the record keeps it: fields inert, a URL other than http(s) left out."""
    return {"n": n, "id": inert(passage.id), "title": inert(passage.title), "url": safe_url(passage.url),
            "source": inert(passage.source), "license": inert(passage.license), "text": inert(passage.text)}


def _transcript_record(session: _Session, settings: Settings) -> dict:
    """The session's answered (and stopped) turns with what scan they were about, minus identity."""
    source = session.source
    return {
        "tool": "MedVQA",
        "notice": "Research tool, not a diagnosis.",
        "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "profile": settings.profile,
        "scan": {"format": source.source_format, "frames": source.frame_count,
                 "modality": source.safe_meta.get("Modality", ""),
                 **({"burned_in_annotation": True} if _burned_in(session) else {}),
                 **({"series": [{"series": s.number, "modality": s.modality, "slices": s.frame_count}
                                for s in session.study.series]} if session.study else {})},
        "turns": [dict(turn) for turn in session.turns],
    }


def _burned_in(session: _Session) -> bool:
    """Whether the scan shown, or any slice of its series, says text is burned into its pixels."""
    source = session.source  # a Series counts its slices; a file's own tags say it for all its frames
    return bool(getattr(source, "burned_in_slices", 0)) or burned_in(source.safe_meta)


def _transcript_json(record: dict) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False)


def export_markdown(record: dict) -> str:
    """The record as a Markdown document a clinician can keep or paste."""
    lines = ["# MedVQA conversation", "",
             f"_{record['notice']}_ Exported {record['exported_at']} (profile `{record['profile']}`). "
             + ("No patient data from the scan's tags, and no image; but the scan says text is burned into its "
                "pixels, which often names the patient, and an answer could repeat it: read the answers before "
                "sharing this." if record["scan"].get("burned_in_annotation") else "No patient data."), "",
             f"Scan: {record['scan']['format'].upper()}"
             + (f", {record['scan']['modality']}" if record['scan']['modality'] else "")
             + (f", {len(record['scan']['series'])} series" if record['scan'].get('series') else
                f", {record['scan']['frames']} frame(s)") + ".", ""]
    for number, turn in enumerate(record["turns"], start=1):
        # Question and answer are escaped like in the chat: a link the model wrote stays text.
        lines += [f"## {number}. {_heading(turn['question'])}", "",
                  f"- Window: {turn['window']}; {_markdown_place(turn)}", "",
                  _escape_model_text(turn["answer"]) or "_(no answer)_", ""]
        if turn["stopped"]:
            lines += ["_(stopped by the user before the answer was complete)_", ""]
        if turn.get("closed"):
            lines += [f"- Confidence: {confidence_text(turn['closed'])}"
                      + ("; not answered (uncertain)" if turn["closed"]["abstained"] else "")
                      + (("; the same leaning without the image" if turn["closed"]["abstained"] else
                          "; the same answer without the image")
                         if turn.get("image_reliance", {}).get("flagged") else ""),
                      ""]
            if turn["closed"].get("reading"):
                lines[-2:-2] = [f"- {_escape_model_text(turn['closed']['reading'])}"]  # before the confidence
        if turn.get("answered_by"):
            lines += [f"- {_escape_model_text(turn['answered_by']['note'])}", ""]
        if turn.get("earlier_turns_not_read"):
            lines += [f"- {dropped_turns_note(int(turn['earlier_turns_not_read']))}", ""]
        if turn.get("injection"):
            lines += [f"**Warning:** {_escape_model_text(turn['injection']['warning'])}", ""]
        if turn["citations"]:
            lines.append("Sources:" if turn.get("citations_read_by_model", True) else
                         "Related literature (not read by the model):")
            lines += [_markdown_citation(citation) for citation in turn["citations"]]
            lines.append("")
        elif not turn["stopped"]:
            lines += [f"No literature support. {turn.get('note', '')}".strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def _heading(question: str) -> str:
    """The question on the one line a Markdown heading has: the lines of a question typed with
    Shift+Enter joined with " / " (the JSON keeps them as typed), so none falls out of the heading."""
    return " / ".join(_escape_model_text(line.strip()) for line in question.splitlines() if line.strip())


def _markdown_place(turn: dict) -> str:
    if "series" not in turn:
        return f"frame {turn['frame']}"
    position = f" ({turn['position_mm']:g} mm)" if turn.get("position_mm") is not None else ""
    return f"series {turn['series']}, slice {turn['slice']} of {turn['slices']}{position}"


def _markdown_citation(citation: dict) -> str:
    """One numbered source and, quoted under it, the passage the page showed. Fields are inert already
    (and inert() again changes nothing, so a record built elsewhere is escaped too); the URL is linked
    only when it is a plain http(s) link. A caption has no title: it is named by its collection."""
    label = inert(citation["title"] or citation.get("source") or citation["id"])
    url = safe_url(citation["url"])
    host = f"; link to {inert(other_host(url))}" if other_host(url) else ""  # not PubMed or PMC: where it goes
    line = (f"{citation['n']}. [{label}](<{url}>) ({inert(citation['id'])}{host})" if url
            else f"{citation['n']}. {label}")
    text = inert(citation.get("text", ""))
    return f"{line}\n   > {text}" if text else line


def _download_link(name: str, mime: str, text: str, label: str) -> str:
    encoded = base64.b64encode(text.encode("utf-8")).decode("ascii")
    return f'<a download="{name}" href="data:{mime};charset=utf-8;base64,{encoded}">{html.escape(label)}</a>'


def _download_links(markdown: str, as_json: str, burned_in_annotation: bool = False) -> str:
    """The two downloads and a line saying what they hold (and do not)."""
    held = ("no data from the scan's tags, no image; the scan says text is burned into its pixels, which an "
            "answer could repeat: read the answers before sharing it." if burned_in_annotation
            else "no patient data, no image.")
    return (f'<p>{_download_link("medvqa-conversation.md", "text/markdown", markdown, "Download Markdown")} · '
            f'{_download_link("medvqa-conversation.json", "application/json", as_json, "Download JSON")}</p>'
            f'<p class="medvqa-caption">The export holds questions, answers, cited passages and windows; '
            f'{held}</p>')
