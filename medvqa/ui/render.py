"""The chat's HTML: answers with their citation markers linked, the sources panel, status and errors.

Everything the model (or the user) wrote is made inert here before Gradio's Markdown sees it: no
HTML, no Markdown, no autolinks. The only anchors are built from `Passage.url` of the passages an
answer was given, and only for http(s) URLs. Passage fields (id, title, source, licence, text) go
through `safe_text.inert`, the one escaping every exit of a passage uses; the sources block holds no
newline at all, so nothing in a passage can end the HTML block and be read as Markdown.
"""

from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING

from ..answer_head import open_note
from ..confidence import held_out_text
from ..open_choices import choice_note
from ..presuppose import reading_text
from ..safe_text import inert, other_host, safe_url, visible

if TYPE_CHECKING:
    from ..injection import InjectionFinding
    from ..retrieval import Passage
    from .session import _Answer

_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")
_MARKER = re.compile(r"\\\[(\d{1,2}(?:\s*,\s*\d{1,2})*)\\\]")  # an escaped [n] or [n, m]
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]")


def _escape_model_text(text: str) -> str:
    """Text the model (or the user) wrote, made inert: no HTML, no Markdown, no autolinks, no
    bidirectional overrides or invisible characters."""
    text = html.escape(_CONTROL.sub("", visible(text)), quote=False)
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    text = re.sub(r"://", ":&#47;&#47;", text)  # GFM autolinks need a literal "://"
    text = re.sub(r"(?i)\bwww\\\.", "www&#46;", text)  # ... or "www."
    return text.replace("@", "&#64;")  # ... or an e-mail address


def _link(url: str, label: str, css_class: str = "") -> str:
    """An anchor to a passage URL; anything but http(s) gives plain text. `label` is passage text."""
    url = safe_url(url)
    if not url:
        return inert(label)
    class_attr = f' class="{css_class}"' if css_class else ""
    return (f'<a{class_attr} href="{html.escape(url, quote=True)}" target="_blank" '
            f'rel="noopener noreferrer">{inert(label)}</a>')


def _render_answer(answer: _Answer, final: bool) -> str:
    """The answer as the chat shows it: escaped text whose [n] markers link to passage n; once
    `final`, followed by its sources (or why there are none). Only passages the model read can be cited:
    beside an answer whose passages were found after it (related literature), a marker stays text; a
    number with no passage behind it says so."""
    body = _escape_model_text(answer.text.strip()) if answer.text.strip() else ""
    if answer.passages and answer.in_prompt:
        def cite(match: re.Match) -> str:
            numbers = [int(n) for n in re.split(r"\s*,\s*", match.group(1))]
            # The brackets stay escaped: "[7: …]" or "[1]" followed by "[7]: https://…" in the answer must
            # not become a Markdown link label with a definition the model wrote.
            return "\\[" + ", ".join(_link(answer.passages[n - 1].url, str(n), "medvqa-cite")
                                     if 1 <= n <= len(answer.passages) else f"{n}: no such source"
                                     for n in numbers) + "\\]"
        body = _MARKER.sub(cite, body)
    if not final:
        return body or _status("Answering…")
    if not body:
        body = "_(The model gave no answer.)_"
    warning = _injection_html(answer.injection) + "\n\n" if answer.injection is not None else ""
    reliance = _reliance_html(answer.closed) + "\n\n" if answer.closed and answer.closed.get("flagged") else ""
    if answer.closed and "kind" in answer.closed:
        confidence = _presupposed_html(answer.closed) + _confidence_html(answer.closed) + "\n\n"
    elif head := open_note(answer.head_open):  # an open answer the encoder's answer head gave
        confidence = f'<div class="medvqa-presupposed">{html.escape(head, quote=False)}</div>\n\n'
    elif chosen := choice_note(answer.open_choice):  # an open answer chosen among training answers
        confidence = f'<div class="medvqa-presupposed">{html.escape(chosen, quote=False)}</div>\n\n'
    else:  # a closed question answered in free text says its confidence was not measured
        note = answer.confidence_note
        confidence = f'<div class="medvqa-confidence">{html.escape(note)}</div>\n\n' if note else ""
    withheld = bool((answer.closed and answer.closed.get("abstained"))
                    or (answer.open_choice and answer.open_choice.get("abstained")))
    if withheld:  # set apart from a given answer by a bar beside it (page.PAGE_CSS), not by colour alone
        body = f'<div class="medvqa-withheld">\n\n{body}\n\n</div>'
    if answer.dropped_turns:
        confidence += f'<div class="medvqa-confidence">{html.escape(dropped_turns_note(answer.dropped_turns), quote=False)}</div>\n\n'
    return body + "\n\n" + confidence + reliance + warning + _sources_html(answer.passages, answer.note, answer.in_prompt,
                                                                answer.support, withheld)


