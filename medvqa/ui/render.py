"""The chat's HTML: answers with their citation markers linked, the sources panel, status and errors.

Everything the model (or the user) wrote is made inert here before Gradio's Markdown sees it: no
HTML, no Markdown, no autolinks. The only anchors are built from `Passage.url` of the passages an
answer was given, and only for http(s) URLs.
"""

from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..retrieval import Passage
    from .session import _Answer

_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")
_MARKER = re.compile(r"\\\[(\d{1,2}(?:\s*,\s*\d{1,2})*)\\\]")  # an escaped [n] or [n, m]
_HTTP_URL = re.compile(r"^https?://[^\s<>\"'`]+$", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]")


def _escape_model_text(text: str) -> str:
    """Text the model (or the user) wrote, made inert: no HTML, no Markdown, no autolinks."""
    text = html.escape(_CONTROL.sub("", text), quote=False)
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    text = re.sub(r"://", ":&#47;&#47;", text)  # GFM autolinks need a literal "://"
    text = re.sub(r"(?i)\bwww\\\.", "www&#46;", text)  # ... or "www."
    return text.replace("@", "&#64;")  # ... or an e-mail address


def _link(url: str, label: str, css_class: str = "") -> str:
    """An anchor to a passage URL; anything but http(s) gives plain text."""
    if not isinstance(url, str) or not _HTTP_URL.match(url.strip()):
        return html.escape(label)
    class_attr = f' class="{css_class}"' if css_class else ""
    return (f'<a{class_attr} href="{html.escape(url.strip(), quote=True)}" target="_blank" '
            f'rel="noopener noreferrer">{html.escape(label)}</a>')


def _render_answer(answer: _Answer, final: bool) -> str:
    """The answer as the chat shows it: escaped text whose [n] markers link to passage n; once
    `final`, followed by its sources (or why there are none)."""
    body = _escape_model_text(answer.text.strip()) if answer.text.strip() else ""
    if answer.passages:
        def cite(match: re.Match) -> str:
            numbers = [int(n) for n in re.split(r"\s*,\s*", match.group(1))]
            if not all(1 <= n <= len(answer.passages) for n in numbers):
                return match.group(0)
            return "[" + ", ".join(_link(answer.passages[n - 1].url, str(n), "medvqa-cite") for n in numbers) + "]"
        body = _MARKER.sub(cite, body)
    if not final:
        return body or _status("Answering…")
    if not body:
        body = "_(The model gave no answer.)_"
    return body + "\n\n" + _sources_html(answer.passages, answer.note, answer.in_prompt)


def _sources_html(passages: list[Passage], note: str, in_prompt: bool = True) -> str:
    """The numbered sources of an answer. One HTML block with no blank line, so Markdown leaves it be."""
    if not passages:
        reason = html.escape(note or "No literature passage was retrieved.")
        return f'<div class="medvqa-sources medvqa-no-sources"><b>No literature support.</b> {reason}</div>'
    items = []
    for n, passage in enumerate(passages, start=1):
        origin = " · ".join(html.escape(part) for part in (passage.id, passage.source, passage.license) if part)
        items.append(
            f'<li value="{n}" class="medvqa-source" data-passage-id="{html.escape(passage.id, quote=True)}">'
            f'[{n}] {_link(passage.url, _passage_label(passage), "medvqa-source-link")}'
            + (f' <small>({origin})</small>' if origin else "")
            + f'<details><summary>Passage text</summary><blockquote>{html.escape(passage.text)}</blockquote>'
              f'</details></li>')
    heading = "<b>Sources</b>" if in_prompt else \
        "<b>Related literature</b> <small>(retrieved for your question; this model answers from the image alone)</small>"
    return f'<div class="medvqa-sources">{heading}<ol>{"".join(items)}</ol></div>'


def _passage_label(passage: Passage, limit: int = 90) -> str:
    """The link text of a source: its title, or (captions have none) the start of its text."""
    label = (passage.title or passage.text or passage.id).strip()
    return label if len(label) <= limit else label[:limit].rsplit(" ", 1)[0] + "…"


def _status(text: str) -> str:
    """A progress line in place of the answer (searching, answering), styled apart from model text."""
    return f'<span class="medvqa-status"><em>{html.escape(text)}</em></span>'


def _error_html(text: str) -> str:
    """An error shown in the chat: the app reports it there and keeps serving."""
    return f'<div class="medvqa-error">⚠ {html.escape(text)}</div>'


def _error_message(text: str) -> dict:
    """An error as a chat message of its own."""
    return {"role": "assistant", "content": _error_html(text)}