def dropped_turns_note(count: int) -> str:
    """What an answer says when the prompt left out the conversation's oldest turns (Done.dropped_turns)."""
    # (Of the turns decoder.history_turns has it carry: with N there, the older ones are not read anyway.)
    turns = "the oldest earlier turn" if count == 1 else f"the {count} oldest earlier turns"
    return (f"This answer did not read {turns} it would have carried: the model's context holds the scan, the "
            "question and the latest turns, and no more.")


def _confidence_html(closed: dict) -> str:
    """How likely a closed answer is to be right (medvqa/confidence.py), or that nobody measured it."""
    if closed.get("confidence") is None:
        why = ("the calibration file was " + closed["uncalibrated"] if closed.get("uncalibrated")
               else "no calibration")
        return (f'<div class="medvqa-confidence">Confidence: not measured for this model ({html.escape(why)}), so '
                'treat this answer as unverified.</div>')
    if closed.get("held_out"):  # the out-of-fold reliability, from files that carry it
        measured = held_out_text(closed["held_out"])
        if closed.get("abstained"):
            return f'<div class="medvqa-confidence medvqa-uncertain">Not answered: {_why_withheld(closed, measured)}.</div>'
        return f'<div class="medvqa-confidence">Confidence: {measured}.</div>'
    share = f"{100 * closed['confidence']:.0f} %"
    if closed.get("abstained"):
        return (f'<div class="medvqa-confidence medvqa-uncertain">Not answered: the option it leans to is '
                f'estimated right {share} of the time on images it was not trained on.</div>')
    return (f'<div class="medvqa-confidence">Confidence: {share} (how often answers with this margin were right '
            f'on held-out training images).</div>')


def _why_withheld(closed: dict, measured: str) -> str:
    """Why a closed answer was withheld, where the leaning above it already gives its figure: the accuracy
    the app answers at (the calibration's target), or that no confidence of its kind reached it."""
    below = closed.get("withheld_below")
    if not below:
        return measured
    target = f"{100 * below['target_accuracy']:.0f} %"
    if below["never_met"]:
        return (f"on held-out training images, no confidence of answers like this was right {target} of the time, "
                "so the app withholds them all")
    return (f"the app answers where held-out answers at that confidence or above were right at least {target} of "
            "the time; this one's confidence is below that")


def _presupposed_html(closed: dict) -> str:
    """How a yes/no question was read when it was scored through the open question it presupposes
    (medvqa/presuppose.py): the clinician sees what "Yes" means here."""
    text = reading_text(closed)
    return f'<div class="medvqa-presupposed">{html.escape(text, quote=False)}</div>' if text else ""


def _reliance_html(closed: dict) -> str:
    """The note under a closed answer that the model gives without looking at the scan (for an
    "Uncertain" answer, about the option it leans to: it gave no answer to depend on anything)."""
    if closed.get("abstained"):
        return ('<div class="medvqa-reliance">Its leaning does not come from the image either: with a blank '
                'image the model leans the same way, with most of the same margin.</div>')
    return ('<div class="medvqa-reliance">This answer does not depend on the image: with a blank image the '
            'model gives the same answer, with most of the same margin.</div>')


def _injection_html(finding: InjectionFinding) -> str:
    """The warning shown under an answer that repeats an instruction or a link from a passage."""
    return f'<div class="medvqa-injection" role="alert">⚠ {html.escape(finding.warning)}</div>'


def _support_html(mark: tuple | None) -> str:
    """A source's mark (trust.mark_support) in a clinician's words: literature can describe a finding,
    not confirm what this scan shows. "describes cardiomegaly" or "describes cardiomegaly as absent"
    opens on the sentence it rests on, the finding highlighted, and why; anything else is "related"."""
    if not mark or mark[0] not in _MARK_WORDS or mark[1] is None:
        return ' <small class="medvqa-related">related</small>'
    kind, evidence = mark
    words, why = _MARK_WORDS[kind]
    cue = f" (“{inert(evidence.cue)}”)" if kind == "contradicts" and evidence.cue else ""
    return (f' <details class="medvqa-mark medvqa-{kind}"><summary>{words.format(inert(evidence.phrase))}</summary>'
            f'<blockquote>{_highlight(evidence.sentence, evidence.start, evidence.end)}</blockquote>'
            f'<small>{why.format(cue=cue)}</small></details>')


_MARK_WORDS = {
    "supports": ("describes {}", "This sentence states the finding the answer names, and does not deny it, "
                 "make it conditional or call it only possible. Literature describes findings in other "
                 "patients; it cannot confirm what this scan shows."),
    "contradicts": ("describes {} as absent", "This sentence denies the finding the answer names{cue}. It is "
                    "about other patients, but worth checking against the scan."),
}


def _highlight(sentence: str, start: int, end: int) -> str:
    """A sentence made inert, with the part from `start` to `end` marked."""
    before, named, after = sentence[:start], sentence[start:end], sentence[end:]
    return (inert(before) + (" " if before[-1:].isspace() else "") + f"<mark>{inert(named)}</mark>"
            + (" " if after[:1].isspace() else "") + inert(after))


def _sources_html(passages: list[Passage], note: str, in_prompt: bool = True, support: list | None = None,
                  withheld: bool = False) -> str:
    """The numbered sources of an answer, each with its mark (describes the finding, describes it as
    absent, related). One HTML block with no blank line, so Markdown leaves it be. For an answer `withheld`
    as "Uncertain" (it asserts nothing) they were retrieved for the question alone, and the heading says so."""
    if not passages:
        reason = html.escape(note or "No literature passage was retrieved.")
        return f'<div class="medvqa-sources medvqa-no-sources"><b>No literature support.</b> {reason}</div>'
    items = []
    marks = list(support or []) + [None] * (len(passages) - len(support or []))
    for n, (passage, mark) in enumerate(zip(passages, marks), start=1):
        # A link to a site other than PubMed or PMC says where it goes.
        host = other_host(passage.url)
        origin = " · ".join(inert(part) for part in (passage.id, passage.source, passage.license,
                                                     f"link to {host}" if host else "") if inert(part))
        items.append(
            f'<li value="{n}" class="medvqa-source" data-passage-id="{inert(passage.id)}">'
            f'[{n}] {_link(passage.url, _passage_label(passage), "medvqa-source-link")}'
            + (f' <small>({origin})</small>' if origin else "") + _support_html(mark)
            + f'<details><summary>Passage text</summary><blockquote>{_passage_text_html(passage.text)}</blockquote>'
              f'</details></li>')
    supported = any(mark and mark[0] == "supports" for mark in marks)
    contradicted = any(mark and mark[0] == "contradicts" for mark in marks)
    if in_prompt:
        heading = "<b>Sources</b> <small>(the passages the model read)</small>"
    elif withheld:
        heading = ("<b>Related literature</b> <small>(retrieved for your question; the answer above is withheld, so "
                   "it states nothing a source could describe)</small>")
    else:
        heading = ("<b>Related literature</b> <small>(retrieved for your question and this answer; this model "
                   "does not read them: it answers from the image and the question)</small>")
    if not supported and not withheld:
        heading += " <small>No source describes what this answer states.</small>"
    if contradicted:
        heading += " <small>A source describes it as absent.</small>"
    return f'<div class="medvqa-sources">{heading}<ol>{"".join(items)}</ol></div>'


def _passage_text_html(text: str) -> str:
    """A passage's text, always as text: each line made inert, lines joined by <br> (never a newline,
    which could end the HTML block and let the rest be read as Markdown)."""
    return "<br>".join(line for line in (inert(line) for line in str(text or "").splitlines()) if line)


def _passage_label(passage: Passage, limit: int = 90) -> str:
    """The link text of a source: its title, or (captions have none) the start of its text."""
    label = (passage.title or passage.text or passage.id).strip()
    return label if len(label) <= limit else label[:limit].rsplit(" ", 1)[0] + "…"


def _status(text: str) -> str:
    """A progress line in place of the answer (searching, answering), styled apart from model text."""
    return f'<span class="medvqa-status"><em>{html.escape(text)}</em></span>'


def _note(text: str) -> str:
    """A line of the app's that stays in the chat (a question not asked, a conversation closed), styled as
    a status line; the page reads it out to a screen reader as it reads a finished answer."""
    return f'<span class="medvqa-status medvqa-note"><em>{html.escape(text)}</em></span>'


def _error_html(text: str) -> str:
    """An error shown in the chat: the app reports it there and keeps serving."""
    return f'<div class="medvqa-error">⚠ {html.escape(text)}</div>'


def _error_message(text: str) -> dict:
    """An error as a chat message of its own."""
    return {"role": "assistant", "content": _error_html(text)}
